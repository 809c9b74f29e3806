"""Cost model: per-device memory, redundant memory and communication (bytes and seconds) of a candidate.

Memory per device of a placement of a tensor is its local bytes. A parameter stores, per element:
weights and gradients (4 + 4 bytes in fp32; 2 + 2 in bf16/fp16 with 4 bytes of fp32 master
weights), and Adam's two fp32 moments (8 bytes; none for SGD). ZeRO over the data-parallel axes
on which the parameter is replicated divides the optimizer states (stage 1), also the gradients
(stage 2), also the weights (stage 3) by the product of those axes' sizes; MiCS does the same inside
partition groups of size p (the dp axes whose product is p) and replicates across groups.

Redundant memory (the minimal-memory-redundancy paper's objective) of a stored piece is what the
other holders of the same piece keep: ``local_bytes * (replication - 1)``, where replication is
the product of the sizes of the axes on which the piece is replicated or partial. For a matmul with
data-, row- and column-parallel degrees d, r, c (X=(S(0),S(1),R), W=(R,S(0),S(1)),
Y=(S(0),P,S(1))) this is Eq. 4 of the paper, (d(d-1)|W| + r(r-1)|Y| + c(c-1)|X|) / (drc).

Communication, counted forward and backward (each redistribution has a dual):

    all_gather     S -> R   (n-1)/n * B_out forward; backward keeps the local shard
    local_shard    R -> S   nothing forward; the gradient is all-gathered backward
    all_reduce     P -> R   2(n-1)/n * B forward; backward is the identity (Megatron's g)
    reduce_scatter P -> S   (n-1)/n * B forward; the gradient is all-gathered backward
    R used by a computation that differs across an axis: all-reduce of its gradient (Megatron's f;
    for parameters, the data-parallel gradient all-reduce; reduce-scatter + all-gather under ZeRO)

Bytes become seconds with the ClusterSpec's alpha-beta model of the axis's link (intra-node when
the axis's ranks share a node, else the inter-node network). There is always a cluster: without one
the model prices on the ``local-cpu`` preset, never by bytes alone (which would make computing
everything on every rank free).

Computation: an op's forward plus backward takes three times its forward, the larger of its FLOPs
at the cluster's sustained rate and its bytes at the cluster's memory bandwidth (a roofline),
divided over the axes on which its ranks compute different pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autopar.ir.axes import data_axes
from autopar.ir.core import MeshSpec, Placement, Replicate, Shard, TensorType
from autopar.ir.layout import Unreachable, redistribute_steps, replication
from autopar.solver.cluster import ClusterSpec
from autopar.solver.saved import activation_bytes

INF = math.inf
EFFICIENCY = 0.5  # fraction of peak FLOP/s a training step sustains (Megatron reports ~50% at scale)
BUCKET_BYTES = 25 * 2**20  # gradients are all-reduced in flat buckets of at most this size (DDP's default)


@dataclass(frozen=True)
class TrainingSetup:
    """What the memory model assumes about training."""

    optimizer: str = "adam"  # "adam": two fp32 moments per parameter; "sgd": none
    precision: str = "fp32"  # "fp32" or "bf16"/"fp16" mixed precision (with fp32 master weights)
    zero: int = 0  # ZeRO stage over the data-parallel axes: 0, 1, 2 or 3
    zero_axes: tuple[str, ...] | None = None  # default: the data-parallel (dp*) axes, ir/axes.py
    mics_group: int | None = None  # MiCS partition group size (shards inside groups of this many ranks)

    def shard_axes(self, mesh: MeshSpec) -> tuple[int, ...]:
        names = self.zero_axes if self.zero_axes is not None else data_axes(mesh.names)
        axes = tuple(mesh.index(n) for n in names if n in mesh.names)
        if self.mics_group is None:
            return axes
        # MiCS: shard over the innermost dp axes whose sizes multiply to the partition group size
        chosen, size = [], 1
        for i in reversed(axes):
            if size * mesh.sizes[i] > self.mics_group:
                break
            chosen.append(i)
            size *= mesh.sizes[i]
        return tuple(sorted(chosen))

    @property
    def bytes_per_param(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer states incl. master weights) bytes per element."""
        states = 8.0 if self.optimizer == "adam" else 0.0
        if self.precision == "fp32":
            return 4.0, 4.0, states
        return 2.0, 2.0, states + 4.0


@dataclass
class CostModel:
    mesh: MeshSpec
    setup: TrainingSetup = field(default_factory=TrainingSetup)
    cluster: ClusterSpec | None = None

    def __post_init__(self):
        if self.cluster is None:
            self.cluster = default_cluster()
        self._zero_axes = self.setup.shard_axes(self.mesh)
        self._intra = _axes_intra_node(self.mesh, self.cluster)
        self._memo: dict = {}
        self._terms = _shared_terms(self.mesh, self._intra, self.cluster)
        self._blocks: dict = {}

    # -- memory ---------------------------------------------------------------------------------
    def local_bytes(self, t: TensorType, p: tuple[Placement, ...]) -> float:
        return t.nbytes / self._shards(p)

    def _shards(self, p: tuple[Placement, ...]) -> int:
        """Into how many pieces p cuts a tensor (local bytes = global bytes / this)."""
        return math.prod(n for q, n in zip(p, self.mesh.sizes) if isinstance(q, Shard))

    def param_memory(self, t: TensorType, p: tuple[Placement, ...]) -> tuple[float, float]:
        """(bytes per device, redundant bytes) of a parameter's weights, gradients, optimizer states."""
        key = ("p", t, p)
        if key not in self._memo:
            self._memo[key] = self._param_memory(t, p)
        return self._memo[key]

    def _param_memory(self, t: TensorType, p: tuple[Placement, ...]) -> tuple[float, float]:
        numel = self.local_bytes(t, p) / t.itemsize
        zero_axes = [i for i in self._zero_axes if isinstance(p[i], Replicate)]
        zf = math.prod(self.mesh.sizes[i] for i in zero_axes)
        skip = frozenset(zero_axes)
        repl_all = replication(p, self.mesh.sizes)
        repl_sharded = replication(p, self.mesh.sizes, skip)
        mem = red = 0.0
        for stage, b in zip((3, 2, 1), self.setup.bytes_per_param):
            sharded = self.setup.zero >= stage
            piece = numel * b / (zf if sharded else 1)
            mem += piece
            red += piece * ((repl_sharded if sharded else repl_all) - 1)
        return mem, red

    def activation_memory(self, t: TensorType, p: tuple[Placement, ...]) -> tuple[float, float]:
        local = self.local_bytes(t, p)
        return local, local * (self.replication(p) - 1)

    def replication(self, p: tuple[Placement, ...]) -> int:
        """On how many ranks each piece of a value placed p is held (or summed)."""
        return replication(p, self.mesh.sizes)

    # -- communication --------------------------------------------------------------------------
    def _collective(self, kind: str, nbytes: float, axis: int) -> tuple[float, float]:
        """(volume in bytes, seconds) of one collective of a tensor of nbytes on one axis."""
        if nbytes == 0:
            return 0.0, 0.0
        v, per_byte, latency = self._collective_terms(kind, axis)
        return nbytes * v, nbytes * per_byte + latency

    def redistribute(
        self, t: TensorType, src: tuple[Placement, ...], dst: tuple[Placement, ...], grad: bool | None = None
    ) -> tuple[float, float]:
        """(bytes, seconds) per device to turn src into dst, forward plus backward (``grad``: whether
        the value has a gradient, default: whether it is a float); INF if impossible."""
        a, b = self._terms.ids([src, dst])
        grad = t.is_float if grad is None else grad
        v, per_byte, latency = self._terms.terms(a, b, grad, self._redistribute_terms)
        if v == INF:
            return INF, INF
        nbytes = t.nbytes
        return (nbytes * v, nbytes * per_byte + latency) if nbytes else (0.0, 0.0)

    def redistribute_matrix(
        self,
        t: TensorType,
        srcs: list[tuple[Placement, ...]],
        dsts: list[tuple[Placement, ...] | None],
        grad: bool | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`redistribute` of t from every placement in srcs (rows) to every one in dsts (columns; None
        needs nothing), as two arrays: what prices an edge of the strategy graph at once.

        Bytes and seconds are linear in the tensor's global bytes N: bytes = N * v, seconds =
        N * s + latency, with (v, s, latency) per placement pair, computed once per mesh."""
        cache, grad = self._terms, t.is_float if grad is None else grad
        a_ids, b_ids = cache.ids(srcs), cache.ids(dsts)
        key = (tuple(a_ids), tuple(b_ids), grad)
        terms = self._blocks.get(key)
        if terms is None:
            flat = [cache.terms(a, b, grad, self._redistribute_terms) for a in a_ids for b in b_ids]
            terms = self._blocks[key] = np.array(flat, dtype=float).reshape(len(srcs), len(dsts), 3)
        nbytes = t.nbytes
        if not nbytes:
            nothing = np.where(np.isinf(terms[..., 0]), INF, 0.0)
            return nothing, nothing.copy()
        return nbytes * terms[..., 0], nbytes * terms[..., 1] + terms[..., 2]

    def _redistribute_terms(self, src, dst, grad: bool) -> tuple[float, float, float]:
        """(v, s, latency) of `redistribute_matrix` for one pair; INF where dst cannot be reached."""
        if dst is None:
            return 0.0, 0.0, 0.0
        try:
            steps = redistribute_steps(src, dst)
        except Unreachable:
            return INF, INF, INF
        vol = per_byte = latency = 0.0
        for s in steps:
            # the collectives of a step, each with the placement that fixes its message size
            if s.kind == "all_gather":
                parts = [("all_gather", s.after)]
            elif s.kind == "all_reduce":
                parts = [("all_reduce", s.before)]
            elif s.kind == "reduce_scatter":
                parts = [("reduce_scatter", s.before)] + ([("all_gather", s.before)] if grad else [])
            else:  # local_shard: the gradient is all-gathered backward
                parts = [("all_gather", s.before)] if grad else []
            for kind, p in parts:
                v, a, b = self._collective_terms(kind, s.axis)
                share = 1 / self._shards(p)  # local bytes per global byte
                vol, per_byte, latency = vol + v * share, per_byte + a * share, latency + b
        return vol, per_byte, latency

    def _collective_terms(self, kind: str, axis: int) -> tuple[float, float, float]:
        """A collective of a non-empty tensor of N bytes on one axis as linear terms: (volume per byte,
        seconds per byte, latency seconds)."""
        key = ("c", kind, axis)
        if key not in self._memo:
            n = self.mesh.sizes[axis]
            factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[kind]
            if n == 1:
                self._memo[key] = 0.0, 0.0, 0.0
            else:
                self._memo[key] = (factor, *self.cluster.collective_terms(kind, n, self._intra[axis]))
        return self._memo[key]

    def compute_seconds(self, flops: float, split: list[bool], nbytes: float = 0.0) -> float:
        """Forward plus backward (3x forward) time of an op whose work is divided over the axes where
        ``split`` is true: its FLOPs at the cluster's efficiency (default ``EFFICIENCY``) of its peak
        (fp32 for fp32 training), or its bytes at the cluster's memory bandwidth when that is slower."""
        if not flops and not nbytes:
            return 0.0
        ways = math.prod(n for n, s in zip(self.mesh.sizes, split) if s)
        dtype = "fp32" if self.setup.precision == "fp32" else self.setup.precision
        rate = self.cluster.peak(dtype) * (self.cluster.efficiency or EFFICIENCY)
        seconds = flops / rate
        if self.cluster.memory_bandwidth and nbytes:
            seconds = max(seconds, nbytes / self.cluster.memory_bandwidth)
        return 3.0 * seconds / ways

    def inherent(self, target: str, in_types: list[TensorType], in_placements) -> tuple[float, float]:
        """(bytes, seconds) of collectives an op runs inside itself (C_v of the paper): a
        vocab-parallel cross-entropy all-reduces a max, a sum and a target logit per row."""
        if target != "aten.cross_entropy_loss" or not in_placements or in_placements[0] is None:
            return 0.0, 0.0
        vol = sec = 0.0
        rows = in_types[0].shape[0] * 4
        for a, p in enumerate(in_placements[0]):
            if isinstance(p, Shard) and p.dim == 1:
                b, x = self._collective("all_reduce", rows, a)
                vol, sec = vol + 3 * b, sec + 3 * x
        return vol, sec

    def grad_reduce(
        self, t: TensorType, p: tuple[Placement, ...], axis: int, bucketed: bool = False
    ) -> tuple[float, float]:
        """(bytes, seconds) of all-reducing the gradient of a value replicated on ``axis``; a
        ``bucketed`` one (a parameter's, synchronized after backward in one flat buffer per axis)
        pays bandwidth only, the bucket's latency being shared by every parameter in it."""
        nbytes = self.local_bytes(t, p)
        if not bucketed:
            return self._collective("all_reduce", nbytes, axis)
        v, per_byte, _ = self._collective_terms("all_reduce", axis)
        return nbytes * v, nbytes * per_byte


class _Terms:
    """Redistribution terms per pair of placements (numbered, so a pair is a cheap key), shared by the
    cost models of one mesh and cluster: planning a model builds several problems on one mesh."""

    def __init__(self):
        self._ids: dict = {}
        self._placements: list = []
        self._terms: dict[tuple[int, int, bool], tuple[float, float, float]] = {}

    def ids(self, placements: list) -> list[int]:
        out = []
        for p in placements:
            i = self._ids.get(p)
            if i is None:
                i = self._ids[p] = len(self._placements)
                self._placements.append(p)
            out.append(i)
        return out

    def terms(self, a: int, b: int, grad: bool, compute) -> tuple[float, float, float]:
        key = (a, b, grad)
        found = self._terms.get(key)
        if found is None:
            found = self._terms[key] = compute(self._placements[a], self._placements[b], grad)
        return found


_SHARED_TERMS: dict[tuple, _Terms] = {}


def default_cluster() -> ClusterSpec:
    """The spec a cost model without one prices on: the ``local-cpu`` preset."""
    global _DEFAULT_CLUSTER
    if _DEFAULT_CLUSTER is None:
        _DEFAULT_CLUSTER = ClusterSpec.load("local-cpu")
    return _DEFAULT_CLUSTER


_DEFAULT_CLUSTER: ClusterSpec | None = None


def _shared_terms(mesh: MeshSpec, intra: list[bool], cluster: ClusterSpec) -> _Terms:
    links = (cluster.alpha_beta(True), cluster.alpha_beta(False), tuple(sorted(cluster.collectives.items())))
    key = (mesh.sizes, tuple(intra), links)
    if key not in _SHARED_TERMS and len(_SHARED_TERMS) >= 16:
        _SHARED_TERMS.clear()
    return _SHARED_TERMS.setdefault(key, _Terms())


def _axes_intra_node(mesh: MeshSpec, cluster: ClusterSpec) -> list[bool]:
    """Ranks are laid out row-major over the mesh (last axis fastest): an axis stays inside a node
    when its stride times its size fits in one node's devices."""
    out = []
    stride = 1
    for n in reversed(mesh.sizes):
        out.append(stride * n <= cluster.devices_per_node)
        stride *= n
    return list(reversed(out))


def memory_categories(prog, setup: TrainingSetup | None = None) -> dict[str, float]:
    """Predicted bytes per device of a planned program (after insert-collectives) by category: ``params``,
    ``grads``, ``optimizer`` (states and master weights, as ZeRO divides them), ``inputs`` (the batch and
    buffers), ``activations`` (what autograd saves for backward, ``solver/saved.py``: held together at
    the end of the forward) and ``buffers`` (the gradient-sync bucket)."""
    model = CostModel(prog.mesh, setup or TrainingSetup())
    out = dict.fromkeys(("params", "grads", "optimizer", "inputs", "activations", "buffers"), 0.0)
    synced = 0.0
    zero_axes = model.setup.shard_axes(model.mesh)
    for v in prog.inputs:
        local = model.local_bytes(v.type, v.type.placements)
        if v.kind != "param":
            out["inputs"] += local
            continue
        numel = local / v.type.itemsize
        split = math.prod(model.mesh.sizes[i] for i in zero_axes if isinstance(v.type.placements[i], Replicate))
        for (stage, name), b in zip(((3, "params"), (2, "grads"), (1, "optimizer")), model.setup.bytes_per_param):
            out[name] += numel * b / (split if model.setup.zero >= stage else 1)
        if v.attrs.get("grad_sync"):
            synced += local
    out["activations"] = activation_bytes(prog)
    out["buffers"] = min(synced, BUCKET_BYTES)
    return out


def program_memory(prog, setup: TrainingSetup | None = None) -> float:
    """Predicted peak bytes per device of a planned program: the sum of `memory_categories`."""
    return sum(memory_categories(prog, setup).values())
