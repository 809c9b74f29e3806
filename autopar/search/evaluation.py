"""A searched candidate's price: ``Evaluation``, what the analytic model (``price.py``) and the simulator
(``score.py``) say of one candidate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.search.space import Candidate


@dataclass
class Evaluation:
    """A candidate priced by the analytic model (and, after scoring, by the simulator)."""

    candidate: Candidate
    stages: tuple[tuple[int, int], ...]  # unit range [start, stop) of each stage
    stage_rank: tuple[int, ...]
    tf: tuple[float, ...]  # per stage, one microbatch
    tb: tuple[float, ...]
    tr: tuple[float, ...]  # recomputing all of the stage's recomputed layers once
    tc: tuple[float, ...]  # per stage boundary
    recompute_fraction: tuple[float, ...]  # per stage: the fraction the schedule recomputes
    reduce: tuple[float, ...]  # per rank: data-parallel gradient synchronization after its last backward
    rank_memory: tuple[float, ...]  # per rank, bytes
    weight_memory: tuple[float, ...]  # per rank, model states
    lower_bound: float
    step_time: float | None = None
    simulated: str = ""  # "exact", "extrapolated" or "closed form"
    bubble: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    tw: tuple[float, ...] = ()  # per stage: the weight-gradient part of tb (a zero-bubble schedule's W)

    @property
    def memory(self) -> float:
        return max(self.rank_memory)

    @property
    def sort_key(self) -> tuple:
        """Fastest first; equal step times: least memory, then the candidate's field order."""
        return (self.step_time if self.step_time is not None else math.inf, self.memory, self.candidate)


__all__ = ["Evaluation"]
