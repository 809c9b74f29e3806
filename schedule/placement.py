"""The shape of a pipeline: how many stages, and which rank holds each.

``pp`` ranks hold ``pp * chunks`` stages (Megatron's interleaving, PTD-P section 2.2.2: rank r holds
chunks r, r+pp, r+2pp, ...) or ``2 * pp * waves`` stages (Hanayo's waves: a V down ranks 0..pp-1 and
back up pp-1..0, repeated ``waves`` times). How many microbatches each rank stashes is the schedule's
own: the registry's in-flight counts (``schedule/generators.py``, ``inflight_per_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.errors import PipelineError


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


def check_shape(pp: int, chunks: int = 1, waves: int | None = None) -> None:
    """Raise ``PipelineError`` for a pipeline shape that does not exist."""
    if pp < 1 or chunks < 1 or (waves is not None and waves < 1):
        raise PipelineError(f"pp, chunks and waves must be >= 1; got pp={pp}, chunks={chunks}, waves={waves}")
    if waves and chunks > 1:
        raise PipelineError("choose interleaving (chunks) or waves, not both: waves already put 2W chunks on a rank")


__all__ = [
    "check_shape",
    "num_stages",
    "placement_shape",
    "schedule_of",
    "stage_ranks",
]
