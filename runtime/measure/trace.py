"""What a step recorded: the start and end of every action, put on one clock across ranks, and the
measured ``SimResult`` built from every rank's trace (the Gantt chart and bubble ratios of a measured step
compare directly with a simulated one)."""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from autopar.schedule.actions import COMPUTE_KINDS, Action, Kind, Schedule, ends_backward, split_backwards
from autopar.schedule.timeline import Event, SimResult, Transfer


@dataclass(frozen=True)
class TraceEvent:
    """One action as it ran: seconds since its rank began the step (``on_one_clock`` aligns the ranks)."""

    action: Action
    start: float
    end: float


def measured_result(schedule: Schedule, traces: Sequence[Sequence[TraceEvent]]) -> SimResult:
    """The simulator's result type built from measured traces (one list per pipeline rank).

    ``step_time`` is the end of the last compute action on any rank (the pipeline proper; gradient
    reduction and the optimizer step come after it and are not part of the bubble), ``busy`` the time
    each rank spent in F, B, W and RECOMPUTE, so ``bubble_ratio`` and ``idle_fraction`` mean what they
    mean for a simulation. Transfers pair the k-th send of a channel with its k-th receive and run
    from the later of the two posts to the end of the receive's wait.
    """
    ranks = range(schedule.num_ranks)
    timeline = [[Event(r, e.action, e.start, e.end) for e in traces[r]] for r in ranks]
    compute_ends = [e.end for r in ranks for e in traces[r] if e.action.kind in COMPUTE_KINDS]
    step = max(compute_ends, default=0.0)
    busy = [sum(e.end - e.start for e in traces[r] if e.action.kind in COMPUTE_KINDS) for r in ranks]
    sends: dict[tuple[int, int], list[TraceEvent]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[TraceEvent]] = defaultdict(list)
    s2r = schedule.stage_to_rank
    for r in ranks:
        for e in traces[r]:
            a = e.action
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                sends[(r, s2r[a.peer])].append(e)
            elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                recvs[(s2r[a.peer], r)].append(e)
    transfers = []
    for (src, dst), ss in sends.items():
        for s, rv in zip(ss, recvs.get((src, dst), [])):
            transfers.append(Transfer(src, dst, s.action, rv.action, max(s.start, rv.start), rv.end))
    peaks = [_peak_stash(traces[r]) for r in ranks]
    return SimResult(schedule, timeline, transfers, step, busy, peaks)


def clock_skews(group: dist.ProcessGroup | None = None) -> list[float]:
    """Each rank's ``time.perf_counter()`` minus the group's first rank's, for ``on_one_clock``. Collective.

    Ranks on one host share one monotonic clock: all zeros, exact. Across hosts the clocks are read
    right after a barrier, so the skews are within its release spread (well under a millisecond on one
    switch): what a barrier opening every step gave before, paid once per measurement instead of once
    per step.
    """
    n = dist.get_world_size(group)
    hosts: list[Any] = [None] * n
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) == 1:
        return [0.0] * n
    dist.barrier(group=group)
    now: list[Any] = [None] * n
    dist.all_gather_object(now, time.perf_counter(), group=group)
    return [t - now[0] for t in now]


def on_one_clock(
    traces: Sequence[Sequence[TraceEvent]], origins: Sequence[float], skews: Sequence[float], first: int = 0
) -> list[list[TraceEvent]]:
    """Every rank's events counted from when rank ``first`` began the step.

    A trace counts from its own rank's start (``origins``: its ``time.perf_counter()`` then, and
    ``skews`` from ``clock_skews``), and ranks begin a step up to milliseconds apart, so on their own
    origins a send and its receive on two ranks can seem to cross (a receive ending before its send
    began). Give ``first`` the rank holding the pipeline's first stage: every compute action of a step
    waits, directly or not, for that stage's first forward, so the step begins when that rank begins it
    (as in a simulation, whose ranks all start at 0); a rank that began earlier only posted receives
    before then (their events start before 0).
    """
    starts = [o - k for o, k in zip(origins, skews)]  # on rank 0's clock
    zero = starts[first]
    return [[TraceEvent(e.action, e.start + t - zero, e.end + t - zero) for e in tr] for tr, t in zip(traces, starts)]


def gathered_result(
    schedule: Schedule, trace: Sequence[TraceEvent], origin: float, group: dist.ProcessGroup | None = None
) -> SimResult:
    """``measured_result`` of every pipeline rank's last step (this rank's ``trace`` begun at ``origin``),
    on one clock from the start of the rank holding stage 0. Collective over ``group`` (its ranks in
    pipeline order)."""
    n = dist.get_world_size(group)
    got: list[Any] = [None] * n
    dist.all_gather_object(got, (list(trace), origin), group=group)
    traces, origins = zip(*got)
    return measured_result(schedule, on_one_clock(traces, origins, clock_skews(group), schedule.stage_to_rank[0]))


def _peak_stash(trace: Sequence[TraceEvent]) -> int:
    """Most microbatch-stages stashed at once: from each F to the end of its backward (its W when split)."""
    split = split_backwards([e.action for e in trace])
    live = peak = 0
    for e in trace:
        if e.action.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        live -= ends_backward(e.action, split)
    return peak


def finish_receive(trace: list[TraceEvent], recv: Action, end: float) -> None:
    """Close a receive's trace event when its wait ends (it was opened when the receive was posted)."""
    for k in range(len(trace) - 1, -1, -1):
        if trace[k].action == recv:
            trace[k] = TraceEvent(recv, trace[k].start, end)
            return


__all__ = ["TraceEvent", "clock_skews", "finish_receive", "gathered_result", "measured_result", "on_one_clock"]
