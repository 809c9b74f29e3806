"""What a step recorded: the start and end of every action, the measured ``SimResult`` built from every
rank's trace (the Gantt chart and bubble ratios of a measured step compare directly with a simulated one),
and the barrier that opens a recorded step."""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from autopar.runtime.actions import COMPUTE_KINDS, Action, Kind, Schedule, ends_backward, split_backwards
from autopar.runtime.timeline import Event, SimResult, Transfer


@dataclass(frozen=True)
class TraceEvent:
    """One action as it ran: seconds since the step began (all ranks start after one barrier)."""

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


def step_barrier(timeout: float) -> Callable[[], None]:
    """The barrier that opens a recorded step: gloo's monitored one (it names a rank that never
    arrives within ``timeout`` seconds), else a plain one."""
    td = datetime.timedelta(seconds=timeout)

    def barrier() -> None:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=td)
        else:
            dist.barrier()

    return barrier


__all__ = ["TraceEvent", "finish_receive", "measured_result", "step_barrier"]
