"""Cost model: per-device memory, redundant memory and communication (bytes and seconds) of a candidate.

Memory per device of a placement of a tensor is its local bytes. A parameter stores, per element, what
the runtime holds (``TrainingSetup.bytes_per_param``): its fp32 weight and fp32 gradient (4 + 4 bytes,
in mixed precision too: the parameters are the fp32 master weights and their gradients accumulate in
fp32, ``runtime/build/precision.py``), Adam's two fp32 moments (8 bytes; none for SGD), and under ZeRO-1/2 the
optimizer's fp32 flat slice of the parameters it steps (4 bytes, ``runtime/grads/zero.py``). ZeRO over the
data-parallel axes on which the parameter is replicated divides the optimizer states (stage 1), also
the gradients (stage 2), also the weights (stage 3) by the product of those axes' sizes; MiCS does the
same inside partition groups of size p (the dp axes whose product is p) and replicates across groups.
Mixed precision adds the compute copy (2 bytes in bf16/fp16, ``TrainingSetup.copy_bytes``): made per
use in the forward and saved for the backward, it is priced once per parameter element, unsharded, except
for a parameter ZeRO-3 gathers (``copy_bytes_of``): the runtime casts it from its gathered unit and saves
the copy for the backward as a token, cast again from the unit gathered again (``runtime/grads/zero3.py``),
so its copy is held with the gathered units only; gradients are reduced in ``reduce_dtype``
(``TrainingSetup.grad_itemsize``: 4 bytes by default).
ZeRO-3 also holds whole weights while it computes, one unit at a time (``runtime/grads/zero3.py``): at most
the root unit and two repeated blocks, with the copies of the block computing (``zero3_gathered``).

Redundant memory (the minimal-memory-redundancy paper's objective) of a stored piece is what the
other holders of the same piece keep: ``local_bytes * (replication - 1)``, where replication is
the product of the sizes of the axes on which the piece is replicated or partial. For a matmul with
data-, row- and column-parallel degrees d, r, c (X=(S(0),S(1),R), W=(R,S(0),S(1)),
Y=(S(0),P,S(1))) this is Eq. 4 of the paper, (d(d-1)|W| + r(r-1)|Y| + c(c-1)|X|) / (drc).

Communication, counted forward and backward (each redistribution has a dual):

    all_gather     S -> R   (n-1)/n * B_out forward; backward keeps the local shard
    all_to_all     S(a) -> S(b)  (n-1)/n * B_local forward; the reverse backward (Ulysses' sequence <-> heads)
    local_shard    R -> S   nothing forward; the gradient is all-gathered backward
    all_reduce     P -> R   2(n-1)/n * B forward; backward is the identity (Megatron's g)
    reduce_scatter P -> S   (n-1)/n * B forward; the gradient is all-gathered backward
    R used by a computation that differs across an axis: all-reduce of its gradient (Megatron's f;
    for parameters, the data-parallel gradient all-reduce; reduce-scatter + all-gather under ZeRO)

Bytes become seconds with the ClusterSpec's alpha-beta model of the axis's link (intra-node when
the axis's ranks share a node, else the inter-node network). There is always a cluster: without one
the model prices on the ``local-cpu`` preset, never by bytes alone (which would make computing
everything on every rank free).

Computation: an op's forward plus backward takes three times its forward, priced by the one compute model
(``solver/cluster/compute.py``: a roofline with a per-op-class efficiency from the cluster's device table,
by the op's shape and dtype) on the piece one rank computes, the op divided over the axes on which its
ranks compute different pieces. ``op_seconds`` prices an IR op, ``flop_seconds`` FLOPs of matmul work of
a known or unknown shape (what a term that only counts FLOPs calls); the stage balancer and the search
call the same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import SolverError
from autopar.ir.axes import CONTEXT_AXIS, data_axes
from autopar.ir.core import MeshSpec, Placement, Program, Ref, Replicate, Shard, TensorType
from autopar.ir.layout import Unreachable, redistribute_steps, replication
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding import experts
from autopar.solver.sharding.rules.context import is_ring
from autopar.solver.sharding.strategies import column_weight

INF = math.inf
ATTENTION = "aten.scaled_dot_product_attention"


def _balanced_member(p: int, n: int) -> int:
    """The rank holding piece ``p`` of ``2n`` in ring attention's load-balanced layout (rank r: pieces r, 2n-1-r)."""
    return p if p < n else 2 * n - 1 - p


BUCKET_BYTES = 25 * 2**20  # gradients are all-reduced in flat buckets closed at this size (DDP's default)


@dataclass(frozen=True)
class TrainingSetup:
    """What the memory model assumes about training."""

    optimizer: str = "adam"  # "adam": two fp32 moments per parameter; "sgd": none
    precision: str = "fp32"  # "fp32" or "bf16"/"fp16" mixed precision (with fp32 master weights)
    reduce_dtype: str = "fp32"  # the dtype gradients are reduced in under mixed precision (its reduce_dtype)
    zero: int = 0  # ZeRO stage over the data-parallel axes: 0, 1, 2 or 3
    zero_axes: tuple[str, ...] | None = None  # default: the data-parallel (dp*) axes, ir/axes.py
    mics_group: int | None = None  # MiCS partition group size (shards inside groups of this many ranks)
    # gradients are all-reduced in flat buckets closed at this size (DDP's bucket_cap_mb, default 25 MiB;
    # solver/sharding/buckets.py): the runtime launches one all-reduce per bucket and the cost model prices its latency
    bucket_cap_mb: float = BUCKET_BYTES / 2**20
    # the runtime fuses Megatron's f with the matmuls reading it (runtime/comm/column_linear.py), so that on NCCL its
    # all-reduce is hidden behind their weight gradients; not under a split backward (zero-bubble schedules) or
    # sub-pipelined tensor parallelism, where the f runs on its own (runtime/module.py)
    overlap_tp: bool = True
    # the rank programs run under torch.compile (torch_compile=True): every price model prices their elementwise
    # ops fused, each group between two matmuls one kernel by its outside bytes (solver/cluster/compute.compiled_works;
    # op by op, each op its share of its kernel: compute.compiled_shares)
    compiled: bool = False
    # the busiest expert-parallel rank's rows over the mean that the router's skew adds (1: uniform routing, what
    # a load-balancing loss aims at): expert all-to-alls and the experts' computation are priced at that rank's
    # rows (solver/sharding/experts.py:busiest_rows)
    router_imbalance: float = experts.DEFAULT_IMBALANCE
    # a mixture of experts' capacity factor c (ShardOptions.capacity_factor, which sets it): each expert keeps c
    # times its mean rows, so the busiest expert rank's rows are capped at c times the mean (None: dropless)
    capacity_factor: float | None = None
    # ZeRO-3's unit gathers and reduce-scatters over a group spanning nodes run in two steps, across the nodes then
    # inside each (MiCS Sec. 3.3, runtime/grads/node_gather.py), and are priced so; False: one flat ring. Decided
    # where the plan is made, from the cluster (``zero_gathers_pay``, solver/sharding/options.py:decide_gathers)
    hierarchical_gather: bool = False

    def __post_init__(self) -> None:
        if not self.router_imbalance >= 1:
            raise SolverError(
                f"router_imbalance={self.router_imbalance}: the busiest expert rank's rows over the mean is at least "
                "1 (1: uniform routing; 1.5: the busiest rank gets half again the mean)"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise SolverError(
                f"capacity_factor={self.capacity_factor}: an expert's capacity factor must be positive (None: dropless)"
            )

    @property
    def bucket_bytes(self) -> float:
        return self.bucket_cap_mb * 2**20

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
        """(weights, gradients, optimizer states) bytes per element, as the runtime holds them in fp32 and
        in mixed precision alike: the fp32 parameter (the master weight), its fp32 gradient, Adam's two
        moments, and under ZeRO-1/2 the optimizer's fp32 flat slice of the parameters."""
        states = 8.0 if self.optimizer == "adam" else 0.0
        if self.zero in (1, 2):
            states += 4.0
        return 4.0, 4.0, states

    @property
    def copy_bytes(self) -> float:
        """Bytes per parameter element of the compute-dtype copy mixed precision makes per use (0 in fp32)."""
        return 0.0 if self.precision == "fp32" else 2.0

    def grad_itemsize(self, itemsize: int) -> int:
        """Bytes per element a gradient reduction sends, for a parameter typed ``itemsize`` in the program:
        the reduce dtype's under mixed precision, else the parameter's own."""
        return itemsize if self.precision == "fp32" else {"fp32": 4, "bf16": 2, "fp16": 2}[self.reduce_dtype]


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
        self._per_node = _axes_per_node(self.mesh, self.cluster)
        self._memo: dict = {}
        self._terms = _shared_terms(self.mesh, self._intra, self.cluster)
        self._blocks: dict = {}
        self.device = compute.device_of(self.cluster)
        self._shares: dict[int, tuple[object, compute.Work]] = {}  # id(op) -> (op, its compiled share)

    def price_program(self, prog: Program) -> None:
        """Price ``prog``'s ops as its compiled run runs them where the plan is for one (``setup.compiled``): each
        op then costs its share of its fused kernel (``compute.compiled_shares`` over the program), so the ops
        of a fused group sum to the group's price; else (eager) nothing changes."""
        if self.setup.compiled:
            shares = compute.compiled_shares(prog.ops, prog.types(), self.dtype)
            self._shares = {id(op): (op, w) for op, w in zip(prog.ops, shares)}
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "op"}

    def compiled_share(self, op) -> compute.Work | None:
        """``op``'s share of its compiled kernel (``price_program``), None when the plan is priced eager."""
        found = self._shares.get(id(op))
        return found[1] if found is not None and found[0] is op else None

    # -- memory ---------------------------------------------------------------------------------
    def local_bytes(self, t: TensorType, p: tuple[Placement, ...]) -> float:
        return t.nbytes / self._shards(p)

    def _shards(self, p: tuple[Placement, ...]) -> int:
        """Into how many pieces p cuts a tensor (local bytes = global bytes / this)."""
        return math.prod(n for q, n in zip(p, self.mesh.sizes) if isinstance(q, Shard))

    def param_memory(self, t: TensorType, p: tuple[Placement, ...], frozen: bool = False) -> tuple[float, float]:
        """(bytes per device, redundant bytes) of a parameter's weights, gradients, optimizer states; of a
        ``frozen`` one (no gradient, not stepped) its weights and compute copy only."""
        key = ("p", t, p, frozen)
        if key not in self._memo:
            self._memo[key] = self._param_memory(t, p, frozen)
        return self._memo[key]

    def state_bytes(self, t: TensorType, p: tuple[Placement, ...], frozen: bool = False) -> tuple[float, float, float]:
        """(weight, gradient, optimizer-state) bytes per device a parameter keeps between steps (the per-use
        compute copy apart), as ZeRO shards them: what ``tests/test_mixed_precision.py`` measures; a
        ``frozen`` one keeps no gradient or state."""
        numel = self.local_bytes(t, p) / t.itemsize
        zf = self.zero_factor(p)
        per = self._per_param(zf, frozen)
        return tuple(numel * b / (zf if self.setup.zero >= stage else 1) for stage, b in zip((3, 2, 1), per))

    def zero_factor(self, p: tuple[Placement, ...]) -> int:
        """How many ways ZeRO shards a parameter placed ``p`` (its ZeRO axes on which it is replicated)."""
        return math.prod(self.mesh.sizes[i] for i in self._zero_axes if isinstance(p[i], Replicate))

    def copy_bytes_of(self, t: TensorType, p: tuple[Placement, ...]) -> float:
        """Bytes per element of mixed precision's compute copy a parameter placed ``p`` holds through the
        forward: ``copy_bytes``, or 0 for one ZeRO-3 gathers (its copies are held with the gathered units,
        ``solver/sharding/memory.py:zero3_gathered``)."""
        zero = [i for i in self._zero_axes if self.mesh.sizes[i] > 1]
        managed = self.setup.zero >= 3 and zero and t.is_float and all(isinstance(p[i], Replicate) for i in zero)
        return 0.0 if managed else self.setup.copy_bytes

    def _per_param(self, zf: int, frozen: bool = False) -> tuple[float, float, float]:
        """``bytes_per_param`` for a parameter ZeRO shards ``zf`` ways: no flat slice when it is not sharded
        (the ZeRO-1/2 optimizer steps such a parameter itself); a ``frozen`` one's weights only."""
        w, g, s = self.setup.bytes_per_param
        if frozen:
            return w, 0.0, 0.0
        return w, g, s - (4.0 if self.setup.zero in (1, 2) and zf == 1 else 0.0)

    def _param_memory(self, t: TensorType, p: tuple[Placement, ...], frozen: bool) -> tuple[float, float]:
        numel = self.local_bytes(t, p) / t.itemsize
        zero_axes = [i for i in self._zero_axes if isinstance(p[i], Replicate)]
        zf = math.prod(self.mesh.sizes[i] for i in zero_axes)
        repl_all = replication(p, self.mesh.sizes)
        repl_sharded = replication(p, self.mesh.sizes, frozenset(zero_axes))
        mem = red = 0.0
        for stage, b in zip((3, 2, 1, 4), (*self._per_param(zf, frozen), self.copy_bytes_of(t, p))):
            sharded = self.setup.zero >= stage  # stage 4: the per-use compute copy, never sharded
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
            elif s.kind == "all_to_all":  # the gradient goes back by the reverse all-to-all
                parts = [("all_to_all", s.before)] + ([("all_to_all", s.after)] if grad else [])
            elif s.kind == "reduce_scatter":
                parts = [("reduce_scatter", s.before)] + ([("all_gather", s.before)] if grad else [])
            else:  # local_shard: the gradient is all-gathered backward
                parts = [("all_gather", s.before)] if grad else []
            for kind, p in parts:
                v, a, b = self._collective_terms(kind, s.axis)
                share = 1 / self._shards(p)  # local bytes per global byte
                vol, per_byte, latency = vol + v * share, per_byte + a * share, latency + b
        return vol, per_byte, latency

    def _collective_terms(self, kind: str, axis: int, hierarchical: bool = False) -> tuple[float, float, float]:
        """A collective of a non-empty tensor of N bytes on one axis as linear terms: (volume per byte,
        seconds per byte, latency seconds); ``hierarchical``: ZeRO-3's unit collectives across nodes."""
        key = ("c", kind, axis, hierarchical)
        if key not in self._memo:
            n = self.mesh.sizes[axis]
            factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}[kind] * (n - 1) / n
            if n == 1:
                self._memo[key] = 0.0, 0.0, 0.0
            else:
                # a group spanning nodes as NCCL runs it: one ring per rail, per_node ranks of it in each node
                terms = self.cluster.collective_terms(kind, n, self._intra[axis], self._per_node[axis], hierarchical)
                self._memo[key] = (factor, *terms)
        return self._memo[key]

    @property
    def dtype(self) -> str:
        """The dtype ops compute in: the training precision's."""
        return self.setup.precision

    def _ways(self, split: list[bool]) -> int:
        return math.prod(n for n, s in zip(self.mesh.sizes, split) if s)

    def work_seconds(self, work: compute.Work, split: list[bool]) -> float:
        """Forward plus backward (3x forward) seconds of ``work`` (a global op's) divided over the axes where
        ``split`` is true, priced by ``solver.cluster.compute.seconds`` on the piece one rank computes."""
        return compute.train_seconds(work.split(self._ways(split)), self.device)

    def op_seconds(self, op, types: dict[str, TensorType], split: list[bool], in_placements=None) -> float:
        """Forward plus backward seconds of the IR op ``op`` (its shape, class and the training dtype,
        ``solver.cluster.compute.op_work``) divided over the axes where ``split`` is true; read at
        ``in_placements`` an expert-parallel op's busiest rank's share (``experts.expert_load``)."""
        ins = [types[r.name] for r in op.input_refs()]
        # memoized by what the price reads (the op, its inputs' types, the axes splitting it): the ILP prices each
        # op once per candidate of its group, most of them splitting it alike
        key = ("op", id(op), tuple(ins), tuple(split))
        found = self._memo.get(key)
        if found is None or found[0] is not op:
            work = self.compiled_share(op) or compute.op_work(op, types, self.dtype)
            found = self._memo[key] = (op, self.work_seconds(work, split))
        seconds = found[1]
        if in_placements is None or op.target not in experts.EXPERT_GROUPED_MM:
            return seconds
        return seconds * experts.expert_load(
            op.target, ins, in_placements, self.mesh.sizes, self.setup.router_imbalance, self.setup.capacity_factor
        )

    def flop_seconds(
        self, flops: float, split: list[bool] | None = None, m: int = 0, n: int = 0, k: int = 0, nbytes: float = 0.0
    ) -> float:
        """Forward plus backward seconds of ``flops`` forward FLOPs of matmul work of shape [m, k] x [k, n] (0:
        unknown, priced at the saturated efficiency) moving ``nbytes``, divided over the axes where ``split``
        is true: what a cost term that counts FLOPs (ring attention's blocks, an expert's GEMMs) calls."""
        work = compute.Work("matmul", flops, nbytes, m, n, k, self.dtype, ops=0)
        return self.work_seconds(work, split or [False] * len(self.mesh.sizes))

    def compute_seconds(self, flops: float, split: list[bool], nbytes: float = 0.0) -> float:
        """``flop_seconds`` of FLOPs of unknown shape (the name callers of autopar before the compute model use)."""
        return self.flop_seconds(flops, split, nbytes=nbytes)

    def f_hidden(self, f_seconds: float, wgrad_seconds: float) -> float:
        """Seconds of an f's all-reduce that run while the weight gradients of the matmuls reading it are
        computed (``runtime/comm/column_linear.py``: the all-reduce starts after their input gradient, is waited
        after their weight gradients): the smaller of the two, where collectives run beside compute (NCCL's
        stream); none on gloo (``ClusterSpec.overlaps_compute``) or where the runtime does not fuse f
        (``TrainingSetup.overlap_tp``). The search prices the same overlap."""
        return min(f_seconds, wgrad_seconds) if self.cluster.overlaps_compute and self.setup.overlap_tp else 0.0

    def inherent(self, target: str, in_types: list[TensorType], in_placements, op=None) -> tuple[float, float]:
        """(bytes, seconds) of collectives an op runs inside itself (C_v of the paper): a
        vocab-parallel cross-entropy all-reduces a max, a sum and a target logit per row; an expert-parallel
        gather sends its rows to their experts' ranks and back, an expert block's grouped matmuls and its
        dispatch and combine ops their share of its exchanges (``solver/sharding/experts.py``); ring attention
        passes its key/value blocks around the ring (``ring_price``). ``op``: the IR op (ring attention's causal
        flag and its blocks' compute; a grouped matmul's place in its expert block, an exchange's axis)."""
        if target == ATTENTION and op is not None and len(in_placements) >= 3 and None not in in_placements[:2]:
            return self.ring_price(op, in_types, in_placements)
        imbalance, capacity = self.setup.router_imbalance, self.setup.capacity_factor
        if target == experts.EXPERT_GATHER:  # the batched_mm kernel's gather: dropless, no capacity
            return experts.gather_price(in_types, in_placements, self.mesh, self._all_to_all_terms, imbalance)
        if target in experts.EXPERT_GROUPED_MM:
            attrs = op.attrs if op is not None else None
            terms = self._all_to_all_terms
            return experts.grouped_price(in_types, in_placements, self.mesh, terms, imbalance, attrs, capacity)
        if target in (experts.GROUPED_DISPATCH, experts.GROUPED_COMBINE):
            terms = self._all_to_all_terms
            return experts.grouped_exchange_price(in_types, self.mesh, op.kwargs["axis"], terms, imbalance, capacity)
        if target != "aten.cross_entropy_loss" or not in_placements or in_placements[0] is None:
            return 0.0, 0.0
        vol = sec = 0.0
        rows = in_types[0].shape[0] * 4
        for a, p in enumerate(in_placements[0]):
            if isinstance(p, Shard) and p.dim == 1:
                b, x = self._collective("all_reduce", rows, a)
                vol, sec = vol + 3 * b, sec + 3 * x
        return vol, sec

    def ring_price(self, op, in_types: list[TensorType], in_placements) -> tuple[float, float]:
        """(bytes, seconds) per rank of ring attention's point-to-point traffic (``runtime/comm/context_attention.py``)
        on the axis where it runs, nothing where it does not. Forward: ``n - 1`` steps, each sending the rank's key and
        value blocks (K + V local bytes) to the next rank. Backward: ``n - 1`` such steps again, and ``n - 1`` hops of
        the blocks' gradient accumulators (in at least fp32; each starts at its block's first visitor). Load-balanced (a
        causal call or one with a mask): half the rank's queries (and mask rows) and half its output are exchanged
        forward, the output's and the queries' gradients backward (for ``n > 2`` some rank sends both its pieces). Each
        send is priced by the cluster's point-to-point alpha-beta on the axis's link. Where collectives run beside
        compute (NCCL), a step's key/value transfer runs beside that step's block of attention (the op's work on the
        rank over ``n``, twice that backward): only what exceeds it is exposed; so is an accumulator hop, beside the
        next step's backward block, but the last, and the exchange, which are waited at once. On gloo nothing
        overlaps."""
        q, k, v = in_types[:3]
        pq, pk, pv = in_placements[:3]
        axis = next((a for a in range(len(self.mesh.sizes)) if is_ring(q, k, pq[a], pk[a])), None)
        if axis is None or self.mesh.sizes[axis] == 1:
            return 0.0, 0.0
        n, intra = self.mesh.sizes[axis], self._intra[axis]
        per_byte, latency = self.cluster.collective_terms("send", n, intra)

        def send(nbytes: float, messages: int = 1) -> float:
            return nbytes * per_byte + messages * latency

        kv = self.local_bytes(k, pk) + self.local_bytes(v, pv)
        acc = kv * max(k.itemsize, 4) / k.itemsize
        types = {r.name: t for r, t in zip(op.input_refs(), in_types)}
        axes = range(len(self.mesh.sizes))
        split = [any(p is not None and not isinstance(p[a], Replicate) for p in in_placements) for a in axes]
        block = self.op_seconds(op, types, split) / 3.0 / n  # one step's forward block of attention
        exposed = (lambda t, c: max(0.0, t - c)) if self.cluster.overlaps_compute else (lambda t, c: t)
        step = send(kv, 2)
        hop = send(acc, 2)
        vol = (2 * (n - 1)) * kv + (n - 1) * acc
        sec = (n - 1) * (exposed(step, block) + exposed(step, 2 * block)) + (n - 2) * exposed(hop, 2 * block) + hop
        kwargs = dict(zip(("attn_mask", "dropout_p", "is_causal"), op.args[3:]), **op.kwargs)
        mask = in_types[3] if len(in_types) > 3 else None
        if kwargs.get("is_causal") or mask is not None:
            leaving = max(sum(1 for p in (2 * r, 2 * r + 1) if _balanced_member(p, n) != r) for r in range(n)) / 2
            ql = self.local_bytes(q, pq) * leaving
            out = ql * v.shape[-1] / q.shape[-1]
            ml = self.local_bytes(mask, in_placements[3]) * leaving if mask is not None and mask.shape[-2] != 1 else 0.0
            vol += 2 * (ql + out) + ml
            sec += 2 * (send(ql) + send(out)) + (send(ml) if ml else 0.0)
        return vol, sec

    def _all_to_all_terms(self, axis: int) -> tuple[float, float]:
        """(seconds per byte, latency) of an all-to-all on ``axis``."""
        return self.cluster.collective_terms("all_to_all", self.mesh.sizes[axis], self._intra[axis])

    def grad_reduce(
        self, t: TensorType, p: tuple[Placement, ...], axis: int, bucketed: bool = False
    ) -> tuple[float, float]:
        """(bytes, seconds) of all-reducing the gradient of a value replicated on ``axis``; a
        ``bucketed`` one (a parameter's, synchronized in flat buckets of ``setup.bucket_bytes``,
        solver/sharding/buckets.py) pays bandwidth only: the step pays one latency per bucket, which a
        parameter changes only where it opens a bucket (``bucket_latency`` prices them for a plan).
        Charging each parameter a share of a latency instead tipped GPT-2's dp=2 plan to a
        vocab-parallel head whose gathers measure slower (docs/runtime.md). Under ZeRO-3 on a ZeRO axis a
        parameter's sync is its reduce-scatter plus its all-gathers for the forward and again for the
        backward (``runtime/grads/zero3.py``): an all-reduce's bytes and one all-gather more; across nodes each of
        the three hierarchical where the plan runs them so (``setup.hierarchical_gather``,
        ``ClusterSpec.collective_terms(hierarchical=True)``)."""
        nbytes = self.local_bytes(t, p) * self.setup.grad_itemsize(t.itemsize) / t.itemsize  # in reduce_dtype
        if not bucketed:
            return self._collective("all_reduce", nbytes, axis)
        v, per_byte, _ = self._collective_terms("all_reduce", axis)
        if self.setup.zero >= 3 and axis in self._zero_axes:
            hier = self.setup.hierarchical_gather  # as the plan runs them
            gv, gs, _ = self._collective_terms("all_gather", axis, hierarchical=hier)
            n, k = self.mesh.sizes[axis], self._per_node[axis]
            if hier and self.cluster.gathers_hierarchically("all_gather", n, self._intra[axis], k):
                # the reduce-scatter and the forward's gather (the all-reduce's halves), hierarchical too
                per_byte = self._collective_terms("reduce_scatter", axis, hierarchical=True)[1] + gs
            v, per_byte = v + gv, per_byte + gs
        return nbytes * v, nbytes * per_byte

    def gathered_grad(self, t: TensorType, p: tuple[Placement, ...], axis: int) -> tuple[float, float]:
        """(bytes, seconds) of reduce-scattering over ``axis`` the ranks' partial gradients of a value gathered to
        placements ``p`` (an all_gather with ``reduce_grad``, ``passes/collectives.py``), in the reduce dtype as f's."""
        nbytes = self.local_bytes(t, p) * self.setup.grad_itemsize(t.itemsize) / t.itemsize
        return self._collective("reduce_scatter", nbytes, axis)

    def folded_f_saving(
        self, t: TensorType, src: tuple[Placement, ...] | None, dst: tuple[Placement, ...] | None, axes: tuple
    ) -> tuple[float, float]:
        """(bytes, seconds) a read of ``t`` resharded ``src`` -> ``dst`` with f's on ``axes`` saves when
        ``insert-collectives`` folds its first f into the resharding's last step, an all_gather over the same axis,
        a ``cp`` one (``reduce_scatter_gathered_grads``): the f's all-reduce less the gather's reduce-scatter; else
        nothing. (A gather before the group computing the read's value from it alike on every rank, the
        all-gather form's before the grouped-query repeat, is folded too: ``solve.FoldThrough`` prices it.)
        The caller knows the read is no matmul's (whose f the runtime fuses with its weight gradient instead)."""
        if not axes or src is None or dst is None or src == dst or self.mesh.names[axes[0]] != CONTEXT_AXIS:
            return 0.0, 0.0
        try:
            steps = redistribute_steps(src, dst)
        except Unreachable:
            return 0.0, 0.0
        if not steps or steps[-1].kind != "all_gather" or steps[-1].axis != axes[0]:
            return 0.0, 0.0
        f, rs = self.grad_reduce(t, dst, axes[0]), self.gathered_grad(t, dst, axes[0])
        return f[0] - rs[0], f[1] - rs[1]

    def program_comm(self, program: Program) -> tuple[float, float]:
        """(bytes, seconds) of every collective a step of ``program`` (after ``insert-collectives``) runs,
        each priced on its own: the redistributions with their backward, each f's all-reduce, the collectives
        inside ops (``inherent``), each synchronized gradient (without bucket latencies), each f less what its
        fused readers' weight gradients hide (``f_hidden``; none on gloo). The sharding ILP's
        prediction for the plan must equal it (tests/test_solver.py): what the ILP prices per decision, this
        prices per emitted collective. (``insert-collectives`` moving an f to a parameter's synchronized
        gradient, GPT-2's position table, is priced here as run and in the ILP as the f it replaces.)"""
        types, grad, vol, sec = program.types(), program.requires_grad(), 0.0, 0.0
        users, returned = program.users(), {r.name for r in program.outputs if isinstance(r, Ref)}
        for op in program.ops:
            if op.target == "grad_all_reduce":
                v, x = self.grad_reduce(op.types[0], op.types[0].placements, program.mesh.index(op.kwargs["axis"]))
                if op.result not in returned:
                    x -= self.f_hidden(x, self._fused_wgrad(users[op.result], op.result, types, grad))
            elif op.target in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_shard"):
                src = types[op.input_refs()[0].name]
                v, x = self.redistribute(src, src.placements, op.types[0].placements, op.result in grad)
                if op.kwargs.get("reduce_grad") and op.result in grad:
                    rv, rx = self.gathered_grad(
                        op.types[0], op.types[0].placements, program.mesh.index(op.kwargs["axis"])
                    )
                    v, x = v + rv, x + rx
            else:  # the collectives an op runs inside itself (a vocab-parallel cross-entropy's)
                ins = [types[r.name] for r in op.input_refs()]
                v, x = self.inherent(op.target, ins, [t.placements for t in ins], op)
            vol, sec = vol + v, sec + x
        for value in program.params:
            for axis in value.attrs.get("grad_sync", ()):
                v, x = self.grad_reduce(value.type, value.type.placements, program.mesh.index(axis), True)
                vol, sec = vol + v, sec + x
        return vol, sec

    def column_wgrad(self, op, pos: int, types: dict[str, TensorType], grad: set[str], split: list[bool]) -> float:
        """Seconds of the weight gradient of ``op``, a matmul whose f on input ``pos`` the runtime fuses with it
        (``solver.sharding.strategies.column_weight``), with its work divided over the axes where ``split`` is true;
        0 for any other read or a weight without a gradient."""
        w = column_weight(op, pos, types)
        if w is None or w not in grad:
            return 0.0
        work = self.compiled_share(op) or compute.op_work(op, types, self.dtype)
        return compute.weight_grad_seconds(work.split(self._ways(split)), self.device)

    def _fused_wgrad(self, readers: list, f: str, types: dict[str, TensorType], grad: set[str]) -> float:
        """Seconds of the weight gradients computed while f's all-reduce is in flight: those of its readers when
        every one is a matmul the runtime fuses with it (``solver.sharding.strategies.column_weight``), else none."""
        if any(column_weight(u, 0, types) is None or u.args[0].name != f for u in readers):
            return 0.0
        total = 0.0
        for u in readers:
            ins = [types[r.name].placements for r in u.input_refs()]
            split = [any(not isinstance(p[a], Replicate) for p in ins) for a in range(len(self.mesh.axes))]
            total += self.column_wgrad(u, 0, types, grad, split)
        return total

    def bucket_latency(self, axis: int, buckets: int) -> float:
        """Seconds of the latencies of ``buckets`` gradient all-reduces over ``axis``."""
        return buckets * self._collective_terms("all_reduce", axis)[2]


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
    key = (mesh.sizes, tuple(intra), cluster.devices_per_node, links)
    if key not in _SHARED_TERMS and len(_SHARED_TERMS) >= 16:
        _SHARED_TERMS.clear()
    return _SHARED_TERMS.setdefault(key, _Terms())


def _axes_per_node(mesh: MeshSpec, cluster: ClusterSpec) -> list[int]:
    """Per axis, how many ranks of one of its groups share a node (ranks row-major, last axis fastest: an axis of
    stride d holds min(n, devices per node / d) ranks per node, 1 once d fills a node): the rails a group spanning
    nodes rings over (``ClusterSpec.alpha_beta``), as the search's ``CommTime.per_node`` counts them."""
    out, stride, dpn = [], 1, cluster.devices_per_node
    for n in reversed(mesh.sizes):
        out.append(1 if stride >= dpn else max(1, min(n, dpn // stride)))
        stride *= n
    return list(reversed(out))


def zero_group_shape(setup: TrainingSetup, mesh: MeshSpec, devices_per_node: int) -> tuple[int, int]:
    """(ranks, ranks per node) of the ZeRO group over ``setup``'s shard axes on ``mesh`` (ranks row-major, last axis
    fastest, ``devices_per_node`` to a node): the group through rank 0, as ``runtime/grads/node_gather.py`` finds it."""
    strides, stride = [], 1
    for n in reversed(mesh.sizes):
        strides.append(stride)
        stride *= n
    strides.reverse()
    members = [0]
    for i in setup.shard_axes(mesh):
        members = [r + j * strides[i] for r in members for j in range(mesh.sizes[i])]
    return len(members), sum(r < devices_per_node for r in members)


def zero_gathers_pay(setup: TrainingSetup, mesh: MeshSpec, cluster: ClusterSpec | None) -> bool:
    """Whether ZeRO-3's unit gathers on ``mesh`` pay run hierarchically on ``cluster``
    (``ClusterSpec.hierarchical_pays`` for the ZeRO group's shape); no ZeRO-3, or no cluster: no."""
    if setup.zero < 3 or cluster is None:
        return False
    return cluster.hierarchical_pays(*zero_group_shape(setup, mesh, cluster.devices_per_node))


def _axes_intra_node(mesh: MeshSpec, cluster: ClusterSpec) -> list[bool]:
    """Ranks are laid out row-major over the mesh (last axis fastest): an axis stays inside a node
    when its stride times its size fits in one node's devices."""
    out = []
    stride = 1
    for n in reversed(mesh.sizes):
        out.append(stride * n <= cluster.devices_per_node)
        stride *= n
    return list(reversed(out))
