"""The search: the ``top`` fastest whole plans of a model for a cluster within a memory budget, by branch and bound.

    from autopar.search import search_model
    result = search_model("gpt3-175b", "dgx-a100:nodes=128", global_batch=1536, top=5)
    print(result.format())                # step time, MFU, peak memory per rank of the five best plans
    plan = result.materialize()           # the flow (passes/flow.py) at the best candidate -> an autopar Plan
    plan.save("plan.json")

or ``autopar plan gpt3-175b --cluster dgx-a100:nodes=128 --global-batch 1536 --top 5 -o plan.json``.

How a search runs (what is exact and what is estimated: docs/user_guide.md, "How the search works"),
one file per step:

1. **Profile** (``profile.py``): the model is captured once on the meta device with one sample per
   batch and lowered; per-layer FLOPs, parameters, saved activations and Megatron-style
   tensor-parallel all-reduces are read from the IR (cached on disk by model spec).
2. **Enumerate and price** (``space.py``, ``price.py``): every candidate of the ``SearchSpace`` is
   priced analytically (``Analytic.evaluate``): per-stage times, per-rank memory, and a lower bound
   on the step time. Candidates over the memory budget are dropped. Each ZeRO stage of a chain (``space.Chain``)
   is walked from its least recomputation on: a level comes only after the one before it, no faster, under the
   larger of its own lower bound and that level's simulated step (``_Walk``).
3. **Score** (``score.py``): candidates are visited in order of their bound (``order="bound"``)
   or in any given order; a candidate whose bound exceeds the K-th best step time found so far
   cannot be among the K best and is not simulated, nor is any more recomputation of it (branch and bound: the
   answer does not depend on the visiting order, tests/test_search.py shuffles it, and it is what scoring every
   candidate that fits finds, tests/test_search_bound.py). Others are simulated.
4. **Materialize** (``materialize.py``): ``SearchResult.materialize`` captures the model at the
   chosen micro-batch and runs the flow (``passes/flow.py``: the intra-op ILP on the whole program,
   the collectives, the split into the chosen stages), as ``autopar plan --mesh`` does: a Plan file
   that ``autopar.compile(model, mesh, plan=...)`` loads.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import sys
import time
from typing import Any

from tqdm import tqdm

from autopar.errors import InfeasibleError
from autopar.search.evaluation import NEAR_EQUAL, Evaluation, order_near_equal
from autopar.search.price import Analytic
from autopar.search.profile import Profile, profile_model
from autopar.search.result import GiB, SearchResult
from autopar.search.score import Scorer
from autopar.search.space import Candidate, Chain, Family, SearchSpace, chains, families, max_shard, sync_options
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.experts import DEFAULT_IMBALANCE

# the family bounds (``search(bound=...)``): "chains" the chains' (bubble, forced recomputation, per-rank sync:
# ``Analytic.family_floor``) over "sync" (``Analytic.family_bounds``: mean compute plus the least dp sync), "compute"
# the mean compute alone
BOUNDS = ("chains", "sync", "compute")
_BOUND_SLACK = 1e-9  # relative: float sums of the bound and the simulator differ in the last bits


def search(
    profile: Profile,
    cluster: ClusterSpec,
    global_batch: int,
    budget_bytes: float | None = None,
    space: SearchSpace | None = None,
    top: int = 1,
    precision: str = "bf16",
    order: str = "bound",
    seed: int = 0,
    progress: bool = False,
    scorer: Scorer | None = None,
    spec: str | None = None,
    bound: str = "chains",
    attention: str = "fused",
    compiled: bool = False,
    router_imbalance: float = DEFAULT_IMBALANCE,
    capacity_factor: float | None = None,
) -> SearchResult:
    """Find the ``top`` fastest candidates that fit ``budget_bytes`` per device (default: the device memory less
    its reserve, ``ClusterSpec.plan_memory``). ``attention`` is how the model's attention runs, a stated assumption
    of every price: "fused" (one kernel, FlashAttention or PyTorch's SDPA on a GPU: no scores stored) or "unfused"
    (Megatron-LM of 2021: batched matmuls, a fused softmax and dropout on the stored scores; ``compute.py``).
    ``compiled``: the plan runs with ``torch_compile=True``, its elementwise ops priced fused (``StageTerms``).
    ``router_imbalance`` and ``capacity_factor`` price a mixture of experts' busiest expert rank as TrainConfig's
    fields of those names do (``StageTerms.expert_seconds``).

    Branch and bound on two levels. A family (mesh, micro-batch) has a step-time lower bound; a
    priced candidate its own, larger one, and a level of recomputation after the first of its ZeRO stage also the
    step of the level before it (``_Walk``: it is priced only once that one is scored). With ``order="bound"``
    families are expanded (priced) by increasing bound and priced candidates are scored best first, each only once
    nothing cheaper is left; "shuffle" visits families and their candidates in a random order drawn from ``seed``,
    "given" in enumeration order. A family or candidate whose bound exceeds the K-th best step time
    found so far (plus ``NEAR_EQUAL``) is skipped. The answer does not depend on the order. Step times
    within ``NEAR_EQUAL`` (0.1%) of each other count as equal: the least memory first
    (``evaluation.order_near_equal``), then the faster, then the candidate's fields. Raises ``InfeasibleError`` (with
    ``smallest_budget_bytes``) when nothing fits.
    """
    t0 = time.perf_counter()
    space = dataclasses.replace(space or SearchSpace(), devices_per_node=cluster.devices_per_node)
    budget = float(budget_bytes if budget_bytes is not None else cluster.plan_memory)
    an = Analytic(
        profile, cluster, global_batch, precision=precision, attention=attention, compiled=compiled,
        router_imbalance=router_imbalance, capacity_factor=capacity_factor,
    )  # fmt: skip
    keys = ("space", "families", "families_over_budget", "families_pruned_by_bound", "priced", "over_budget",
            "dominated", "unsupported", "pruned_by_bound", "scored")  # fmt: skip
    stats: dict[str, Any] = dict.fromkeys(keys, 0)
    stats["top"] = top  # how many plans were asked for (SearchResult.format refuses more)
    fams = families(an, space, cluster.world_size)
    stats["families"] = len(fams)
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, not {bound!r}")
    options = {f: sync_options(space, f, an.zero0_dominated) if bound != "compute" else () for f in fams}
    bounds = {
        f: an.family_bounds(
            f.pp, f.dp, f.tp, f.micro_batch, f.microbatches, max_shard(space, f), options[f], f.cp, ep=f.ep, sp=f.sp,
        )
        for f in fams
    }  # fmt: skip
    family_chains: dict[Family, list[Chain]] = {}

    def chains_of(f: Family) -> list[Chain]:
        if f not in family_chains:
            family_chains[f] = list(chains(an, space, f))
        return family_chains[f]

    def tighten(f: Family, memory: bool) -> tuple[float, float]:
        """The family's bounds from its chains (``Analytic.family_floor``: bubble, per-rank sync and, with
        ``memory``, the recomputation its memory forces), no looser than ``family_bounds``'."""
        t, mem = an.family_floor(chains_of(f), budget, max_shard(space, f), options[f], memory=memory)
        return max(t, bounds[f][0]), max(mem, bounds[f][1])

    rng = random.Random(seed)
    if order == "bound":
        fams.sort(key=lambda f: (bounds[f][0], f))
    elif order == "shuffle":
        rng.shuffle(fams)
    elif order != "given":
        raise ValueError(f"order must be bound, shuffle or given, not {order!r}")
    scorer = scorer or Scorer()
    heap: list[tuple] = []  # the K best so far as (-step, -memory, inverted candidate order, evaluation)
    best_first = order == "bound"
    queue: list[tuple] = []  # priced, unscored candidates: (lower bound, candidate, evaluation)

    def kth() -> float:
        return -heap[0][0] if len(heap) >= top else math.inf

    def beyond(b: float) -> bool:
        return b > kth() * (1 + NEAR_EQUAL) * (1 + _BOUND_SLACK)

    near: list[Evaluation] = []  # every scored plan; at the end those within NEAR_EQUAL of the K-th best
    # each ZeRO stage of a chain is walked along its recomputation levels, least first (``_Walk``); a walk's next
    # candidate waits in the queue under a bound, the larger of its own lower bound and the step of the level it
    # follows, so a level is priced or scored only while it could still be among the K best
    queue: list[tuple] = []  # (bound, candidate, walk): best first by bound
    stack: list[_Walk] = []  # the same for order="given" / "shuffle": visited at once

    def push(w: _Walk) -> None:
        if best_first:
            heapq.heappush(queue, (w.floor, w.chain.candidate(w.zero, w.level), w))
        else:
            stack.append(w)

    def visit(w: _Walk) -> None:
        """The walk's candidate: pruned when its bound is beyond the K-th best (with every later level of its ZeRO
        stage, no faster: ``dominated`` where the bound is a scored level's step), priced if not yet priced (then
        queued again under its own lower bound when it fits, or the next level queued when it does not), else
        scored, and the next level queued under its step."""
        rest = len(w.chain.levels) - w.level
        if beyond(w.floor):
            stats["dominated" if w.after_step else "pruned_by_bound"] += rest
            return
        if w.ev is None:
            ev = an.evaluate(w.chain.candidate(w.zero, w.level))
            stats["priced"] += 1
            if ev is None:  # the stage layout does not exist (no level has it)
                stats["over_budget"] += rest
                return
            after = w.after_step and w.floor >= ev.lower_bound
            floor = max(w.floor, ev.lower_bound)
            if ev.memory <= budget:
                push(_Walk(w.chain, w.zero, w.level, floor, after, ev))
            else:
                stats["over_budget"] += 1
                if rest > 1:  # more recomputation: no faster than this level, which its bound bounds
                    push(_Walk(w.chain, w.zero, w.level + 1, floor, after))
            return
        ev = w.ev
        scorer.score(ev)
        stats["scored"] += 1
        near.append(ev)
        item = (-ev.step_time, -ev.memory, _Inverted(ev.candidate), ev)
        if len(heap) < top:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
        if rest > 1:
            push(_Walk(w.chain, w.zero, w.level + 1, ev.step_time, True))

    def drain(limit: float) -> None:
        """Visit queued walks with a bound up to ``limit``, best first."""
        while queue and queue[0][0] <= limit:
            visit(heapq.heappop(queue)[2])

    def pruned(rest: list[Family]) -> None:
        size = sum(ch.size for g in rest for ch in chains_of(g))
        stats["families_pruned_by_bound"] += len(rest)
        stats["pruned_by_bound"] += size
        stats["space"] += size
        bar.update(len(rest))

    def over_budget(f: Family) -> None:
        size = sum(ch.size for ch in chains_of(f))
        stats["space"] += size
        stats["families_over_budget"] += 1
        stats["over_budget"] += size
        bar.update(1)

    # families by their bound, best first; the chains' bound (``tighten``, dearer) is computed for a family only once
    # it comes first by the cheap one, in two steps: first without the memory (the bubble and each rank's sync at the
    # least recomputation), then, once it comes first by that, with the recomputation its memory forces (the
    # in-flight counts, read off a zero-bubble schedule's orders, are the dear part); each time it goes back in by
    # the tighter bound (a bound only rises). ``exact``: how many of the two steps are done.
    todo = [(bounds[f][0], 0, i, f) for i, f in enumerate(fams)]
    tight = bound == "chains"
    bar = tqdm(total=len(fams), desc="search", unit="family", file=sys.stderr, disable=not progress, leave=False)
    while todo:
        b, exact, i, f = todo[0] if best_first else todo.pop(0)
        if best_first:
            drain(b)  # everything queued that could beat this family goes first
        if beyond(b):
            if best_first:  # families come by increasing bound: all later ones too
                pruned([g for *_, g in todo])
                break
            pruned([f])
            continue
        if best_first:
            heapq.heappop(todo)
        if tight and exact < 2:
            b, mem = tighten(f, memory=exact == 1)
            if mem > budget:  # the model states and the least activations do not fit
                over_budget(f)
            elif best_first:
                heapq.heappush(todo, (b, exact + 1, i, f))
            elif beyond(b):
                pruned([f])
            else:
                todo.insert(0, (b, exact + 1, i, f))
            continue
        if bounds[f][1] > budget:  # the model states alone do not fit
            over_budget(f)
            continue
        bar.update(1)
        # each ZeRO stage of each chain under its own floor (``Analytic.chain_floors``): best first, its least
        # recomputation is priced only once nothing cheaper is left (otherwise at once)
        floors = an.chain_floors(chains_of(f), budget, max_shard(space, f), options[f]) if tight else None
        for k, ch in enumerate(chains_of(f)):
            stats["space"] += ch.size
            stats["unsupported"] += ch.unsupported
            for j, z in enumerate(ch.zeros):
                floor = floors[k][j] if floors else -math.inf
                if floor == math.inf:  # no candidate of this ZeRO stage fits (or exists)
                    stats["over_budget"] += len(ch.levels)
                    continue
                w = _Walk(ch, z, 0, floor, False)
                push(w) if best_first and floors else visit(w)
        family_chains.pop(f)
        if order == "shuffle":
            rng.shuffle(stack)
        while stack:
            visit(stack.pop())
        bar.set_postfix(scored=stats["scored"], refresh=False)
    drain(math.inf)
    bar.close()
    if not heap:
        _no_fit(an, space, fams, cluster, global_batch, budget, stats)
    # near-equal plans (within NEAR_EQUAL of the K-th best, all scored whatever the visiting order) by memory
    limit = kth() * (1 + NEAR_EQUAL)
    best = order_near_equal([e for e in near if e.step_time <= limit])[:top]
    stats["simulations"] = scorer.simulations
    stats["schedules_built"] = len(scorer.schedules.keys() | scorer.replays.keys())
    stats["search_seconds"] = time.perf_counter() - t0
    stats.setdefault("profile_seconds", 0.0)
    return SearchResult(best, stats, an, cluster, global_batch, budget, space, spec, precision, scorer)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The next candidate of one ZeRO stage of a chain, walked along its recomputation levels (least first).

    Along the levels of one ZeRO stage a candidate recomputes more: its simulated step is never shorter (more work
    in the same schedule; ``tests/test_search_bound.py`` checks it over whole spaces), its memory usually less (not
    always: a recomputed layer's transient can outweigh what it saves with few microbatches in flight). So a level
    is visited after the one before it, under ``floor``: the larger of a lower bound of its own and the previous
    level's step (or, where that did not fit, its lower bound). Nothing else is assumed: ZeRO stages are walked
    apart (a higher stage can be faster, ZeRO-3's gathers beside the backward and the sharded optimizer step), and a
    slower level can still be among the K best (or, within ``NEAR_EQUAL``, ahead on memory); the walk stops only
    where the bound passes the K-th best step."""

    chain: Chain
    zero: int
    level: int
    floor: float  # a lower bound on the candidate's step time
    after_step: bool  # the floor is a scored level's step (pruned by it: "dominated")
    ev: Evaluation | None = None  # priced, fits the budget, not yet scored


class _Inverted:
    """Reverses a candidate's order so that the heap's root is the worst of the K kept."""

    __slots__ = ("c",)

    def __init__(self, c: Candidate):
        self.c = c

    def __lt__(self, other: _Inverted) -> bool:
        return self.c > other.c

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Inverted) and self.c == other.c


def smallest_memory(an: Analytic, space: SearchSpace, fams: list[Family]) -> float:
    """The least per-device memory of any candidate, every one priced (on the error path only): memory is not
    monotone along a chain (ZeRO-3's gathered units can outweigh ZeRO-2's sharded gradients, a recomputed layer's
    transient what recomputation saves with few microbatches in flight)."""
    best = math.inf
    for f in fams:
        for ch in chains(an, space, f):
            for c in ch.candidates():
                ev = an.evaluate(c)
                if ev is not None:
                    best = min(best, ev.memory)
    return best


def _no_fit(an: Analytic, space: SearchSpace, fams: list[Family], cluster: ClusterSpec, B: int, budget: float,
            stats: dict) -> None:  # fmt: skip
    smallest = smallest_memory(an, space, fams)
    model = an.p.model or "the model"
    if smallest == math.inf:
        raise InfeasibleError(
            f"no configuration of {model} exists on {cluster.world_size} devices with global batch {B}: the batch "
            "must be divisible by a data-parallel size and the search space must not be empty",
        )
    raise InfeasibleError(
        f"no plan of {model} fits {budget / GiB:.2f} GiB per device on {cluster.name} x {cluster.world_size} with "
        f"global batch {B} ({stats['space']:,} candidates); the smallest budget that fits is {smallest / GiB:.2f} GiB "
        f"({smallest:,.0f} bytes): raise --budget-gb, use more devices, or allow more ZeRO stages / recomputation",
        smallest_budget_bytes=smallest,
    )


def search_model(
    spec: str,
    cluster: ClusterSpec | str,
    global_batch: int,
    budget_bytes: float | None = None,
    space: SearchSpace | None = None,
    **kw: Any,
) -> SearchResult:
    """``search`` for a model spec (preset with overrides): profile it (cached), then search."""
    cl = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.load(cluster)
    t0 = time.perf_counter()
    prof = profile_model(spec)
    seconds = time.perf_counter() - t0
    result = search(prof, cl, global_batch, budget_bytes, space, spec=spec, **kw)
    result.stats["profile_seconds"] = seconds
    return result


__all__ = ["search", "search_model", "smallest_memory"]
