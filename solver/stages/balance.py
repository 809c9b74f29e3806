"""Stage balance: contiguous runs of a pipeline split's subgraphs onto stages, min-max stage time in a budget.

Input: the subgraph sequence of ``autopar.passes.pipeline_split`` (anything shaped like it, see
``solver/stages/cost.OpRun``) and a pipeline shape (``schedule/placement.py``: pp ranks holding
``pp * chunks`` or ``2 * pp * waves`` stages). The cost of each subgraph is ``solver/stages/cost.py``;
a stage on rank r stashes ``inflight_per_stage`` microbatches' activations.

The partition (``solver/stages/partition.py``) minimizes the slowest stage (the pipeline's steady-state
period) subject to each stage fitting ``budget / (stages per rank)``; among the partitions that reach
that minimum it takes the one with the smallest sum of squared stage times (the most even). On a V
(one wave: ZB-V, DualPipeV), where a rank runs both its stages for every microbatch, it minimizes the
slowest rank instead (``solver/stages/v_layout.py``, the search's V layout) when that layout fits. When
nothing fits, ``StageMemoryError`` says the smallest budget that fits and the smallest deeper
pipeline that would.

Given the schedule's stash points (a split-backward schedule's: ``schedule/actions.stage_stash_points`` of
each rank's own list), a stage's activations are its worst point's stashes plus the output gradients
its split B keeps until W (``stages.cost.SubgraphCost.wkept_bytes``), and a rank's are its worst point
over its stages together: the simulator's peak (``tests/test_zero_bubble.py``).

The pass that splits a Program and annotates its stages is ``autopar.passes.assign_stages``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

from autopar.errors import StageMemoryError, TooFewSubgraphsError
from autopar.ir.core import Program
from autopar.schedule.generators import inflight_per_stage
from autopar.schedule.placement import check_shape, num_stages, stage_ranks
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.stages.cost import (
    CommFn,
    OpRun,
    SplitCosts,
    StageContext,
    megatron_tp_comm_seconds,
    parallel_degrees,
    subgraph_costs,
)
from autopar.solver.stages.partition import even_partition, feasible, min_max_partition
from autopar.solver.stages.plan import Stage, StagePlan, module_units
from autopar.solver.stages.v_layout import balanced_v_layout

DEFAULT_CLUSTER = "dgx-a100"


class SplitLike(Protocol):
    """A pipeline split as the balance reads it (``autopar.passes.pipeline_split.Split`` is one)."""

    @property
    def subgraphs(self) -> Sequence[OpRun]: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def seconds(self) -> float: ...


def load_cluster(cluster: ClusterSpec | str | None) -> ClusterSpec:
    """A ClusterSpec, a preset name, or None for ``DEFAULT_CLUSTER``."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    return ClusterSpec.load(cluster or DEFAULT_CLUSTER)


def balance_stages(
    prog: Program,
    split: SplitLike,
    pp: int,
    chunks: int = 1,
    waves: int | None = None,
    cluster: ClusterSpec | str | None = None,
    budget_bytes: float | None = None,
    microbatches: int | None = None,
    *,
    commons: frozenset[str],
    schedule: str | None = None,
    efficiency: float | None = None,
    precision: str = "bf16",
    comm_fn: CommFn = megatron_tp_comm_seconds,
    stash_points: StashPoints | None = None,
    compiled: bool = False,
) -> StagePlan:
    """Balance the subgraphs of ``split`` over the stages of a ``pp``-rank pipeline.

    ``commons``: the program's common nodes (values no gradient flows through: never stashed);
    ``microbatches=None``: as many as the schedule can keep in flight; ``schedule``: the one that runs
    (its in-flight counts, ``schedule.generators.inflight_per_rank``; default the shape's own);
    ``stash_points``: per rank, the (stashed, awaiting W) counts of each of its stages at its candidate
    peaks (``schedule/actions.stage_stash_points`` of the schedule's lists; they replace the in-flight
    counts, and price the W-kept gradients of a split backward); ``compiled``: the stages run under torch.compile
    (their elementwise ops priced fused: ``StageContext.compiled``)."""
    t0 = time.perf_counter()
    check_shape(pp, chunks, waves)
    spec = load_cluster(cluster)
    budget = float(budget_bytes if budget_bytes is not None else spec.device_memory)
    subs = split.subgraphs
    S, n = num_stages(pp, chunks, waves), len(subs)
    if S > n:
        too_few_subgraphs(split, pp, chunks, waves)
    dp, tp, sharded = parallel_degrees(prog)
    ctx = StageContext(prog, spec, dp, tp, sharded, precision, efficiency, frozenset(commons), compiled)
    costs = subgraph_costs(ctx, subs, comm_fn)
    share = budget / (S // pp)
    timefn, memfn = costs.run_costs()
    k = inflight_per_stage(pp, chunks, waves, microbatches, schedule)
    ranks = stage_ranks(pp, chunks, waves)
    holds = _held(costs, ranks, k, stash_points)

    def fits(s: int, j: int, i: int) -> bool:
        return memfn(j, i, 0) + holds(s, j, i) <= share

    best, _ = min_max_partition(n, S, lambda s, j, i: timefn(j, i), fits)
    if best == math.inf:
        _no_fit(split, costs, pp, chunks, waves, microbatches, budget, schedule, stash_points)
    starts = even_partition(n, S, lambda s, j, i: timefn(j, i), best * (1 + 1e-12), fits)
    if waves == 1:  # a V: a rank runs both its stages per microbatch, so balance ranks (when that fits)
        v = balanced_v_layout([c.seconds for c in costs.subgraphs], pp)
        if v is not None and all(fits(s, a, b) for s, (a, b) in enumerate(v)):
            starts = [a for a, _ in v]
    numel = {v.name: v.type.numel for v in prog.inputs}
    stages = []
    for s, j in enumerate(starts):
        i = starts[s + 1] if s + 1 < S else n
        run = subs[j:i]
        a, b = run[0].start, run[-1].stop
        mine = {p for sg in run for p in sg.graph_inputs if p in costs.params}
        weight = memfn(j, i, 0)
        act, wkept = costs.kept_costs()(j, i)
        stages.append(
            Stage(
                index=s,
                rank=ranks[s],
                first=j,
                last=i - 1,
                ops=b - a,
                modules=module_units([op.path for op in prog.ops[a:b]]),
                params=sum(numel[p] for p in mine),
                flops=sum(sg.flops for sg in run),
                inflight=k[s] if stash_points is None else max(n for n, _ in _own_points(stash_points, ranks, s)),
                weight_bytes=weight,
                activation_bytes=act,
                wkept_bytes=wkept,
                memory_bytes=weight + holds(s, j, i),
                compute_seconds=sum(costs.subgraphs[x].compute_seconds for x in range(j, i)),
                comm_seconds=sum(costs.subgraphs[x].comm_seconds for x in range(j, i)),
            )
        )
    return StagePlan(
        pp=pp,
        chunks=chunks,
        waves=waves,
        microbatches=microbatches,
        run_schedule=schedule,
        cluster=spec.name,
        precision=precision,
        efficiency=efficiency,
        budget_bytes=budget,
        fingerprint=split.fingerprint,
        num_subgraphs=n,
        stages=tuple(stages),
        split_seconds=split.seconds,
        assign_seconds=time.perf_counter() - t0,
        rank_activation_bytes=None if stash_points is None else _rank_peaks(stages, pp, stash_points),
    )


StashPoints = Sequence[Sequence[Sequence[tuple[int, int]]]]  # rank -> point -> its stage -> (stashed, awaiting W)


def _own_points(points: StashPoints, ranks: Sequence[int], s: int) -> set[tuple[int, int]]:
    """Stage ``s``'s own (stashed, awaiting W) counts at its rank's points."""
    q = list(ranks[:s]).count(ranks[s])  # s's place among its rank's stages
    return {pt[q] for pt in points[ranks[s]]}


def _held(costs: SplitCosts, ranks: Sequence[int], k: Sequence[float], points: StashPoints | None):
    """``held(s, j, i)``: the activation bytes stage ``s`` holds at its peak when it runs subgraphs [j, i):
    ``k[s]`` stashes, or with stash points its worst point's stashes and W-kept gradients."""
    kept = costs.kept_costs()
    if points is None:
        return lambda s, j, i: k[s] * kept(j, i)[0]
    own = [_own_points(points, ranks, s) for s in range(len(ranks))]

    def held(s: int, j: int, i: int) -> float:
        act, wk = kept(j, i)
        return max(n * act + w * wk for n, w in own[s])

    return held


def _rank_peaks(stages: Sequence[Stage], pp: int, points: StashPoints) -> tuple[float, ...]:
    """Each rank's activation bytes at its worst point, its stages together (the simulator's peak)."""
    out = []
    for r in range(pp):
        mine = [st for st in stages if st.rank == r]
        out.append(
            max(sum(n * st.activation_bytes + w * st.wkept_bytes for (n, w), st in zip(pt, mine)) for pt in points[r])
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Errors that say what would work


def pipeline_shape_text(pp: int, chunks: int, waves: int | None) -> str:
    return f"pp={pp}" + (f" x chunks={chunks}" if chunks > 1 else "") + (f" x 2 x waves={waves}" if waves else "")


def too_few_subgraphs(split: SplitLike, pp: int, chunks: int, waves: int | None) -> None:
    """Raise ``TooFewSubgraphsError``: the shape needs more stages than the split has subgraphs."""
    subs = split.subgraphs
    n, S = len(subs), num_stages(pp, chunks, waves)
    per = 2 * waves if waves else chunks
    hint = (
        f"pp <= {n // per}"
        + (f" with chunks={chunks}" if chunks > 1 else "")
        + (f" with waves={waves}" if waves else "")
    )
    raise TooFewSubgraphsError(
        f"{pipeline_shape_text(pp, chunks, waves)} needs {S} stages, but the graph splits into only {n} subgraphs "
        f"({subs[0].label or 'first'} ... {subs[-1].label or 'last'}): use at most {n} stages ({hint}).",
        n,
    )


def _no_fit(
    split: SplitLike,
    costs: SplitCosts,
    pp: int,
    chunks: int,
    waves: int | None,
    microbatches: int | None,
    budget: float,
    schedule: str | None = None,
    stash_points: StashPoints | None = None,
) -> None:
    gib = 2**30
    n, S = len(split.subgraphs), num_stages(pp, chunks, waves)
    per_rank = S // pp
    _, memfn = costs.run_costs()
    k = inflight_per_stage(pp, chunks, waves, microbatches, schedule)
    holds = _held(costs, stage_ranks(pp, chunks, waves), k, stash_points)
    need, _ = min_max_partition(n, S, lambda s, j, i: memfn(j, i, 0) + holds(s, j, i))
    smallest = need * per_rank
    feasible_pp = None
    for p in range(pp + 1, n + 1):
        if num_stages(p, chunks, waves) > n:
            break
        kp = inflight_per_stage(p, chunks, waves, microbatches, schedule)
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


__all__ = ["DEFAULT_CLUSTER", "SplitLike", "balance_stages", "load_cluster", "too_few_subgraphs"]
