"""The stage balance's cost model: per-microbatch time and per-device memory of each subgraph of a pipeline split.

Per microbatch (the program's example batch is one microbatch of the global batch):

- compute seconds of a subgraph = 3 x (forward + backward = 2x forward) the forward seconds of each of its
  ops divided over dp * tp, priced by the one compute model (``solver/cluster/compute.py``: each op's class,
  shape and ``precision`` on the cluster's device table; a constant ``efficiency``, where given, replaces
  the matmul curves) as the sharding ILP prices them.
- plus tensor-parallel communication, ``megatron_tp_comm_seconds``: Megatron's 2 all-reduces
  (forward + backward) of the activation per row-parallel matmul, i.e. 4 per transformer layer;
  pass another ``comm_fn`` to replace it (e.g. by the ILP's cost).
- memory = model states + activations. Model states: ``TrainingSetup.bytes_per_param`` with Adam,
  16 bytes per parameter in fp32 (weight 4 + grad 4 + Adam moments 8), 18 in mixed precision (the
  same fp32 master weights and gradients, plus the per-use bf16 compute copy, 2); a parameter read
  by several subgraphs (a tied embedding) is held by every stage reading it, as Megatron does.
  Activations: what autograd saves for backward (``solver/sharding/saved.py``: the storage roots some op's
  derivative keeps, plus intermediates such as a loss's log-softmax), common nodes excepted, at 2 bytes
  per element under ``precision="bf16"`` when the program was captured in fp32 (a program captured in
  its compute dtype carries its own types). An unsharded program with tp > 1 is assumed to follow Megatron with sequence
  parallelism: weights / tp, activations and FLOPs / (dp tp). A sharded program's local sizes come
  from its placements.
- W-kept bytes (zero-bubble schedules, whose B leaves the weight gradients to a later W): the output
  gradient of every op that reads a weight and keeps something for its backward (a matmul, a norm, an
  embedding), the gradient ``runtime/execute/split_backward.py`` captures at B for W; an op that keeps nothing
  (a bias add) hands its gradient on unchanged, the same tensor as its producer's, counted there.

A subgraph here is anything with ``index``, ``start``, ``stop`` (an op range), ``graph_inputs`` and
``flops``: ``autopar.passes.pipeline_split.Subgraph`` is one (the solver does not import the pass).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from autopar.ir.axes import is_pipeline_axis, is_tensor_axis
from autopar.ir.core import Placement, Program, Replicate, TensorType
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.megatron_roles import ROW, megatron_roles, weight_values
from autopar.solver.sharding.saved import NOTHING, SavedValues, extra_bytes, op_saved, saved_values


class OpRun(Protocol):
    """One subgraph of a pipeline split, as the cost model reads it."""

    @property
    def index(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def graph_inputs(self) -> tuple[str, ...]: ...
    @property
    def flops(self) -> int: ...
    @property
    def label(self) -> str: ...


CommFn = Callable[["StageContext", OpRun], float]


@dataclass(frozen=True)
class StageContext:
    """What the per-subgraph cost functions need: the program, cluster and parallel degrees."""

    prog: Program
    cluster: ClusterSpec
    dp: int
    tp: int
    sharded: bool  # the program carries placements (local sizes come from them)
    precision: str  # "bf16" (mixed precision) or "fp32"
    efficiency: float | None  # a constant fraction of peak replacing the device table's curves (None: the curves)
    commons: frozenset[str] = field(default_factory=frozenset)  # common nodes: never stashed
    compiled: bool = False  # priced as torch.compile runs it (compute.compiled_works: elementwise chains fused)

    def act_bytes(self, t: TensorType) -> float:
        """Bytes per device of an activation of type ``t`` at the training precision."""
        scale = 2 / t.itemsize if self.precision == "bf16" and t.is_float and not self.captured_half else 1.0
        if self.sharded:
            return t.local_nbytes(self.prog.mesh) * scale
        return t.nbytes * scale / (self.dp * self.tp)

    @functools.cached_property
    def captured_half(self) -> bool:
        """Whether the program was captured in a 16-bit compute dtype (its float parameters typed so)."""
        return any(v.type.is_float and v.type.itemsize == 2 for v in self.prog.params)

    @functools.cached_property
    def saved(self) -> SavedValues:
        """What the program's step keeps for backward (``solver/sharding/saved.py``)."""
        return saved_values(self.prog)

    def extra_bytes(self, op) -> float:
        """Bytes per device of the intermediates ``op`` keeps for backward (a loss's log-softmax)."""
        extra = self.saved.extra.get(op.result)
        if not extra:
            return 0.0
        half = self.precision == "bf16" and op.types[0].is_float and not self.captured_half
        scale = 2 / op.types[0].itemsize if half else 1.0
        if self.sharded:
            return scale * extra_bytes(op, extra, self.types, self.prog.mesh.sizes)
        return scale * extra_bytes(op, extra, self.types, None) / (self.dp * self.tp)

    @functools.cached_property
    def types(self) -> dict[str, TensorType]:
        return self.prog.types()

    @functools.cached_property
    def grad(self) -> set[str]:
        return self.prog.requires_grad()

    def wkept_bytes(self, op) -> float:
        """Bytes per device of the output gradient a split B keeps for ``op``'s weight gradient until W (see
        the module docstring): 0 unless ``op`` reads a weight and keeps something for its backward."""
        refs = [r.name for r in op.input_refs()]
        if not any(n in self.weights for n in refs) or op_saved(op, self.types, self.grad) == NOTHING:
            return 0.0
        return sum(self.act_bytes(t) for r, t in zip(op.results, op.types) if r not in self.weights and t.is_float)

    @functools.cached_property
    def weights(self) -> frozenset[str]:
        return weight_values(self.prog)

    @functools.cached_property
    def roles(self) -> list[str]:
        """Megatron's role of every op of the program (``solver/sharding/megatron_roles.py``)."""
        return megatron_roles(self.prog.ops, self.weights)

    def param_elems(self, t: TensorType) -> float:
        """Elements per device of a parameter of type ``t``."""
        if self.sharded:
            return math.prod(t.local_shape(self.prog.mesh))
        return t.numel / self.tp

    @property
    def bytes_per_param(self) -> float:
        """Model-state bytes per parameter element (Adam)."""
        setup = TrainingSetup(precision=self.precision)
        return sum(setup.bytes_per_param) + setup.copy_bytes


def parallel_degrees(prog: Program) -> tuple[int, int, bool]:
    """(dp, tp, sharded) of a program's mesh: tp the tensor-parallel (``tp*``) axes, dp every other axis but
    the pipeline's (``ir/axes.py``)."""
    axes = prog.mesh.axes
    tp = math.prod(s for a, s in axes if is_tensor_axis(a))
    dp = math.prod(s for a, s in axes if not is_tensor_axis(a) and not is_pipeline_axis(a))

    def placed(ps: tuple[Placement, ...]) -> bool:
        return any(not isinstance(p, Replicate) for p in ps)

    sharded = any(placed(v.type.placements) for v in prog.inputs) or any(
        placed(t.placements) for op in prog.ops for t in op.types
    )
    return dp, tp, sharded


def megatron_tp_comm_seconds(ctx: StageContext, sub: OpRun) -> float:
    """Tensor-parallel communication of a subgraph per microbatch (forward + backward), Megatron's way:
    each row-parallel matmul's output is all-reduced over tp in the forward pass (g) and its column
    partner's input gradient in the backward pass (f), two all-reduces of the output's size per
    row-parallel matmul, four per transformer layer. Embedding and vocabulary-parallel loss
    collectives are not counted. Replace this function (``comm_fn=``) with the ILP's cost."""
    if ctx.tp <= 1:
        return 0.0
    intra = ctx.tp <= ctx.cluster.devices_per_node
    per_node = min(ctx.tp, ctx.cluster.devices_per_node)  # a tp group leaving a node: one rail per rank in it
    seconds = 0.0
    for i in range(sub.start, sub.stop):
        if ctx.roles[i] == ROW:
            nbytes = ctx.act_bytes(ctx.prog.ops[i].types[0]) * ctx.tp  # the full (unsharded) activation
            seconds += 2 * ctx.cluster.collective_seconds("all_reduce", nbytes, ctx.tp, intra, per_node)
    return seconds


@dataclass(frozen=True)
class SubgraphCost:
    """One subgraph's per-microbatch time and per-device memory."""

    compute_seconds: float
    comm_seconds: float
    weight_bytes: float  # model states of the parameters (and buffers) first read here, tied ones apart
    act_bytes: float  # activations stashed per microbatch
    wkept_bytes: float = 0.0  # output gradients a split B keeps until its W, per microbatch

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


@dataclass(frozen=True)
class SplitCosts:
    """Every subgraph's cost, and the parameters some subgraphs share."""

    subgraphs: list[SubgraphCost]
    tied: list[tuple[float, frozenset[int]]]  # model-state bytes of a shared parameter, its subgraphs
    params: dict[str, tuple[float, list[int]]]  # parameter -> (elements per device, subgraphs reading it)

    def run_costs(self) -> tuple[Callable[[int, int], float], Callable[[int, int, float], float]]:
        """(time of the run of subgraphs [j, i), its memory with k microbatches stashed): O(1) time and
        O(#tied parameters) memory, from prefix sums."""
        tpre, wpre, apre = [0.0], [0.0], [0.0]
        for c in self.subgraphs:
            tpre.append(tpre[-1] + c.seconds)
            wpre.append(wpre[-1] + c.weight_bytes)
            apre.append(apre[-1] + c.act_bytes)
        tied = [(b, sorted(where)) for b, where in self.tied]

        def time_of(j: int, i: int) -> float:
            return tpre[i] - tpre[j]

        def memory_of(j: int, i: int, k: float) -> float:
            shared = sum(b for b, where in tied if any(j <= x < i for x in where))
            return wpre[i] - wpre[j] + shared + k * (apre[i] - apre[j])

        return time_of, memory_of

    def kept_costs(self) -> Callable[[int, int], tuple[float, float]]:
        """(activation bytes, W-kept bytes) per microbatch of the run of subgraphs [j, i), in O(1)."""
        apre, kpre = [0.0], [0.0]
        for c in self.subgraphs:
            apre.append(apre[-1] + c.act_bytes)
            kpre.append(kpre[-1] + c.wkept_bytes)
        return lambda j, i: (apre[i] - apre[j], kpre[i] - kpre[j])


def subgraph_costs(ctx: StageContext, subgraphs: Sequence[OpRun], comm_fn: CommFn) -> SplitCosts:
    """The cost of every subgraph (see the module docstring)."""
    prog = ctx.prog
    values = {v.name: v for v in prog.inputs}
    readers: dict[str, list[int]] = {}
    for s in subgraphs:
        for name in s.graph_inputs:
            readers.setdefault(name, []).append(s.index)
    device = compute.device_of(ctx.cluster, ctx.efficiency)
    ways = ctx.dp * ctx.tp
    per_param = ctx.bytes_per_param
    # compiled: each op its share of its fused kernel over the whole program (compute.compiled_shares), as the
    # sharding ILP and the search price it
    shares = compute.compiled_shares(prog.ops, ctx.types, ctx.precision) if ctx.compiled else None
    out = []
    params: dict[str, tuple[float, list[int]]] = {}
    tied = []
    for s in subgraphs:
        weight = 0.0
        for name in s.graph_inputs:
            v = values[name]
            if v.kind == "param":
                elems = ctx.param_elems(v.type)
                params[name] = (elems, readers[name])
                if len(readers[name]) == 1:
                    weight += per_param * elems
                elif readers[name][0] == s.index:
                    tied.append((per_param * elems, frozenset(readers[name])))
            elif v.kind == "buffer" and readers[name][0] == s.index:
                weight += v.type.nbytes  # no gradient, no optimizer state
        act = wkept = 0.0
        for op in prog.ops[s.start : s.stop]:
            for r, t in zip(op.results, op.types):
                if ctx.saved.activation(r) and r not in ctx.commons:
                    act += ctx.act_bytes(t)
            act += ctx.extra_bytes(op)
            wkept += ctx.wkept_bytes(op)
        if shares is not None:
            works = shares[s.start : s.stop]
        else:
            works = [compute.op_work(op, ctx.types, ctx.precision) for op in prog.ops[s.start : s.stop]]
        seconds = sum(compute.train_seconds(w.split(ways), device) for w in works)
        out.append(SubgraphCost(seconds, comm_fn(ctx, s), weight, act, wkept))
    return SplitCosts(out, tied, params)


__all__ = [
    "CommFn",
    "OpRun",
    "SplitCosts",
    "StageContext",
    "SubgraphCost",
    "megatron_tp_comm_seconds",
    "parallel_degrees",
    "subgraph_costs",
]
