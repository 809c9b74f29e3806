"""Stage assignment: contiguous runs of subgraphs onto pipeline stages, min-max stage time in a budget.

Input: the subgraph sequence of ``autopar.passes.pipeline_split`` and a pipeline shape. ``pp`` ranks
hold ``pp * chunks`` stages (Megatron's interleaving, PTD-P section 2.2.2: rank r holds chunks r,
r+pp, r+2pp, ...) or ``2 * pp * waves`` stages (Hanayo's waves: a V down ranks 0..pp-1 and back up
pp-1..0, repeated ``waves`` times; ``autopar.runtime.schedules.wave_placement``).

Cost model, per microbatch (the program's example batch is one microbatch of the global batch):

- compute seconds of a stage = 3 x forward FLOPs (forward + backward = 2x forward) / (dp * tp)
  / (cluster peak FLOP/s for ``precision`` x ``efficiency``). ``EFFICIENCY = 0.5``: Megatron
  reports 44-52% of A100 peak for GPT models of 1B-1T parameters (PTD-P Table 1).
- plus tensor-parallel communication, ``megatron_tp_comm_seconds``: Megatron's 2 all-reduces
  (forward + backward) of the activation per row-parallel matmul, i.e. 4 per transformer layer;
  pass another ``comm_fn`` to replace it (e.g. by the ILP's cost).
- memory of a stage = model states + activations. Model states: 16 bytes per parameter, both in
  mixed precision (bf16 weight 2 + bf16 grad 2 + fp32 master 4 + Adam moments 8) and in fp32
  (weight 4 + grad 4 + Adam moments 8); a parameter read by several stages (a tied embedding) is
  held by each of them, as Megatron does. Activations: every non-view, gradient-carrying op result
  is assumed stashed for backward (an upper bound: Megatron's 34 s b h bytes per GPT layer is about
  60% of it), at 2 bytes per element under ``precision="bf16"``, times the microbatches in flight.
  An unsharded program with tp > 1 is assumed to follow Megatron with sequence parallelism: weights
  / tp, activations and FLOPs / (dp tp). A sharded program's local sizes come from its placements.
- in-flight microbatches (stashed activations) of a stage on rank r: 1F1B ``min(pp - r, m)``;
  interleaved: the rank's warm-up ``2(pp - r - 1) + (v - 1) pp`` plus one, capped at ``m v``, shared
  evenly by its v chunks; waves: ``min(m, 2 pp)`` per stage (the runtime's default in-flight cap).
  ``microbatches=None`` means m is large enough not to cap anything.

The partition minimizes the slowest stage (the pipeline's steady-state period) subject to each
stage fitting ``budget / (stages per rank)``; among the partitions that reach that minimum it takes
the one with the smallest sum of squared stage times (the most even). Both are dynamic programs
over (stages placed, subgraphs covered), the classic linear-partition recurrence

    best[s][i] = min over j < i of max(best[s-1][j], time(j, i))   if stage s-1 fits [j, i)

It is exact (no rounding of costs, unlike a binary search on a time grid), handles stage-dependent
memory limits (the in-flight count depends on the rank), and n <= a few hundred subgraphs by S <= a
few hundred stages is small: O(S n^2) with pruning runs in milliseconds to a second.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.errors import NoLegalCutError, PipelineError, StageMemoryError, TooFewSubgraphsError
from autopar.ir.core import VIEW_OPS, Placement, Program, Replicate, TensorType
from autopar.passes.pipeline_split import (
    Split,
    SplitOptions,
    Subgraph,
    annotate,
    blockers,
    common_nodes,
    split_program,
)
from autopar.solver.cluster import ClusterSpec

BYTES_PER_PARAM = 16  # weight + grad + Adam moments (+ fp32 master weight in mixed precision)
EFFICIENCY = 0.5  # achieved fraction of peak FLOP/s (Megatron PTD-P: 44-52% on A100)
DEFAULT_CLUSTER = "dgx-a100"

_VIEWS = VIEW_OPS
_MATMULS = frozenset(
    {"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm", "aten.convolution", "aten.conv2d"}
)

CommFn = Callable[["StageContext", Subgraph], float]


# ---------------------------------------------------------------------------------------------
# Per-subgraph costs


@dataclass(frozen=True)
class StageContext:
    """What the per-subgraph cost functions need: the program, cluster and parallel degrees."""

    prog: Program
    cluster: ClusterSpec
    dp: int
    tp: int
    sharded: bool  # the program carries placements (local sizes come from them)
    precision: str  # "bf16" (mixed precision) or "fp32"
    efficiency: float
    commons: frozenset[str] = field(default_factory=frozenset)

    def act_bytes(self, t: TensorType) -> float:
        """Bytes per device of an activation of type ``t`` at the training precision."""
        scale = 2 / t.itemsize if self.precision == "bf16" and t.is_float else 1.0
        if self.sharded:
            return t.local_nbytes(self.prog.mesh) * scale
        return t.nbytes * scale / (self.dp * self.tp)

    @functools.cached_property
    def weights(self) -> frozenset[str]:
        """Parameters and views or casts of them (a transposed weight is still a weight)."""
        out = {v.name for v in self.prog.inputs if v.kind == "param"}
        for op in self.prog.ops:
            refs = op.input_refs()
            if refs and op.target in _VIEWS | {"aten.to.dtype", "aten._to_copy"} and refs[0].name in out:
                out.update(op.results)
        return frozenset(out)

    def param_elems(self, t: TensorType) -> float:
        """Elements per device of a parameter of type ``t``."""
        if self.sharded:
            return math.prod(t.local_shape(self.prog.mesh))
        return t.numel / self.tp


def _degrees(prog: Program) -> tuple[int, int, bool]:
    axes = dict(prog.mesh.axes)
    tp = axes.get("tp", 1)
    dp = math.prod(s for a, s in axes.items() if a not in ("tp", "pp"))

    def placed(ps: tuple[Placement, ...]) -> bool:
        return any(not isinstance(p, Replicate) for p in ps)

    sharded = any(placed(v.type.placements) for v in prog.inputs) or any(
        placed(t.placements) for op in prog.ops for t in op.types
    )
    return dp, tp, sharded


def megatron_tp_comm_seconds(ctx: StageContext, sub: Subgraph) -> float:
    """Tensor-parallel communication of a subgraph per microbatch (forward + backward), Megatron's way.

    A matmul with a parameter operand is column-parallel unless its activation operand comes from
    a column-parallel matmul's output inside the subgraph, in which case it is row-parallel and
    its output is all-reduced over tp in the forward pass (g) while its column partner's input
    gradient is all-reduced in the backward pass (f): two all-reduces of the output's size per
    row-parallel matmul, four per transformer layer. Embedding and vocabulary-parallel loss
    collectives are not counted. Replace this function (``comm_fn=``) with the ILP's cost.
    """
    if ctx.tp <= 1:
        return 0.0
    prog = ctx.prog
    weights = ctx.weights
    column_out: set[str] = set()  # values downstream of a column-parallel matmul, not yet reduced
    seconds = 0.0
    intra = ctx.tp <= ctx.cluster.devices_per_node
    for op in prog.ops[sub.start : sub.stop]:
        names = [r.name for r in op.input_refs()]
        acts = [n for n in names if n not in weights]
        if op.target in _MATMULS and len(acts) < len(names) and acts:
            if any(n in column_out for n in acts):  # row-parallel: all-reduce its output
                nbytes = ctx.act_bytes(op.types[0]) * ctx.tp  # the full (unsharded) activation
                seconds += 2 * ctx.cluster.collective_seconds("all_reduce", nbytes, ctx.tp, intra)
            else:
                column_out.update(op.results)
        elif any(n in column_out for n in names):
            column_out.update(op.results)
    return seconds


@dataclass(frozen=True)
class SubgraphCost:
    """One subgraph's per-microbatch time and per-device memory."""

    compute_seconds: float
    comm_seconds: float
    weight_bytes: float  # model states of the parameters (and buffers) first read here, tied ones apart
    act_bytes: float  # activations stashed per microbatch

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


@dataclass(frozen=True)
class _Costs:
    subgraphs: list[SubgraphCost]
    tied: list[tuple[float, frozenset[int]]]  # model-state bytes of a shared parameter, its subgraphs
    params: dict[str, tuple[float, list[int]]]  # parameter -> (elements per device, subgraphs reading it)


def subgraph_costs(ctx: StageContext, split: Split, comm_fn: CommFn) -> _Costs:
    prog = ctx.prog
    values = {v.name: v for v in prog.inputs}
    readers: dict[str, list[int]] = {}
    for s in split.subgraphs:
        for name in s.graph_inputs:
            readers.setdefault(name, []).append(s.index)
    peak = ctx.cluster.peak(ctx.precision) * ctx.efficiency
    out = []
    params: dict[str, tuple[float, list[int]]] = {}
    tied = []
    for s in split.subgraphs:
        weight = 0.0
        for name in s.graph_inputs:
            v = values[name]
            if v.kind == "param":
                elems = ctx.param_elems(v.type)
                params[name] = (elems, readers[name])
                if len(readers[name]) == 1:
                    weight += BYTES_PER_PARAM * elems
                elif readers[name][0] == s.index:
                    tied.append((BYTES_PER_PARAM * elems, frozenset(readers[name])))
            elif v.kind == "buffer" and readers[name][0] == s.index:
                weight += v.type.nbytes  # no gradient, no optimizer state
        act = 0.0
        for op in prog.ops[s.start : s.stop]:
            if op.target in _VIEWS:
                continue
            for r, t in zip(op.results, op.types):
                if t.is_float and r not in ctx.commons:
                    act += ctx.act_bytes(t)
        compute = 3 * s.flops / (ctx.dp * ctx.tp) / peak
        out.append(SubgraphCost(compute, comm_fn(ctx, s), weight, act))
    return _Costs(out, tied, params)


# ---------------------------------------------------------------------------------------------
# Chunk-to-rank mappings and in-flight microbatches


def num_stages(pp: int, chunks: int = 1, waves: int | None = None) -> int:
    return 2 * pp * waves if waves else pp * chunks


def stage_ranks(pp: int, chunks: int = 1, waves: int | None = None) -> list[int]:
    """Rank of every stage: interleaved ``s % pp`` (rank r holds r, r+pp, ...); waves the V shape."""
    if waves:
        from autopar.runtime.schedules import wave_placement

        return list(wave_placement(pp, waves))
    return [s % pp for s in range(pp * chunks)]


def inflight(pp: int, chunks: int = 1, waves: int | None = None, microbatches: int | None = None) -> list[float]:
    """Microbatches whose activations a stage holds at its peak (see the module docstring)."""
    m = microbatches if microbatches else math.inf
    ranks = stage_ranks(pp, chunks, waves)
    if waves:
        return [min(m, 2 * pp) for _ in ranks]
    if chunks == 1:
        return [min(pp - r, m) for r in ranks]
    return [min(2 * (pp - r - 1) + (chunks - 1) * pp + 1, m * chunks) / chunks for r in ranks]


# ---------------------------------------------------------------------------------------------
# The dynamic programs


def min_max_partition(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[float, list[int]]:
    """Split items 0..n-1 into ``stages`` non-empty contiguous runs minimizing the largest
    ``cost(stage, j, i)`` of a run [j, i), subject to ``fits(stage, j, i)``. Both must be monotone:
    a run inside a run that fits also fits and costs no more. Returns (optimum, start of each run);
    the optimum is ``math.inf`` (and the starts empty) when nothing fits."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            b, a = inf, -1
            for j in range(i - 1, s - 2, -1):  # widening the run [j, i) leftwards
                if fits is not None and not fits(s - 1, j, i):
                    break
                c = cost(s - 1, j, i)
                if c >= b:
                    break  # wider runs cost at least as much
                v = max(best[s - 1][j], c)
                if v < b:
                    b, a = v, j
            best[s][i], arg[s][i] = b, a
    if best[stages][n] == inf:
        return inf, []
    return best[stages][n], _starts(arg, stages, n)


def _starts(arg: list[list[int]], stages: int, n: int) -> list[int]:
    out, i = [], n
    for s in range(stages, 0, -1):
        i = arg[s][i]
        out.append(i)
    return out[::-1]


def feasible(n: int, stages: int, fits: Callable[[int, int, int], bool]) -> bool:
    """Whether some partition into ``stages`` non-empty runs fits, in O(n + stages) calls.

    Greedy is exact: each stage takes the longest run that fits, leaving one item per stage still
    to come. By induction it ends at least as far right as any feasible partition does after the
    same number of stages, since a run inside a run that fits also fits."""
    start = 0
    for s in range(stages):
        cap = n - (stages - 1 - s)
        end = start
        while end < cap and fits(s, start, end + 1):
            end += 1
        if end == start:
            return False
        start = end
    return start == n


def even_partition(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    cap: float,
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[int]:
    """Among partitions whose every run costs at most ``cap``, the one with the least sum of squares."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            b, a = inf, -1
            for j in range(i - 1, s - 2, -1):
                if fits is not None and not fits(s - 1, j, i):
                    break
                c = cost(s - 1, j, i)
                if c > cap:
                    break
                v = best[s - 1][j] + c * c
                if v < b:
                    b, a = v, j
            best[s][i], arg[s][i] = b, a
    return _starts(arg, stages, n)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of subgraphs on one rank."""

    index: int
    rank: int
    first: int  # first subgraph
    last: int  # last subgraph (inclusive)
    ops: int
    modules: tuple[str, ...]  # module paths covered, e.g. ("transformer.wte", "transformer.h.0-11")
    params: int  # parameters held (global elements; a tied one counts on every stage reading it)
    flops: int  # forward FLOPs per microbatch (global)
    inflight: float  # microbatches whose activations are stashed at the peak
    weight_bytes: float  # model states per device
    activation_bytes: float  # per microbatch per device
    memory_bytes: float  # weight_bytes + inflight * activation_bytes
    compute_seconds: float  # forward + backward per microbatch
    comm_seconds: float  # tensor-parallel communication per microbatch

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


@dataclass(frozen=True)
class StagePlan:
    """Stages of a pipeline, their ranks, and the predicted time and memory of each."""

    pp: int
    chunks: int
    waves: int | None
    microbatches: int | None
    cluster: str
    precision: str
    efficiency: float
    budget_bytes: float
    fingerprint: str
    num_subgraphs: int
    stages: tuple[Stage, ...]
    split_seconds: float = 0.0
    assign_seconds: float = 0.0

    @property
    def schedule(self) -> str:
        return "wave" if self.waves else ("interleaved" if self.chunks > 1 else "1f1b")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stages)

    @property
    def stage_of_subgraph(self) -> list[int]:
        out = [0] * self.num_subgraphs
        for s in self.stages:
            out[s.first : s.last + 1] = [s.index] * (s.last - s.first + 1)
        return out

    @property
    def bottleneck_seconds(self) -> float:
        return max(s.seconds for s in self.stages)

    @property
    def balance(self) -> float:
        """Slowest stage over the mean stage time (1.0 is perfect)."""
        mean = statistics.fmean(s.seconds for s in self.stages)
        return self.bottleneck_seconds / mean if mean > 0 else 1.0

    def rank_memory(self) -> list[float]:
        out = [0.0] * self.pp
        for s in self.stages:
            out[s.rank] += s.memory_bytes
        return out

    def rank_seconds(self) -> list[float]:
        out = [0.0] * self.pp
        for s in self.stages:
            out[s.rank] += s.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedule"] = self.schedule
        d["stage_to_rank"] = list(self.stage_to_rank)
        d["balance"] = self.balance
        d["rank_memory_bytes"] = self.rank_memory()
        for s, sd in zip(self.stages, d["stages"]):
            sd["seconds"] = s.seconds
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def format(self) -> str:
        gib = 2**30
        head = (
            f"pipeline {self.schedule}: pp={self.pp}"
            + (f" chunks={self.chunks}" if self.chunks > 1 else "")
            + (f" waves={self.waves}" if self.waves else "")
            + f", {self.num_subgraphs} subgraphs -> {self.num_stages} stages on {self.cluster}"
            f" ({self.precision}, {self.efficiency:.0%} of peak),"
            f" budget {self.budget_bytes / gib:.1f} GiB/device"
        )
        rows = [
            head,
            f"{'stage':>5} {'rank':>4} {'subgraphs':>9} {'ops':>5} {'params':>8} {'GFLOP':>9} "
            f"{'mem GiB':>8} {'ms':>8}  modules",
        ]
        for s in self.stages:
            mods = ", ".join(s.modules)
            rows.append(
                f"{s.index:>5} {s.rank:>4} {f'{s.first}-{s.last}':>9} {s.ops:>5} {_human(s.params):>8} "
                f"{s.flops / 1e9:>9.1f} {s.memory_bytes / gib:>8.3g} {s.seconds * 1e3:>8.4g}  "
                f"{mods if len(mods) <= 60 else mods[:57] + '...'}"
            )
        worst = max(self.stages, key=lambda s: s.seconds)
        rows.append(
            f"balance max/mean {self.balance:.3f}; slowest stage {worst.index} "
            f"({worst.seconds * 1e3:.2f} ms per microbatch); peak rank memory "
            f"{max(self.rank_memory()) / gib:.2f} GiB"
        )
        return "\n".join(rows)


def _human(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def module_units(paths: Sequence[str]) -> tuple[str, ...]:
    """Module paths cut after their first layer index (``transformer.h.3``) or two components,
    prefixes of others dropped, consecutive layers compressed (``transformer.h.0-11``)."""
    units: list[str] = []
    for p in paths:
        if not p:
            continue
        parts = p.split(".")
        k = next((i + 1 for i, x in enumerate(parts) if x.isdigit()), min(2, len(parts)))
        u = ".".join(parts[:k])
        if u not in units:
            units.append(u)
    units = [u for u in units if not any(o != u and o.startswith(u + ".") for o in units)]
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # prefix, first index, last index
    for u in units:
        prefix, _, idx = u.rpartition(".")
        if idx.isdigit() and run and run[0] == prefix and int(idx) == run[2] + 1:
            run = (prefix, run[1], int(idx))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
            run = None
        if idx.isdigit():
            run = (prefix, int(idx), int(idx))
        else:
            out.append(u)
    if run:
        out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
    return tuple(out)


def _load_cluster(cluster: ClusterSpec | str | None) -> ClusterSpec:
    if isinstance(cluster, ClusterSpec):
        return cluster
    return ClusterSpec.load(cluster or DEFAULT_CLUSTER)


def _check_shape(pp: int, chunks: int, waves: int | None) -> None:
    if pp < 1 or chunks < 1 or (waves is not None and waves < 1):
        raise PipelineError(f"pp, chunks and waves must be >= 1; got pp={pp}, chunks={chunks}, waves={waves}")
    if waves and chunks > 1:
        raise PipelineError("choose interleaving (chunks) or waves, not both: waves already put 2W chunks on a rank")


def assign_stages(
    prog: Program,
    split: Split,
    pp: int,
    chunks: int = 1,
    waves: int | None = None,
    cluster: ClusterSpec | str | None = None,
    budget_bytes: float | None = None,
    microbatches: int | None = None,
    *,
    efficiency: float = EFFICIENCY,
    precision: str = "bf16",
    comm_fn: CommFn = megatron_tp_comm_seconds,
) -> StagePlan:
    """Balance the subgraphs of ``split`` over the stages of a ``pp``-rank pipeline."""
    t0 = time.perf_counter()
    _check_shape(pp, chunks, waves)
    spec = _load_cluster(cluster)
    budget = float(budget_bytes if budget_bytes is not None else spec.device_memory)
    S, n = num_stages(pp, chunks, waves), len(split)
    if S > n:
        _too_many_stages(prog, split, pp, chunks, waves)
    dp, tp, sharded = _degrees(prog)
    ctx = StageContext(prog, spec, dp, tp, sharded, precision, efficiency, frozenset(common_nodes(prog)))
    costs = subgraph_costs(ctx, split, comm_fn)
    per_rank = S // pp
    share = budget / per_rank
    timefn, memfn = _run_costs(costs)
    k = inflight(pp, chunks, waves, microbatches)

    def mem(s: int, j: int, i: int) -> float:
        return memfn(j, i, k[s])

    def fits(s: int, j: int, i: int) -> bool:
        return mem(s, j, i) <= share

    best, _ = min_max_partition(n, S, lambda s, j, i: timefn(j, i), fits)
    if best == math.inf:
        _no_fit(prog, split, costs, pp, chunks, waves, microbatches, budget)
    cap = best * (1 + 1e-12)
    starts = even_partition(n, S, lambda s, j, i: timefn(j, i), cap, fits)
    ranks = stage_ranks(pp, chunks, waves)
    stages = []
    for s, j in enumerate(starts):
        i = starts[s + 1] if s + 1 < S else n
        subs = split.subgraphs[j:i]
        a, b = subs[0].start, subs[-1].stop
        held = {p for sg in subs for p in sg.graph_inputs if p in costs.params}
        weight = memfn(j, i, 0)
        act = sum(costs.subgraphs[x].act_bytes for x in range(j, i))
        stages.append(
            Stage(
                index=s,
                rank=ranks[s],
                first=j,
                last=i - 1,
                ops=b - a,
                modules=module_units([op.path for op in prog.ops[a:b]]),
                params=sum(_global_numel(prog, p) for p in held),
                flops=sum(sg.flops for sg in subs),
                inflight=k[s],
                weight_bytes=weight,
                activation_bytes=act,
                memory_bytes=weight + k[s] * act,
                compute_seconds=sum(costs.subgraphs[x].compute_seconds for x in range(j, i)),
                comm_seconds=sum(costs.subgraphs[x].comm_seconds for x in range(j, i)),
            )
        )
    return StagePlan(
        pp=pp,
        chunks=chunks,
        waves=waves,
        microbatches=microbatches,
        cluster=spec.name,
        precision=precision,
        efficiency=efficiency,
        budget_bytes=budget,
        fingerprint=split.fingerprint,
        num_subgraphs=n,
        stages=tuple(stages),
        split_seconds=split.seconds,
        assign_seconds=time.perf_counter() - t0,
    )


def _global_numel(prog: Program, name: str) -> int:
    return next(v.type.numel for v in prog.inputs if v.name == name)


def _run_costs(
    costs: _Costs,
) -> tuple[Callable[[int, int], float], Callable[[int, int, float], float]]:
    """O(1) time and O(#tied parameters) memory of a run of subgraphs [j, i), from prefix sums."""
    tpre, wpre, apre = [0.0], [0.0], [0.0]
    for c in costs.subgraphs:
        tpre.append(tpre[-1] + c.seconds)
        wpre.append(wpre[-1] + c.weight_bytes)
        apre.append(apre[-1] + c.act_bytes)
    tied = [(b, sorted(where)) for b, where in costs.tied]

    def time_of(j: int, i: int) -> float:
        return tpre[i] - tpre[j]

    def memory_of(j: int, i: int, k: float) -> float:
        shared = sum(b for b, where in tied if any(j <= x < i for x in where))
        return wpre[i] - wpre[j] + shared + k * (apre[i] - apre[j])

    return time_of, memory_of


# ---------------------------------------------------------------------------------------------
# Errors that say what would work


def _too_many_stages(prog: Program, split: Split, pp: int, chunks: int, waves: int | None) -> None:
    n, S = len(split), num_stages(pp, chunks, waves)
    shape = f"pp={pp}" + (f" x chunks={chunks}" if chunks > 1 else "") + (f" x 2 x waves={waves}" if waves else "")
    if n == 1:
        why = "; ".join(blockers(prog))
        raise NoLegalCutError(
            f"{shape} needs {S} stages, but the graph has no legal cut: at every gap between ops more "
            f"tensors cross than the split allows. Longest-lived tensors: {why}. Raise "
            "SplitOptions.max_crossing, or restructure the model so that layers hand on one tensor."
        )
    per = 2 * waves if waves else chunks
    hint = (
        f"pp <= {n // per}"
        + (f" with chunks={chunks}" if chunks > 1 else "")
        + (f" with waves={waves}" if waves else "")
    )
    raise TooFewSubgraphsError(
        f"{shape} needs {S} stages, but the graph splits into only {n} subgraphs "
        f"({split.subgraphs[0].label or 'first'} ... {split.subgraphs[-1].label or 'last'}): "
        f"use at most {n} stages ({hint}).",
        n,
    )


def _no_fit(
    prog: Program,
    split: Split,
    costs: _Costs,
    pp: int,
    chunks: int,
    waves: int | None,
    microbatches: int | None,
    budget: float,
) -> None:
    gib = 2**30
    n, S = len(split), num_stages(pp, chunks, waves)
    per_rank = S // pp
    _, memfn = _run_costs(costs)
    k = inflight(pp, chunks, waves, microbatches)
    need, _ = min_max_partition(n, S, lambda s, j, i: memfn(j, i, k[s]))
    smallest = need * per_rank
    feasible_pp = None
    for p in range(pp + 1, n + 1):
        if num_stages(p, chunks, waves) > n:
            break
        kp = inflight(p, chunks, waves, microbatches)
        if feasible(n, num_stages(p, chunks, waves), lambda s, j, i, kp=kp: memfn(j, i, kp[s]) * per_rank <= budget):
            feasible_pp = p
            break
    deepest = max(p for p in range(pp, n + 1) if num_stages(p, chunks, waves) <= n)
    alt = (
        f"with this budget the smallest pipeline that fits is pp={feasible_pp}"
        if feasible_pp
        else f"no deeper pipeline of this shape (up to pp={deepest}) fits either: use smaller "
        "microbatches, fewer microbatches in flight, or tensor parallelism"
    )
    raise StageMemoryError(
        f"no split of the {n} subgraphs into {S} stages fits {budget / gib:.2f} GiB per device "
        f"(16 bytes per parameter plus the activations of in-flight microbatches): the smallest "
        f"budget that fits {S} stages is {smallest / gib:.2f} GiB; {alt}.",
        smallest_budget_bytes=smallest,
        smallest_pp=feasible_pp,
    )


# ---------------------------------------------------------------------------------------------
# Entry point for the plan CLI and the pipeline-split pass


def plan_pipeline(
    prog: Program,
    pp: int,
    chunks: int = 1,
    waves: int | None = None,
    cluster: ClusterSpec | str | None = None,
    budget_bytes: float | None = None,
    microbatches: int | None = None,
    *,
    efficiency: float = EFFICIENCY,
    precision: str = "bf16",
    split_options: SplitOptions | None = None,
    comm_fn: CommFn = megatron_tp_comm_seconds,
) -> tuple[Program, StagePlan, float]:
    """Split ``prog`` (cached by fingerprint) and balance it over ``pp`` ranks.

    Returns the program annotated with ``subgraph=k`` and ``stage=s`` on every op (graph inputs:
    their first use), the StagePlan, and the seconds the split took (near zero from the cache).
    """
    _check_shape(pp, chunks, waves)
    split = split_program(prog, split_options)
    plan = assign_stages(
        prog,
        split,
        pp,
        chunks,
        waves,
        cluster,
        budget_bytes,
        microbatches,
        efficiency=efficiency,
        precision=precision,
        comm_fn=comm_fn,
    )
    return annotate(prog, split, plan.stage_of_subgraph), plan, split.seconds
