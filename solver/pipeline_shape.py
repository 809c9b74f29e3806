"""The shape of a pipeline: how many stages, which rank holds each, and how many microbatches each stashes.

``pp`` ranks hold ``pp * chunks`` stages (Megatron's interleaving, PTD-P section 2.2.2: rank r holds
chunks r, r+pp, r+2pp, ...) or ``2 * pp * waves`` stages (Hanayo's waves: a V down ranks 0..pp-1 and
back up pp-1..0, repeated ``waves`` times).

In-flight microbatches (``inflight_per_rank``, the one copy of the formula; the stage balance and the
search both read it, ``tests/test_stages.py`` and ``tests/test_search.py`` check it against the
simulator): the stage-microbatches whose activations rank r stashes at its peak, m microbatches per step,

    1F1B (and no pipeline)  min(pp - r, m)
    SCP (Merak)             the same, except 3 on the penultimate rank (Fig. 3c runs a third forward ahead)
    interleaved, v chunks   the warm-up plus one, min(2 (pp - r - 1) + (v - 1) pp + 1, v m)
    waves, W                2 W min(2 pp, m) (the wave schedule's in-flight cap is 2 pp microbatches)
    ZB-H1                   min(pp, m) on every rank (a microbatch-stage counts until its W)
    ZB-H2                   min(2 pp - 1, m)
    ZB-V                    min(2 pp, 2 m) chunk stashes (2 pp when m >= 2 pp - 1; fewer below: a bound)
    DualPipeV               2 pp + 1 chunk stashes (it needs m >= 2 pp)

``microbatches=None`` means m is large enough not to cap anything. Per stage (``inflight_per_stage``)
a rank's count is shared evenly by its stages; the stage balancer is told the schedule that runs
(``FlowOptions.schedule``), since ZB-H1/H2 have 1F1B's shape and ZB-V/DualPipeV a wave's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.errors import PipelineError

SCHEDULES = ("none", "1f1b", "interleaved", "wave", "scp", "zb-h1", "zb-h2", "zbv", "dualpipev")
V_SCHEDULES = ("wave", "zbv", "dualpipev")  # two stages per rank and wave, in a V
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv", "dualpipev")  # each backward split into B and W


def num_stages(pp: int, chunks: int = 1, waves: int | None = None) -> int:
    return 2 * pp * waves if waves else pp * chunks


def schedule_of(pp: int, chunks: int = 1, waves: int | None = None) -> str:
    """The schedule a (pp, chunks, waves) shape runs: "none" without a pipeline, "wave", "interleaved" or "1f1b"."""
    if waves:
        return "wave"
    if chunks > 1:
        return "interleaved"
    return "1f1b" if pp > 1 else "none"


def stage_ranks(pp: int, chunks: int = 1, waves: int | None = None) -> list[int]:
    """Rank of every stage: interleaved ``s % pp`` (rank r holds r, r+pp, ...); waves the V shape."""
    if waves:
        return [j if j < pp else 2 * pp - 1 - j for _ in range(waves) for j in range(2 * pp)]
    return [s % pp for s in range(pp * chunks)]


def placement_shape(stage_to_rank: Sequence[int], pp: int) -> tuple[int, int | None]:
    """The (chunks, waves) whose ``stage_ranks`` is ``stage_to_rank`` (a schedule's placement): interleaved
    chunks, or the V of waves (wave, ZB-V, DualPipeV); refuses any other placement."""
    placement, stages = list(stage_to_rank), len(stage_to_rank)
    if stages % pp == 0 and placement == stage_ranks(pp, stages // pp):
        return stages // pp, None
    if stages % (2 * pp) == 0 and placement == stage_ranks(pp, waves=stages // (2 * pp)):
        return 1, stages // (2 * pp)
    raise PipelineError(f"stage placement {placement} on {pp} ranks is neither interleaved nor a V of waves")


def inflight_per_rank(
    schedule: str, pp: int, microbatches: int | None, chunks: int = 1, waves: int | None = None
) -> list[float]:
    """Stage-microbatches whose activations each rank stashes at its peak (see the module docstring)."""
    m = microbatches if microbatches else math.inf
    if schedule == "none" or pp == 1:
        return [float(min(1, m))]
    if schedule == "1f1b":
        return [float(min(pp - r, m)) for r in range(pp)]
    if schedule == "scp":
        return [float(min(3 if r == pp - 2 else pp - r, m)) for r in range(pp)]
    if schedule == "interleaved":
        return [float(min(2 * (pp - r - 1) + (chunks - 1) * pp + 1, chunks * m)) for r in range(pp)]
    if schedule == "wave":
        return [float(2 * (waves or 1) * min(2 * pp, m)) for _ in range(pp)]
    zero_bubble = {"zb-h1": min(pp, m), "zb-h2": min(2 * pp - 1, m), "zbv": min(2 * pp, 2 * m), "dualpipev": 2 * pp + 1}
    if schedule in zero_bubble:
        return [float(zero_bubble[schedule])] * pp
    raise PipelineError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def inflight_per_stage(
    pp: int, chunks: int = 1, waves: int | None = None, microbatches: int | None = None, schedule: str | None = None
) -> list[float]:
    """Microbatches whose activations a stage stashes at its peak: its rank's count shared by the rank's
    stages. ``schedule``: the one that runs (ZB-H1 and ZB-H2 have 1F1B's shape but keep each microbatch
    until its W; ZB-V and DualPipeV a wave's); default the shape's own (``schedule_of``)."""
    if schedule is not None and schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    name = schedule or schedule_of(pp, chunks, waves)
    per_rank = inflight_per_rank(name, pp, microbatches, chunks, waves)
    share = num_stages(pp, chunks, waves) // pp
    return [per_rank[r] / share for r in stage_ranks(pp, chunks, waves)]


def check_shape(pp: int, chunks: int = 1, waves: int | None = None) -> None:
    """Raise ``PipelineError`` for a pipeline shape that does not exist."""
    if pp < 1 or chunks < 1 or (waves is not None and waves < 1):
        raise PipelineError(f"pp, chunks and waves must be >= 1; got pp={pp}, chunks={chunks}, waves={waves}")
    if waves and chunks > 1:
        raise PipelineError("choose interleaving (chunks) or waves, not both: waves already put 2W chunks on a rank")


__all__ = [
    "SCHEDULES",
    "V_SCHEDULES",
    "check_shape",
    "inflight_per_rank",
    "inflight_per_stage",
    "num_stages",
    "placement_shape",
    "schedule_of",
    "stage_ranks",
]
