"""Offline strategy generation for a target cluster: search mesh, schedule, micro-batch, ZeRO and recomputation.

    from autopar.search import search_model
    result = search_model("gpt3-175b", "dgx-a100:nodes=128", global_batch=1536)
    print(result.format(top=5))           # step time, MFU, peak memory per rank of the best plans
    plan = result.materialize()           # the intra-op ILP per distinct stage -> an autopar Plan
    plan.save("plan.json")

or ``autopar plan gpt3-175b --cluster dgx-a100:nodes=128 --global-batch 1536 --top 5 -o plan.json``.

How a search runs (what is exact and what is estimated: docs/user_guide.md, "How the search works"):

1. **Profile.** The model is captured once on the meta device with one sample per batch and
   lowered; ``solver/search_space.profile_program`` reads per-layer FLOPs, parameters, saved
   activations and Megatron-style tensor-parallel all-reduces from the IR. Profiles are cached on
   disk by model spec beside the plan cache (``$AUTOPAR_CACHE_DIR/../profiles``; schedules
   likewise), so a second search skips the capture.
2. **Enumerate and price.** Every candidate of the ``SearchSpace`` is priced analytically
   (``Analytic.evaluate``): per-stage times, per-rank memory, and a lower bound on the step time.
   Candidates over the memory budget are dropped; so are dominated ones (ZeRO-0 when dp > 1, a
   slower recomputation or higher ZeRO stage of a configuration that fits with less).
3. **Score.** Survivors are visited in order of their lower bound (``order="bound"``) or in any
   given order; a candidate whose lower bound exceeds the K-th best step time found so far cannot
   be among the K best and is not simulated (branch and bound: the answer does not depend on the
   visiting order, tests/test_search.py shuffles it). Others are simulated: the schedule's action
   lists (``runtime/schedules.py``) run in ``runtime/simulator.py`` with the candidate's per-stage
   costs; each rank then synchronizes its data-parallel gradients. Large schedules (more than
   ``FULL_SIMULATION`` forward actions) are simulated at two smaller microbatch counts congruent to
   m modulo pp and extrapolated linearly (marked "extrapolated").
4. **Materialize.** ``SearchResult.materialize`` captures the model at the chosen micro-batch,
   splits it into the chosen stages (``solver/stages.plan_pipeline``), solves the intra-op ILP
   (``passes/shard.py``, objective: step time, the budget per device) once per distinct stage
   (stages with the same op signature share one solve), merges the placements and inserts the
   collectives: a Plan file ``autopar.compile(model, mesh, plan=...)`` loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import InfeasibleError, PresetError
from autopar.solver.cluster import ClusterSpec
from autopar.solver.search_space import (
    Analytic,
    Candidate,
    Chain,
    Evaluation,
    Family,
    Profile,
    SearchSpace,
    chains,
    families,
    max_shard,
    profile_program,
)

GiB = 2**30
FULL_SIMULATION = 2048  # simulate exactly up to this many forward actions (stages x microbatches)
_BOUND_SLACK = 1e-9  # relative: float sums of the bound and the simulator differ in the last bits


# ---------------------------------------------------------------------------------------------
# Profiles (one capture per model spec, cached)


def with_batch(spec: str, batch: int) -> str:
    """The MODEL string with its example batch set to ``batch`` (presets only)."""
    from autopar.models import _PRESETS

    name, _, rest = spec.partition(":")
    if name not in _PRESETS:
        raise PresetError(
            f"the search sets the example batch through the preset override batch=N; {spec!r} is not a "
            "preset: plan it with --mesh, or wrap it as a preset-like function taking the batch"
        )
    items = [s.strip() for s in rest.split(",") if s.strip() and not s.strip().startswith("batch=")]
    return f"{name}:" + ",".join(items + [f"batch={batch}"])


def _cache_dir(kind: str) -> Path | None:
    """``profiles`` or ``schedules`` beside the plan cache ($AUTOPAR_CACHE_DIR, default
    ~/.cache/autopar/plans); off when that is "", "0" or "off"."""
    plans = os.environ.get("AUTOPAR_CACHE_DIR", str(Path.home() / ".cache" / "autopar" / "plans"))
    if plans in ("", "0", "off"):
        return None
    return Path(plans).parent / kind


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


_PROFILES: dict[str, Profile] = {}


def profile_model(spec: str, cache: bool = True) -> Profile:
    """Capture ``spec`` with one sample on the meta device and read its per-unit costs (cached)."""
    import torch

    one = with_batch(spec, 1)
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:  # pragma: no cover - the presets need transformers
        tv = ""
    from autopar.solver.search_space import PROFILE_VERSION

    key = hashlib.sha256(f"{one}|{torch.__version__}|{tv}|{PROFILE_VERSION}".encode()).hexdigest()[:24]
    if cache and key in _PROFILES:
        return _PROFILES[key]
    d = _cache_dir("profiles") if cache else None
    path = d / f"{key}.json" if d else None
    if path is not None and path.exists():
        try:
            prof = Profile.from_dict(json.loads(path.read_text()))
            _PROFILES[key] = prof
            return prof
        except (ValueError, TypeError, KeyError):
            pass  # a stale or damaged entry: capture again
    from autopar.models import build
    from autopar.passes.capture import capture
    from autopar.passes.ir import MeshSpec
    from autopar.passes.lower import lower

    m = build(one, device="meta")
    captured = capture(m.model, m.args, m.kwargs)
    prog = lower(captured, MeshSpec())
    seq = next((v.type.shape[1] for v in prog.inputs if v.kind == "input" and len(v.type.shape) >= 2), 0)
    prof = profile_program(prog, batch=1, model=spec, seq=seq)
    if cache:
        _PROFILES[key] = prof
    if path is not None:
        _write_atomic(path, json.dumps(prof.to_dict()))
    return prof


# ---------------------------------------------------------------------------------------------
# Scoring with the simulator


class Scorer:
    """Simulates candidates; caches schedules by shape and results by per-stage costs."""

    def __init__(self, full_limit: int = FULL_SIMULATION):
        self.full_limit = full_limit
        self.schedules: dict[tuple, Any] = {}
        self.results: dict[tuple, tuple[list[float], list[float]]] = {}
        self.simulations = 0

    def schedule(self, name: str, P: int, M: int, opts: tuple):
        """The schedule's action lists: built once per shape, kept as text in the schedule cache."""
        key = (name, P, M, opts)
        if key not in self.schedules:
            from autopar.runtime.actions import Schedule
            from autopar.runtime.schedules import make_schedule

            d = _cache_dir("schedules")
            tag = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
            path = d / f"{name}-{P}-{M}-{tag}.txt" if d else None
            sched = None
            if path is not None and path.exists():
                try:
                    sched = Schedule.from_text(path.read_text())
                except Exception:  # a damaged entry: build again
                    sched = None
            if sched is None:
                sched = make_schedule(name, P, M, **dict(opts))
                if path is not None:
                    _write_atomic(path, sched.to_text())
            self.schedules[key] = sched
        return self.schedules[key]

    def costs(self, ev: Evaluation):
        """Per-stage costs for the simulator: recomputation folded into the backward where the
        schedule has no RECOMPUTE actions (interleaved, waves)."""
        from autopar.runtime.costs import Costs

        c = ev.candidate
        tb, tr = list(ev.tb), list(ev.tr)
        if c.schedule in ("interleaved", "wave"):
            tb = [b + x * r for b, x, r in zip(tb, ev.recompute_fraction, tr)]
            tr = [0.0] * len(tr)
        return Costs.uniform(len(ev.tf), tf=list(ev.tf), tb=tb, tr=tr, tc=list(ev.tc) if ev.tc else 0.0)

    def finish_times(self, ev: Evaluation, M: int) -> tuple[list[float], list[float]]:
        """(per-rank time of the last compute action, per-rank busy time) for M microbatches."""
        from autopar.runtime.actions import COMPUTE_KINDS
        from autopar.runtime.simulator import simulate

        c = ev.candidate
        opts = tuple(sorted(c.schedule_options().items()))
        costs = self.costs(ev)
        key = (c.schedule, c.pp, M, opts, costs)
        if key not in self.results:
            sched = self.schedule(c.schedule, c.pp, M, opts)
            res = simulate(sched, costs)
            self.simulations += 1
            finish = [
                max((float(e.end) for e in evs if e.action.kind in COMPUTE_KINDS), default=0.0) for evs in res.timeline
            ]
            self.results[key] = (finish, [float(b) for b in res.busy])
        return self.results[key]

    def score(self, ev: Evaluation) -> Evaluation:
        """Set ``ev.step_time`` (simulated, or closed form without a pipeline) and ``ev.bubble``."""
        c = ev.candidate
        m = c.microbatches
        if c.pp == 1:
            busy = m * (ev.tf[0] + ev.tb[0] + ev.recompute_fraction[0] * ev.tr[0])
            ev.step_time, ev.bubble, ev.simulated = busy + ev.reduce[0], 0.0, "closed form"
            return ev
        P = c.pp
        if ev.candidate.num_stages * m <= self.full_limit or m < 3 * P:
            finish, busy = self.finish_times(ev, m)
            ev.simulated = "exact"
        else:
            m1 = 2 * P + m % P
            f1, b1 = self.finish_times(ev, m1)
            f2, b2 = self.finish_times(ev, m1 + P)
            k = (m - m1) / P
            finish = [a + k * (b - a) for a, b in zip(f1, f2)]
            busy = [a + k * (b - a) for a, b in zip(b1, b2)]
            ev.simulated = "extrapolated"
        step = max(f + r for f, r in zip(finish, ev.reduce))
        ev.step_time = max(step, ev.lower_bound)
        top = max(busy)
        ev.bubble = (max(finish) - top) / top if top else 0.0
        return ev


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class SearchResult:
    """The K best plans of a search, its counters, and what is needed to materialize the best."""

    best: list[Evaluation]
    stats: dict[str, Any]
    analytic: Analytic
    cluster: ClusterSpec
    global_batch: int
    budget_bytes: float
    space: SearchSpace
    spec: str | None = None
    precision: str = "bf16"
    scorer: Scorer | None = field(default=None, repr=False)

    def mfu(self, ev: Evaluation) -> float:
        """Model FLOPs utilization: 3 x forward matmul FLOPs (Eq. 3 without the recomputation pass)
        per step over (step time x devices x peak)."""
        return self.analytic.model_flops() / (ev.step_time * self.cluster.world_size * self._peak())

    def tflops_eq3(self, ev: Evaluation) -> float:
        """Per-GPU TFLOP/s as Megatron reports them: Eq. 3 (with the recomputation pass) over step time."""
        return self.analytic.eq3_flops() / (ev.step_time * self.cluster.world_size) / 1e12

    def _peak(self) -> float:
        return self.cluster.peak("fp32" if self.precision == "fp32" else self.precision)

    def summary(self, ev: Evaluation) -> dict[str, Any]:
        c = ev.candidate
        return {
            "configuration": c.describe(),
            "candidate": c.to_dict(),
            "mesh": c.mesh(),
            "step_seconds": ev.step_time,
            "mfu": self.mfu(ev),
            "tflops_per_gpu_eq3": self.tflops_eq3(ev),
            "peak_memory_bytes": ev.memory,
            "memory_per_rank_bytes": list(ev.rank_memory),
            "bubble": ev.bubble,
            "lower_bound_seconds": ev.lower_bound,
            "simulated": ev.simulated,
        }

    def format(self, top: int | None = None) -> str:
        s = self.stats
        cl = self.cluster
        head = (
            f"{self.spec or 'model'} on {cl.name} x {cl.world_size} ({cl.nodes} nodes x {cl.devices_per_node}), "
            f"global batch {self.global_batch}, budget {self.budget_bytes / GiB:.1f} GiB/device, "
            f"{self.precision} + Adam"
        )
        counts = (
            f"searched {s['space']:,} candidates ({s['families']:,} mesh x micro-batch families) in "
            f"{s['search_seconds']:.1f} s (profile {s['profile_seconds']:.1f} s): {s['over_budget']:,} over the "
            f"memory budget, {s['dominated']:,} dominated, {s['unsupported']:,} unsupported, "
            f"{s['pruned_by_bound']:,} pruned by the step-time lower bound "
            f"({s['families_pruned_by_bound']:,} whole families), {s['priced']:,} priced, "
            f"{s['scored']:,} scored ({s['simulations']:,} pipeline simulations, "
            f"{s['schedules_built']:,} schedules built)"
        )
        rows = [head, counts, "", f"{'#':>2} {'step s':>9} {'MFU':>6} {'TFLOP/s':>8} {'mem GiB':>8}  configuration"]
        for i, ev in enumerate(self.best[: top or len(self.best)], 1):
            rows.append(
                f"{i:>2} {ev.step_time:>9.4g} {self.mfu(ev):>6.1%} {self.tflops_eq3(ev):>8.1f} "
                f"{ev.memory / GiB:>8.2f}  {ev.candidate.describe()}"
                + (" (extrapolated)" if ev.simulated == "extrapolated" else "")
            )
        rows.append(
            "(MFU: 3 x forward matmul FLOPs per step / (step x devices x peak); TFLOP/s per GPU as Megatron "
            "counts it, Eq. 3 with the recomputation pass; mem: the busiest rank)"
        )
        return "\n".join(rows)

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "model": self.spec,
            "cluster": self.cluster.name,
            "devices": self.cluster.world_size,
            "global_batch": self.global_batch,
            "budget_bytes": self.budget_bytes,
            "precision": self.precision,
            "stats": dict(self.stats),
            "best": [self.summary(ev) for ev in self.best[: top or len(self.best)]],
        }

    def simulate(self, rank: int = 0):
        """The simulated step (``SimResult``) of the ``rank``-th best plan at its own microbatch count,
        for ``autopar.runtime.chart.draw_gantt``; the plan needs a pipeline (pp > 1)."""
        from autopar.runtime.simulator import simulate

        ev = self.best[rank]
        c = ev.candidate
        if c.pp == 1:
            raise ValueError(f"{c.describe()} has no pipeline to simulate")
        scorer = self.scorer or Scorer()
        sched = scorer.schedule(c.schedule, c.pp, c.microbatches, tuple(sorted(c.schedule_options().items())))
        return simulate(sched, scorer.costs(ev))

    def materialize(self, rank: int = 0, **kw: Any):
        """The Plan of the ``rank``-th best candidate (see ``build_plan``)."""
        if self.spec is None:
            raise ValueError("materialize needs the model spec; use search_model")
        return build_plan(self, self.best[rank], **kw)


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
) -> SearchResult:
    """Find the ``top`` fastest candidates that fit ``budget_bytes`` per device (default: device memory).

    Branch and bound on two levels. A family (mesh, micro-batch) has a step-time lower bound; a
    priced candidate its own, larger one. With ``order="bound"`` families are expanded (priced) by
    increasing bound and priced candidates are scored best first, each only once nothing cheaper is
    left; "shuffle" visits families and their candidates in a random order drawn from ``seed``,
    "given" in enumeration order. A family or candidate whose bound exceeds the K-th best step time
    found so far is skipped. The answer does not depend on the order. Equal step times are broken by
    memory, then by the candidate's fields. Raises ``InfeasibleError`` (with
    ``smallest_budget_bytes``) when nothing fits.
    """
    t0 = time.perf_counter()
    space = dataclasses.replace(space or SearchSpace(), devices_per_node=cluster.devices_per_node)
    budget = float(budget_bytes if budget_bytes is not None else cluster.device_memory)
    an = Analytic(profile, cluster, global_batch, precision=precision)
    keys = ("space", "families", "families_over_budget", "families_pruned_by_bound", "priced", "over_budget",
            "dominated", "unsupported", "pruned_by_bound", "scored")  # fmt: skip
    stats: dict[str, Any] = dict.fromkeys(keys, 0)
    fams = families(an, space, cluster.world_size)
    stats["families"] = len(fams)
    bounds = {f: an.family_bounds(f.pp, f.dp, f.tp, f.micro_batch, f.microbatches, max_shard(space, f)) for f in fams}
    rng = random.Random(seed)
    if order == "bound":
        fams.sort(key=lambda f: (bounds[f][0], f))
    elif order == "shuffle":
        rng.shuffle(fams)
    elif order != "given":
        raise ValueError(f"order must be bound, shuffle or given, not {order!r}")
    scorer = scorer or Scorer()
    heap: list[tuple] = []  # the K best so far as (-step, -memory, inverted candidate order, evaluation)
    from tqdm import tqdm

    best_first = order == "bound"
    queue: list[tuple] = []  # priced, unscored candidates: (lower bound, candidate, evaluation)

    def kth() -> float:
        return -heap[0][0] if len(heap) >= top else math.inf

    def consider(ev: Evaluation) -> None:
        if ev.lower_bound > kth() * (1 + _BOUND_SLACK):
            stats["pruned_by_bound"] += 1
            return
        scorer.score(ev)
        stats["scored"] += 1
        item = (-ev.step_time, -ev.memory, _Inverted(ev.candidate), ev)
        if len(heap) < top:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)

    def drain(limit: float) -> None:
        """Score queued candidates with a lower bound up to ``limit``, best first."""
        while queue and queue[0][0] <= limit:
            consider(heapq.heappop(queue)[2])

    bar = tqdm(total=len(fams), desc="search", unit="family", file=sys.stderr, disable=not progress, leave=False)
    for i, f in enumerate(fams):
        if best_first:
            drain(bounds[f][0])  # everything queued that could beat this family goes first
        if bounds[f][0] > kth() * (1 + _BOUND_SLACK):
            rest = fams[i:] if best_first else [f]  # families come by increasing bound: all later ones too
            stats["families_pruned_by_bound"] += len(rest)
            stats["pruned_by_bound"] += sum(ch.size for g in rest for ch in chains(an, space, g))
            stats["space"] += sum(ch.size for g in rest for ch in chains(an, space, g))
            bar.update(len(rest))
            if best_first:
                break
            continue
        bar.update(1)
        family_chains = list(chains(an, space, f))
        size = sum(ch.size for ch in family_chains)
        stats["space"] += size
        if bounds[f][1] > budget:  # the model states alone do not fit
            stats["families_over_budget"] += 1
            stats["over_budget"] += size
            continue
        found: list[Evaluation] = []
        for ch in family_chains:
            stats["dominated"] += ch.dominated
            stats["unsupported"] += ch.unsupported
            found += _staircase(an, ch, budget, stats)
        if best_first:
            for ev in found:
                heapq.heappush(queue, (ev.lower_bound, ev.candidate, ev))
        else:
            if order == "shuffle":
                rng.shuffle(found)
            for ev in found:
                consider(ev)
        bar.set_postfix(scored=stats["scored"], refresh=False)
    drain(math.inf)
    bar.close()
    if not heap:
        _no_fit(an, space, fams, cluster, global_batch, budget, stats)
    best = sorted((e for *_, e in heap), key=lambda e: e.sort_key)
    stats["simulations"] = scorer.simulations
    stats["schedules_built"] = len(scorer.schedules)
    stats["search_seconds"] = time.perf_counter() - t0
    stats.setdefault("profile_seconds", 0.0)
    return SearchResult(best, stats, an, cluster, global_batch, budget, space, spec, precision, scorer)


def _staircase(an: Analytic, ch: Chain, budget: float, stats: dict[str, Any]) -> list[Evaluation]:
    """The non-dominated candidates of a chain that fit: for each ZeRO stage (ascending) the least
    recomputation that fits, kept only if it recomputes strictly less than every lower stage's.
    Memory is non-increasing along the levels, so the first fitting level is found by bisection."""
    out: list[Evaluation] = []
    limit = len(ch.levels)  # levels at or beyond this are dominated by a lower ZeRO stage
    for z in ch.zeros:
        lo, hi, fit, first = 0, limit, None, limit  # the first fitting level lies in [lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            ev = an.evaluate(ch.candidate(z, mid))
            stats["priced"] += 1
            if ev is not None and ev.memory <= budget:
                fit, first, hi = ev, mid, mid
            else:
                lo = mid + 1
        stats["over_budget"] += first  # below the first fitting level: over budget (memory is monotone)
        stats["dominated"] += len(ch.levels) - first - (fit is not None)
        if fit is not None:
            out.append(fit)
            limit = first
    return out


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
    """The least per-device memory of any candidate: each chain at its strongest ZeRO stage and most
    recomputation (memory is monotone along both)."""
    best = math.inf
    for f in fams:
        for ch in chains(an, space, f):
            ev = an.evaluate(ch.candidate(ch.zeros[-1], len(ch.levels) - 1))
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


# ---------------------------------------------------------------------------------------------
# From the chosen candidate to a Plan: capture, stages, the intra-op ILP per distinct stage


def build_plan(
    result: SearchResult, ev: Evaluation, time_limit: float = 60.0, backend: str = "cbc", capture_device: str = "meta"
):
    """Capture the model at the chosen micro-batch and return its Plan (see the module docstring).

    ``capture_device="meta"`` allocates no weights. A plan is checked against the graph the training
    run captures, and a few kernels lay out their outputs differently on the meta device than on a real
    one (GPT-2's attention output gains an ``aten.contiguous`` on meta): a run that captures a model with
    real weights on the CPU needs a plan captured with ``capture_device="cpu"``; the pipeline runtime,
    which builds a model on the meta device and initializes it shard by shard, matches a meta plan."""
    from autopar.models import build
    from autopar.passes.capture import capture
    from autopar.passes.collectives import insert_collectives
    from autopar.passes.ir import MeshSpec
    from autopar.passes.lower import lower
    from autopar.passes.printer import print_program
    from autopar.passes.shard import ShardOptions
    from autopar.passes.verify import verify
    from autopar.plan import Plan, fingerprint
    from autopar.planner import options_dict
    from autopar.solver.cost import TrainingSetup

    c = ev.candidate
    spec = with_batch(result.spec, c.micro_batch * c.dp)
    t0 = time.perf_counter()
    m = build(spec, device=capture_device, seed=0 if capture_device != "meta" else None)
    captured = capture(m.model, m.args, m.kwargs)
    capture_seconds = time.perf_counter() - t0
    inner = MeshSpec(tuple(c.inner_mesh().items()))
    prog = lower(captured, inner)
    zero_axes = tuple(a for a in ("dpr", "dp") if a in inner.names)
    setup = TrainingSetup(precision=result.precision, zero=c.zero, zero_axes=zero_axes, mics_group=c.mics_group or None)
    opts = ShardOptions(
        objective="comm",
        constrain=data_parallel_axes(prog),
        budget_bytes=result.budget_bytes,
        time_limit=time_limit,
        backend=backend,
        setup=setup,
        cluster=result.cluster,
    )
    pipeline_info = None
    if c.pp > 1:
        from autopar.solver.stages import plan_pipeline

        prog, stage_plan, split_seconds = plan_pipeline(
            prog, c.pp, chunks=c.chunks if c.schedule == "interleaved" else 1,
            waves=c.waves if c.schedule == "wave" else None, cluster=result.cluster, budget_bytes=math.inf,
            microbatches=c.microbatches, precision="fp32" if result.precision == "fp32" else "bf16",
        )  # fmt: skip
        sp = stage_plan.to_dict()
        sp["budget_bytes"] = None  # stages balanced for time only; memory is the search's model (stats.predicted)
        pipeline_info = {
            "split_seconds": split_seconds,
            "stage_plan": sp,
            "table": stage_plan.format(),
        }
        ranges = _stage_op_ranges(prog, stage_plan)
    else:
        ranges = [(0, len(prog.ops))]
    if inner.size == 1:  # one device per pipeline stage: nothing to place, every value stays whole
        merged = prog
        stage_stats = [
            {"stage": k, "ops": b - a, "signature": "", "solved": False, "how": "one device", "status": "none",
             "solve_seconds": 0.0, "memory_per_device_bytes": 0.0, "comm_seconds": 0.0, "layers_solved_once": 0}
            for k, (a, b) in enumerate(ranges)
        ]  # fmt: skip
    else:
        merged, stage_stats = _solve_stages(prog, ranges, opts)
    final = insert_collectives(merged)
    verify(final)
    summary = result.summary(ev)
    pipeline = {
        "pp": c.pp,
        "mesh": c.mesh(),
        "schedule": c.schedule if c.pp > 1 else None,
        "schedule_options": {k: (str(v) if not isinstance(v, int) else v) for k, v in c.schedule_options().items()},
        "chunks": c.chunks,
        "waves": c.waves or None,
        "microbatches": c.microbatches,
        "micro_batch": c.micro_batch,
        "global_batch": result.global_batch,
        "recompute": c.recompute,
        "alpha1": float(c.alpha),
        "recompute_fraction_per_stage": list(ev.recompute_fraction),
        **(pipeline_info or {}),
    }
    stats = {
        "search": {k: v for k, v in result.stats.items()},
        "predicted": summary,
        "stage_ilp": stage_stats,
        "capture_seconds": capture_seconds,
        "ops": len(prog.ops),
        "memory_per_device_bytes": ev.memory,
        "step_seconds": ev.step_time,
    }
    return Plan(
        fingerprint=fingerprint(captured),
        mesh=c.inner_mesh(),  # what autopar.compile checks (the pipeline runtime checks the mesh without pp)
        program=print_program(final),
        model=spec,
        cluster=result.cluster.to_dict(),
        options=options_dict(opts),
        stats=stats,
        baselines={},
        pipeline=pipeline,
    )


def data_parallel_axes(prog, activations: bool = True) -> dict:
    """ILP constraints that keep the search's meaning of the ``dp*`` axes (data parallelism):
    parameters and buffers replicated on them (ZeRO shards their states, which is memory accounting,
    not placement); user inputs and, with ``activations``, every float activation that carries the
    batch (not derived from weights alone, not a common node, dim 0 a multiple of the dp size) split
    on dim 0. Without the activation constraints a model too small for its compute to matter would be
    computed redundantly on every dp rank (the cheapest plan in communication). The ILP decides
    everything on ``tp``."""
    from autopar.passes.ir import Replicate, Shard
    from autopar.passes.pipeline_split import common_nodes

    dp = tuple(i for i, n in enumerate(prog.mesh.names) if n.startswith("dp"))
    if not dp:
        return {}
    size = math.prod(prog.mesh.sizes[i] for i in dp)

    def replicated(p) -> bool:
        return all(isinstance(p[i], Replicate) for i in dp)

    def batch_split(p) -> bool:
        return all(isinstance(p[i], Shard) and p[i].dim == 0 for i in dp)

    out = {
        v.name: replicated if v.kind in ("param", "buffer") else batch_split
        for v in prog.inputs
        if v.kind in ("param", "buffer") or len(v.type.shape) >= 1
    }
    if not activations:
        return out
    weights = {v.name for v in prog.inputs if v.kind in ("param", "buffer")}
    commons = common_nodes(prog)
    for op in prog.ops:
        refs = [r.name for r in op.input_refs()]
        if refs and all(r in weights for r in refs):
            weights.update(op.results)
            continue
        for r, t in zip(op.results, op.types):
            if t.is_float and r not in commons and t.shape and t.shape[0] >= size and t.shape[0] % size == 0:
                out[r] = batch_split
    return out


def _stage_op_ranges(prog, stage_plan) -> list[tuple[int, int]]:
    """Op index range [start, stop) of each pipeline stage, from the ``stage`` annotations."""
    ranges: list[list[int]] = []
    for i, op in enumerate(prog.ops):
        s = op.attrs.get("stage", 0)
        while len(ranges) <= s:
            ranges.append([i, i])
        ranges[s][1] = i + 1
    return [(a, b) for a, b in ranges]


def _canonical(sub) -> str:
    """A stage's op signature: targets, types and arguments with value names replaced by their order
    of definition. Two stages with equal signatures get the same ILP (solved once)."""
    from autopar.passes.ir import map_refs

    index: dict[str, int] = {}
    lines = []
    for v in sub.inputs:
        index[v.name] = len(index)
        lines.append(f"{v.kind} {v.type}")
    for op in sub.ops:
        args = map_refs((op.args, op.kwargs), lambda r: f"%{index[r.name]}")
        lines.append(f"{op.target} {op.types} {args!r}")
        for r in op.results:
            index[r] = len(index)
    lines.append("outputs " + " ".join(str(index.get(getattr(r, "name", ""), r)) for r in sub.outputs))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _solve_stages(prog, ranges: list[tuple[int, int]], opts) -> tuple[Any, list[dict[str, Any]]]:
    """Solve the intra-op ILP once per distinct stage and write every stage's placements into ``prog``.

    A stage is ``prog.ops[a:b]`` with the tensors it receives as inputs. Stages with the same
    signature share the solve (their ops and inputs correspond by position). Where a stage reads a
    value made elsewhere (a received boundary tensor, a parameter another stage stores first), the
    placement its ILP assumed becomes an explicit requirement, so ``insert-collectives`` reshards.
    """
    from autopar.passes.ir import Program, Ref, Value
    from autopar.passes.shard import format_placements

    types = prog.types()
    produced_in = {}
    for k, (a, b) in enumerate(ranges):
        for op in prog.ops[a:b]:
            for r in op.results:
                produced_in[r] = k
    cache: dict[str, Any] = {}
    placement: dict[str, tuple] = {}  # graph input -> placements (the first stage reading it decides)
    new_ops = list(prog.ops)
    stats = []
    for k, (a, b) in enumerate(ranges):
        ops = prog.ops[a:b]
        defined = {r for op in ops for r in op.results}
        reads: dict[str, None] = {}
        for op in ops:
            for r in op.input_refs():
                if r.name not in defined:
                    reads[r.name] = None
        graph = {v.name: v for v in prog.inputs}
        received = [Value(n, "input", types[n]) for n in reads if n not in graph]
        own = [graph[n] for n in reads if n in graph]
        later = {r.name for op in prog.ops[b:] for r in op.input_refs()}
        later |= {r.name for r in prog.outputs if isinstance(r, Ref)}
        outputs = tuple(Ref(r) for op in ops for r in op.results if r in later) or (Ref(ops[-1].result),)
        sub = Program(prog.mesh, (*received, *own), tuple(ops), outputs, dict(prog.attrs))
        sig = _canonical(sub)
        t0 = time.perf_counter()
        hit = sig in cache
        if not hit:
            cache[sig] = (sub, _shard_or_fallback(sub, opts))
        rep_sub, (res, how) = cache[sig]
        solved = res.program
        # the representative's inputs and ops correspond to this stage's by position
        chosen = {}
        for v, w in zip(sub.inputs, solved.inputs):
            chosen[v.name] = w.type.placements
            if v.name in graph and v.name not in placement:
                placement[v.name] = w.type.placements
        for i, (op, sop) in enumerate(zip(ops, solved.ops)):
            req = list(sop.attrs.get("in", []))
            for j, r in enumerate(op.input_refs()):
                if j < len(req) and req[j] == "*" and r.name not in defined:
                    req[j] = format_placements(chosen[r.name])
            tys = tuple(t.with_placements(s.placements) for t, s in zip(op.types, sop.types))
            new_ops[a + i] = op.with_(types=tys, attrs=dict(op.attrs, **{"in": req}))
        stats.append(
            {
                "stage": k,
                "ops": b - a,
                "signature": sig[:12],
                "solved": not hit,
                "how": how,
                "status": res.solution.status,
                "solve_seconds": time.perf_counter() - t0,
                "memory_per_device_bytes": res.memory_bytes,
                "comm_seconds": res.comm_seconds,
                "layers_solved_once": res.solution.layers,
            }
        )
    inputs = tuple(
        dataclasses.replace(v, type=v.type.with_placements(placement[v.name])) if v.name in placement else v
        for v in prog.inputs
    )
    return prog.with_(inputs=inputs, ops=tuple(new_ops)), stats


def _shard_or_fallback(sub, opts):
    """The ILP with the step-time objective within the budget; if the ILP's own memory model (every
    activation of one microbatch saved, no recomputation) finds nothing within it, the least-memory
    strategy instead; if constraining the activations to data parallelism leaves no strategy, the
    parameters and inputs only (each reported as such)."""
    from autopar.passes.shard import shard

    try:
        return shard(sub, opts), "comm within budget"
    except InfeasibleError:
        pass
    try:
        return shard(sub, dataclasses.replace(opts, objective="memory", budget_bytes=None)), "least memory"
    except InfeasibleError:  # the activation constraints left an op without a strategy: parameters only
        loose = data_parallel_axes(sub, activations=False)
        return shard(sub, dataclasses.replace(opts, constrain=loose)), "parameters constrained only"


# ---------------------------------------------------------------------------------------------
# Using a plan, and the command line


def launch_options(plan) -> tuple[dict[str, int], dict[str, Any]]:
    """(mesh axes for ``autopar.init_mesh``, keyword arguments for ``autopar.compile``) of a searched plan.

        axes, kwargs = launch_options(Plan.load("plan.json"))
        mesh = autopar.init_mesh(**axes)
        model = autopar.compile(model, mesh, kwargs=microbatch, plan="plan.json", **kwargs)

    A pipeline plan adds the schedule, its options, the microbatch count and the training setup (ZeRO,
    MiCS) the pipeline runtime needs; ``microbatch`` is then the whole batch of one step on a pipeline
    (``global_batch / dp`` samples per replica, the runtime cuts it). Without a pipeline it is one
    microbatch (``micro_batch * dp`` samples); with ``microbatches > 1`` accumulate gradients over them.
    """
    from fractions import Fraction

    from autopar.planner import options_from_dict

    p = plan.pipeline or {}
    axes = dict(p.get("mesh") or plan.mesh)
    if p.get("pp", 1) <= 1:
        return axes, {}
    opts = {k: Fraction(v) if isinstance(v, str) else v for k, v in (p.get("schedule_options") or {}).items()}
    return axes, {
        "microbatches": p["microbatches"],
        "schedule": p["schedule"],
        "schedule_options": opts,
        "options": options_from_dict(plan.options),
    }


def run_cli(args) -> int:
    """``autopar plan MODEL --cluster SPEC --global-batch B [--budget-gb G] [--top K] [-o plan.json] [--json]``."""
    from autopar.errors import AutoparError

    if not args.model:
        raise AutoparError("give MODEL, e.g. autopar plan gpt2-xl --cluster dgx-a100 --global-batch 64")
    if args.global_batch < 1 or args.top < 1:
        raise AutoparError("--global-batch and --top must be positive")
    cluster = ClusterSpec.load(args.cluster)
    precision = args.precision or ("bf16" if cluster.backend == "nccl" else "fp32")
    space = SearchSpace() if args.zero is None else SearchSpace(zero=(args.zero,), mics=args.mics_group is not None)
    budget = args.budget_gb * GiB if args.budget_gb is not None else None
    result = search_model(
        args.model, cluster, args.global_batch, budget, space, top=args.top, precision=precision, progress=True
    )
    plan = None
    if args.output:
        plan = result.materialize(time_limit=args.time_limit, backend=args.solver)
        plan.save(args.output)
    if args.json:
        out = result.to_dict(args.top)
        if plan is not None:
            out["plan_file"] = args.output
            out["stage_ilp"] = plan.stats["stage_ilp"]
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(result.format(args.top))
    if plan is not None:
        ilp = plan.stats["stage_ilp"]
        solved = sum(s["solved"] for s in ilp)
        print(
            f"\nplan written to {args.output}: mesh {plan.pipeline['mesh']}, intra-op ILP solved for {solved} "
            f"distinct stage(s) of {len(ilp)} ({', '.join(sorted({s['how'] for s in ilp}))})"
        )
    else:
        print("\n(add -o plan.json to write the best plan: the intra-op ILP then runs once per distinct stage)")
    return 0


__all__ = [
    "FULL_SIMULATION",
    "Scorer",
    "SearchResult",
    "build_plan",
    "launch_options",
    "profile_model",
    "run_cli",
    "search",
    "search_model",
]
