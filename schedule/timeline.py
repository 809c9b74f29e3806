"""What a simulated step produced: per-rank timeline, transfers, step time, bubble ratios, memory.

Bubble ratios (all exact when costs are ints/Fractions):

- ``busy[r]``: time rank ``r`` spends in F, B and RECOMPUTE.
- ``bubble_ratio_per_rank[r] = (step_time - busy[r]) / busy[r]``: idle over useful compute.
- ``bubble_ratio = (step_time - max busy) / max busy``: Megatron's "bubble time / ideal
  computation time" (section 2.2.1), which is also Merak's "bubble time / running time" (the
  busiest rank sets the ideal). 1F1B with equal stages gives (p-1)/m.
- ``idle_fraction = sum_r (step_time - busy[r]) / (P * step_time)``: idle share of all device time,
  the "bubble / total" reading (see docs/schedules.md for how Hanayo's formula compares).
- ``span_bubble = max_r (span[r] - busy[r])``, ``span[r]`` from rank r's first compute start to its
  last compute end: the idle time *inside* each rank's own span, the bubble when consecutive steps
  overlap (rank r starts the next step as soon as it ends this one, which the Zero Bubble paper's
  optimizer post-validation allows). ZB-H2's and ZB-V's published bubbles are in this sense; a
  synchronous step (autopar's: REDUCE_GRADS and STEP end it) pays ``step_time - busy`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from autopar.schedule.action_costs import Number
from autopar.schedule.actions import COMPUTE_KINDS, Action, Schedule


@dataclass(frozen=True)
class Event:
    """One action as it ran on rank ``rank``, from ``start`` to ``end``.

    For a send or receive that is from posting to completion; under eager p2p the rank does not
    wait for it (the consuming compute does).
    """

    rank: int
    action: Action
    start: Number
    end: Number


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message on the wire, from ``start`` to ``end``."""

    src_rank: int
    dst_rank: int
    send: Action
    recv: Action
    start: Number
    end: Number


@dataclass
class SimResult:
    """Timeline, step time, bubble ratios and activation memory of one simulated step."""

    schedule: Schedule
    timeline: list[list[Event]]
    transfers: list[Transfer]
    step_time: Number
    busy: list[Number]
    peak_activations: list[int]
    peak_activation_bytes: list[Number] | None = None
    bubble_ratio_per_rank: list[Number] = field(init=False)
    bubble_ratio: Number = field(init=False)
    idle_fraction: Number = field(init=False)
    span_bubble: Number = field(init=False)

    def __post_init__(self) -> None:
        t = self.step_time
        self.bubble_ratio_per_rank = [_ratio(t - b, b) for b in self.busy]
        self.bubble_ratio = _ratio(t - max(self.busy), max(self.busy))
        idle = sum(t - b for b in self.busy)
        self.idle_fraction = _ratio(idle, len(self.busy) * t)
        self.span_bubble = max(_span(events) - b for events, b in zip(self.timeline, self.busy))

    def to_json(self) -> dict[str, Any]:
        """Summary as JSON-ready numbers (floats); the exact values stay on the object."""
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.num_ranks,
            "stages": self.schedule.num_stages,
            "microbatches": self.schedule.num_microbatches,
            "options": {k: v if isinstance(v, int) else str(v) for k, v in self.schedule.options},
            "step_time": float(self.step_time),
            "bubble_ratio": float(self.bubble_ratio),
            "bubble_ratio_per_rank": [float(x) for x in self.bubble_ratio_per_rank],
            "idle_fraction": float(self.idle_fraction),
            "span_bubble": float(self.span_bubble),
            "busy": [float(x) for x in self.busy],
            "peak_activations": list(self.peak_activations),
            "peak_activation_bytes": None
            if self.peak_activation_bytes is None
            else [float(x) for x in self.peak_activation_bytes],
        }


def _span(events: list[Event]) -> Number:
    """From a rank's first compute start to its last compute end (0 if it computes nothing)."""
    computes = [e for e in events if e.action.kind in COMPUTE_KINDS]
    return max(e.end for e in computes) - min(e.start for e in computes) if computes else 0


def _ratio(num: Number, den: Number) -> Number:
    if not den:
        return Fraction(0)
    if isinstance(num, float) or isinstance(den, float):
        return num / den
    return Fraction(num) / Fraction(den)
