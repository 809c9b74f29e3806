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
    optimizer: tuple[float, ...] = ()  # per rank: the optimizer step after its gradient synchronization

    def tail(self, rank: int) -> float:
        """Seconds a rank works after its last compute: its gradient synchronization, then its optimizer step."""
        return self.reduce[rank] + (self.optimizer[rank] if self.optimizer else 0.0)

    @property
    def memory(self) -> float:
        return max(self.rank_memory)

    @property
    def sort_key(self) -> tuple:
        """Fastest first; equal step times: least memory, then the candidate's field order."""
        return (self.step_time if self.step_time is not None else math.inf, self.memory, self.candidate)


NEAR_EQUAL = 1e-3  # relative: step times this close are one step time to the search (the model is not this exact)


def order_near_equal(evaluations: list[Evaluation], tol: float = NEAR_EQUAL) -> list[Evaluation]:
    """Fastest first, but among plans within ``tol`` of the fastest left the least memory first: repeatedly,
    of the plans whose step is within ``tol`` of the fastest remaining one, the one with the least memory
    (then the faster, then the candidate's field order). Ties on float noise are broken by memory."""
    rest = sorted(evaluations, key=lambda e: e.sort_key)
    out = []
    while rest:
        limit = rest[0].step_time * (1 + tol)
        near = [e for e in rest if e.step_time <= limit]
        pick = min(near, key=lambda e: (e.memory, e.step_time, e.candidate))
        out.append(pick)
        rest.remove(pick)
    return out


__all__ = ["NEAR_EQUAL", "Evaluation", "order_near_equal"]
