"""Score priced candidates by simulation: the schedule's action lists run with the candidate's per-stage costs.

Each rank then synchronizes its data-parallel gradients (``Evaluation.reduce``) and steps its optimizer
(``Evaluation.optimizer``). Without a pipeline the
step has a closed form. Large schedules (more than ``FULL_SIMULATION`` forward actions) are simulated at
smaller microbatch counts congruent to m modulo pp, P apart, until three consecutive increments agree,
and extended linearly from there (marked "extrapolated"); a schedule whose increments do not settle
is simulated at m. Schedules are built once per shape and kept as text beside the plan cache
(``$AUTOPAR_CACHE_DIR/../schedules``), and timed by their compiled replay (``schedule/replay.py``: what
``simulate`` gives, without its checks, every registered schedule being sound); results are cached by per-stage
costs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from autopar.passes.split_cache import cache_dir, write_atomic
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import Schedule
from autopar.schedule.generators import make_replay, make_schedule
from autopar.schedule.replay import Replay
from autopar.search.evaluation import Evaluation

FULL_SIMULATION = 2048  # simulate exactly up to this many forward actions (stages x microbatches)
STEADY = 3  # consecutive equal increments of P microbatches that make a steady state (waves alternate two)
STEADY_TRIES = 4  # further increments tried for one before simulating m itself


class Scorer:
    """Simulates candidates; caches schedules by shape and results by per-stage costs."""

    def __init__(self, full_limit: int = FULL_SIMULATION, recompute_at: str = "early"):
        """``recompute_at``: when a schedule's recomputation runs. "early" (autopar's runtime, Merak's Fig. 3b): a
        ``RECOMPUTE`` runs as soon as the rank is free before its backward, without waiting for the output
        gradient, so it can fill the pipeline's bubbles; "backward" (``torch.utils.checkpoint``, as Megatron-LM and
        DeepSpeed run it): inside the backward, once the gradient has arrived, so it is on the critical path."""
        if recompute_at not in ("early", "backward"):
            raise ValueError(f"recompute_at is 'early' or 'backward', not {recompute_at!r}")
        self.full_limit = full_limit
        self.recompute_at = recompute_at
        self.schedules: dict[tuple, Any] = {}
        self.replays: dict[tuple, Replay] = {}  # the schedules the search timed, compiled (their Schedule dropped)
        self.results: dict[tuple, tuple[list[float], list[float]]] = {}
        self.simulations = 0

    def schedule(self, name: str, P: int, M: int, opts: tuple):
        """The schedule's action lists: built once per shape, kept as text in the schedule cache."""
        key = (name, P, M, opts)
        if key not in self.schedules:
            self.schedules[key] = self._load(key)
        return self.schedules[key]

    def replay(self, name: str, P: int, M: int, opts: tuple) -> Replay:
        """The schedule compiled for timing (``schedule/replay.py``), once per shape, kept as text in the schedule
        cache (read back in a fraction of the time the action lists take). Compiled from the lists with each receive
        before its consumer (``make_schedule(post_ahead=False)``: the same program, not timed once to place them);
        the schedule's own lists are built only when asked for (``schedule``)."""
        key = (name, P, M, opts)
        if key not in self.replays:
            built = self.schedules.get(key)
            self.replays[key] = _kept(
                key, "replay", Replay.from_text,
                lambda: Replay(built) if built else make_replay(name, P, M, **dict(opts)),
            )  # fmt: skip
        return self.replays[key]

    def _load(self, key: tuple) -> Schedule:
        """The schedule read from the schedule cache, or built and written there."""
        name, P, M, opts = key
        return _kept(key, "txt", Schedule.from_text, lambda: make_schedule(name, P, M, **dict(opts)))

    def costs(self, ev: Evaluation):
        """Per-stage costs for the simulator: recomputation folded into the backward where the
        schedule has no RECOMPUTE actions (interleaved, waves) or where it runs inside the backward
        (``recompute_at="backward"``)."""
        c = ev.candidate
        tb, tr = list(ev.tb), list(ev.tr)
        if c.schedule in ("interleaved", "wave") or self.recompute_at == "backward":
            tb = [b + x * r for b, x, r in zip(tb, ev.recompute_fraction, tr)]
            tr = [0.0] * len(tr)
        tw = [min(w, b) for w, b in zip(ev.tw, tb)] if ev.tw else None  # what a zero-bubble W costs
        return Costs.uniform(len(ev.tf), tf=list(ev.tf), tb=tb, tr=tr, tc=list(ev.tc) if ev.tc else 0.0, tw=tw)

    def finish_times(self, ev: Evaluation, M: int) -> tuple[list[float], list[float]]:
        """(per-rank time of the last compute action, per-rank busy time) for M microbatches."""
        c = ev.candidate
        opts = tuple(sorted(c.schedule_options().items()))
        costs = self.costs(ev)
        key = (c.schedule, c.pp, M, opts, costs)
        if key not in self.results:
            finish, busy = self.replay(c.schedule, c.pp, M, opts).run(costs)
            self.simulations += 1
            self.results[key] = (finish, [float(b) for b in busy])
        return self.results[key]

    def score(self, ev: Evaluation) -> Evaluation:
        """Set ``ev.step_time`` (simulated, or closed form without a pipeline) and ``ev.bubble``."""
        c = ev.candidate
        if c.pp == 1:
            busy = c.microbatches * (ev.tf[0] + ev.tb[0] + ev.recompute_fraction[0] * ev.tr[0])
            ev.step_time, ev.bubble, ev.simulated = busy + ev.tail(0), 0.0, "closed form"
            return ev
        finish, busy, ev.simulated = self.finish_busy(ev)
        step = max(f + ev.tail(r) for r, f in enumerate(finish))
        ev.step_time = max(step, ev.lower_bound)
        top = max(busy)
        ev.bubble = (max(finish) - top) / top if top else 0.0
        return ev

    def finish_busy(self, ev: Evaluation) -> tuple[list[float], list[float], str]:
        """(per-rank end of the last compute action, per-rank busy seconds, "exact" or "extrapolated") of a
        pipelined candidate at its own microbatch count."""
        c = ev.candidate
        m, P = c.microbatches, c.pp
        line = None
        if c.num_stages * m > self.full_limit and m >= 3 * P:
            line = self.steady_line(ev, m)
        if line is None:
            finish, busy = self.finish_times(ev, m)
            return finish, busy, "exact"
        return line[0], line[1], "extrapolated"

    def steady_line(self, ev: Evaluation, m: int) -> tuple[list[float], list[float]] | None:
        """(finish, busy) at ``m`` microbatches extended along the schedule's steady state, or None.

        Simulated at ``m0 = 2P + m mod P`` and the counts ``P`` apart after it: once ``STEADY``
        consecutive increments agree on every rank (each further P microbatches then add the same time)
        the line through them is exact at ``m``. Warm-ups differ: 1F1B and interleaving settle by ``2P``,
        ZB-V and SCP an increment later, and waves alternate two increments (so two equal ones in a row
        prove nothing); without agreement within ``STEADY_TRIES`` further increments (or before ``m``)
        the caller simulates ``m`` itself."""
        P = ev.candidate.pp
        m0 = 2 * P + m % P
        points = [self.finish_times(ev, m0 + i * P) for i in range(STEADY)]
        for _ in range(STEADY_TRIES):
            last = m0 + len(points) * P
            if last >= m:
                return None
            points.append(self.finish_times(ev, last))
            window = points[-STEADY - 1 :]
            if all(_same(*(p[i] for p in window)) for i in (0, 1)):
                (f2, b2), (f3, b3), k = window[-2], window[-1], (m - last) / P
                return [z + k * (z - y) for y, z in zip(f2, f3)], [z + k * (z - y) for y, z in zip(b2, b3)]
        return None


def _kept(key: tuple, kind: str, parse, build):
    """``key``'s schedule ("txt") or replay ("replay") read from the schedule cache (``parse`` of its text), or
    ``build()`` and written there (its ``to_text()``); a damaged entry is built again."""
    d = cache_dir("schedules")
    name, P, M, _ = key
    path = d / f"{name}-{P}-{M}-{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}.{kind}" if d else None
    if path is not None and path.exists():
        try:
            return parse(path.read_text())
        except Exception:  # a damaged entry: build again
            pass
    value = build()
    if path is not None:
        write_atomic(path, value.to_text())
    return value


def _same(*points: list[float]) -> bool:
    """Whether the increments between consecutive ``points`` agree on every rank (to rounding)."""
    for ranks in zip(*points):
        steps = [b - a for a, b in zip(ranks, ranks[1:])]
        if max(steps) - min(steps) > 1e-9 * max(max(map(abs, steps)), 1e-12):
            return False
    return True


__all__ = ["FULL_SIMULATION", "STEADY", "STEADY_TRIES", "Scorer"]
