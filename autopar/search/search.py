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
4. **Materialize** (``autopar/search_plan.py``): ``SearchResult.materialize`` captures the model at
   the chosen micro-batch, splits it into the chosen stages, solves the intra-op ILP once per
   distinct stage, merges the placements and inserts the collectives: a Plan file that
   ``autopar.compile(model, mesh, plan=...)`` loads.
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
from autopar.solver.search_cost import Analytic, Evaluation
from autopar.solver.search_space import (
    Candidate,
    Chain,
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
    from autopar.ir.core import MeshSpec
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
        from autopar.search_plan import build_plan

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
    ``"sub_pipeline_tp": true`` in the pipeline section (the search never writes it; the program must
    then have been planned for half a microbatch) adds ``sub_pipeline_tp=True``.
    """
    from fractions import Fraction

    from autopar.planner import options_from_dict

    p = plan.pipeline or {}
    axes = dict(plan.launch_mesh.axes)
    if p.get("pp", 1) <= 1:
        return axes, {}
    opts = {k: Fraction(v) if isinstance(v, str) else v for k, v in (p.get("schedule_options") or {}).items()}
    return axes, {
        "microbatches": p.get("microbatches") or 1,
        "schedule": p["schedule"],
        "schedule_options": opts,
        "options": options_from_dict(plan.options),
        **({"sub_pipeline_tp": True} if p.get("sub_pipeline_tp") else {}),
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
    "launch_options",
    "profile_model",
    "run_cli",
    "search",
    "search_model",
]
