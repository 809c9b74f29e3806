"""List scheduling of a pipeline's F/B task graph: compute orders for schedules found by search.

Some schedules are easier to search for than to write down in closed form; Hanayo's waves are one.
``list_schedule`` plays the task graph (``F(mb, s)`` after ``F(mb, s-1)``, ``B(mb, S-1)`` after
``F(mb, S-1)``, ``B(mb, s)`` after ``B(mb, s+1)``) forward in time with nominal costs, and whenever a
rank is idle it starts the ready task its ``Priority`` ranks first. It never idles a rank that has
a ready task (a non-delay schedule). The result is only an *order* per rank: the simulator replays
it under any costs.

Memory is bounded by ``max_inflight``: a microbatch may enter stage 0 only while fewer than
``max_inflight`` microbatches have entered and not yet finished ``B(mb, 0)``. A rank then stashes at
most ``max_inflight`` activations for each stage it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from autopar.errors import ScheduleError
from autopar.schedule.actions import Action, B, F

Task = tuple[str, int, int]  # ("F" | "B", microbatch, stage)


@dataclass(frozen=True)
class Priority:
    """Which ready task an idle rank starts.

    ``backward_first``: prefer any ready backward over any ready forward (frees memory early);
    otherwise prefer forwards. Within a kind, ``depth_first`` picks the lowest microbatch and then
    the deepest stage (push the oldest microbatch through); otherwise the deepest stage first, then
    the lowest microbatch (for backwards: sweep stage by stage).
    """

    backward_first: bool = True
    depth_first_backward: bool = True

    def key(self, task: Task) -> tuple[int, int, int]:
        kind, mb, stage = task
        rank_kind = (kind == "F") if self.backward_first else (kind == "B")
        if kind == "F" or self.depth_first_backward:
            return (rank_kind, mb, -stage)
        return (rank_kind, -stage, mb)


@dataclass(frozen=True)
class ListSchedule:
    """Per-rank compute orders and what they cost under the nominal costs they were made with."""

    compute: list[list[Action]]
    makespan: Fraction
    peak_inflight: int


def list_schedule(
    stage_to_rank: Sequence[int],
    num_microbatches: int,
    priority: Priority,
    max_inflight: int,
    tf: Fraction = Fraction(1),
    tb: Fraction = Fraction(2),
) -> ListSchedule:
    """Non-delay list schedule of all F/B tasks; ``tf``/``tb`` are the nominal per-stage costs."""
    S, P, M = len(stage_to_rank), max(stage_to_rank) + 1, num_microbatches
    ready: list[dict[Task, Fraction]] = [{} for _ in range(P)]  # rank -> task -> time its input is there
    ready[stage_to_rank[0]].update({("F", m, 0): Fraction(0) for m in range(M)})
    free = [Fraction(0)] * P
    compute: list[list[Action]] = [[] for _ in range(P)]
    entered = finished = peak = 0
    now, remaining = Fraction(0), 2 * S * M
    while remaining:
        for r in range(P):
            if free[r] > now:
                continue
            candidates = [
                t
                for t, at in ready[r].items()
                if at <= now and not (t[0] == "F" and t[2] == 0 and entered - finished >= max_inflight)
            ]
            if not candidates:
                continue
            kind, mb, s = task = min(candidates, key=priority.key)
            del ready[r][task]
            end = now + (tf if kind == "F" else tb)
            free[r], remaining = end, remaining - 1
            if kind == "F":
                compute[r].append(F(mb, s))
                entered += s == 0
                peak = max(peak, entered - finished)
                nxt: Task = ("F", mb, s + 1) if s + 1 < S else ("B", mb, s)
            else:
                compute[r].append(B(mb, s))
                finished += s == 0
                nxt = ("B", mb, s - 1)
            if nxt[2] >= 0 and not (kind == "B" and s == 0):
                ready[stage_to_rank[nxt[2]]][nxt] = end
        later = [t for t in free if t > now] + [at for d in ready for at in d.values() if at > now]
        if remaining and not later:
            raise ScheduleError(f"list scheduling stuck at time {now} with {remaining} tasks left")
        now = min(later, default=now)
    return ListSchedule(compute, max(free), peak)
