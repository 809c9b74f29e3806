"""Per-action costs the simulator charges: compute time per stage, transfer time per boundary, bytes.

Numbers may be ``int``, ``fractions.Fraction`` or ``float``; with ints and Fractions every time the
simulator reports is exact, which is how the tests compare it with the papers' closed forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from autopar.errors import ScheduleError

if TYPE_CHECKING:
    from autopar.schedule.actions import Schedule

Number = int | Fraction | float
PerStage = Number | Sequence[Number]


def _spread(value: PerStage, n: int, what: str) -> tuple[Number, ...]:
    if isinstance(value, (int, float, Fraction)):
        return (value,) * n
    values = tuple(value)
    if len(values) != n:
        raise ScheduleError(f"{what} has {len(values)} entries; expected {n}")
    return values


def _half(value: Number) -> Number:
    return value / 2 if isinstance(value, float) else Fraction(value) / 2


def _scaled(value: PerStage, factor: Fraction) -> PerStage:
    if isinstance(value, float):
        return value * float(factor)
    if isinstance(value, (int, Fraction)):
        return Fraction(value) * factor
    return value


@dataclass(frozen=True)
class Costs:
    """What each action costs, per stage.

    ``tf[s]``, ``tb[s]``: forward / whole backward time of one microbatch through stage ``s``.
    ``tw[s]``: the part of ``tb[s]`` that computes weight gradients: a ``W`` costs ``tw``, a ``B``
    whose ``W`` comes later ``tb - tw`` (the Zero Bubble paper's T_B is ``tb - tw``, its T_W ``tw``);
    defaults to ``tb / 2`` (matmuls: the input and the weight gradient cost the same).
    ``tr[s]``: time to recompute *all* of stage ``s``'s activations; a ``RECOMPUTE`` with fraction
    ``x`` costs ``x * tr[s]`` (Merak's T_recompute; defaults to ``tf``).
    ``tc[s]``: time of one transfer across the boundary between stages ``s`` and ``s + 1``
    (activation or gradient; ``S - 1`` entries; local hand-overs cost nothing).
    ``act_bytes[s]``: bytes stage ``s`` stashes per microbatch when it recomputes nothing;
    ``input_bytes[s]``: bytes it keeps under full recomputation (its input). A forward with
    recompute fraction ``x`` stashes ``(1 - x) * act_bytes + x * input_bytes``; the ``RECOMPUTE``
    re-materialises ``x * act_bytes`` until the backward frees everything.
    ``w_bytes[s]``: bytes a split ``B`` adds that live until its ``W`` (the output gradients of the
    weight ops; the stash itself stays until the ``W`` as well).
    ``t_reduce[s]``: time of ``REDUCE_GRADS(s)``; ``t_step``: time of ``STEP``.
    ``t_send``: time a rank itself spends issuing one send before its next action (the runtime's
    fixed cost per message, on the sender's own timeline; gloo writes a message in the caller when
    its receive is already posted). 0 prices the papers' idealised runtime; a measured value
    (``bench/zero_bubble_vs_torch.py`` reads it off a trace) prices this one, whose V schedules issue
    twice as many sends per rank as 1F1B.
    ``t_action``: the executor's own time before each compute action (dispatch, waiting on a receive
    that has arrived, posting the channel's next receive): on the rank's timeline, not compute, so it
    counts as bubble, as in a trace. A schedule pays it per action on its critical path (ZB-V runs 48
    actions per rank at P = 4, M = 8; 1F1B 16). 0 prices the papers' runtime; the benchmark reads it
    off a trace like ``t_send``.
    """

    tf: tuple[Number, ...]
    tb: tuple[Number, ...]
    tr: tuple[Number, ...]
    tc: tuple[Number, ...]
    act_bytes: tuple[Number, ...] | None = None
    input_bytes: tuple[Number, ...] | None = None
    t_reduce: tuple[Number, ...] | None = None
    t_step: Number = 0
    tw: tuple[Number, ...] | None = None
    w_bytes: tuple[Number, ...] | None = None
    t_send: Number = 0
    t_action: Number = 0

    def __post_init__(self) -> None:
        if self.tw is None:
            object.__setattr__(self, "tw", tuple(_half(b) for b in self.tb))
        if any(not 0 <= w <= b for w, b in zip(self.tw, self.tb)):  # type: ignore[arg-type]
            raise ScheduleError(f"tw {self.tw} must lie between 0 and the whole backward tb {self.tb}")

    @property
    def num_stages(self) -> int:
        return len(self.tf)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        tf: PerStage = 1,
        tb: PerStage = 2,
        tr: PerStage | None = None,
        tc: PerStage = 0,
        act_bytes: PerStage | None = None,
        input_bytes: PerStage = 0,
        t_reduce: PerStage = 0,
        t_step: Number = 0,
        tw: PerStage | None = None,
        w_bytes: PerStage | None = None,
        t_send: Number = 0,
        t_action: Number = 0,
    ) -> Costs:
        """Costs given per stage: a scalar applies to every stage (every boundary for ``tc``)."""
        n = num_stages
        fwd = _spread(tf, n, "tf")
        return cls(
            tf=fwd,
            tb=_spread(tb, n, "tb"),
            tr=fwd if tr is None else _spread(tr, n, "tr"),
            tc=_spread(tc, n - 1, "tc"),
            act_bytes=None if act_bytes is None else _spread(act_bytes, n, "act_bytes"),
            input_bytes=_spread(input_bytes, n, "input_bytes"),
            t_reduce=_spread(t_reduce, n, "t_reduce"),
            t_step=t_step,
            tw=None if tw is None else _spread(tw, n, "tw"),
            w_bytes=None if w_bytes is None else _spread(w_bytes, n, "w_bytes"),
            t_send=t_send,
            t_action=t_action,
        )

    @classmethod
    def from_rank_share(
        cls,
        schedule: Schedule,
        tf: PerStage = 1,
        tb: PerStage = 2,
        tr: PerStage | None = None,
        tc: PerStage = 0,
        act_bytes: PerStage | None = None,
        tw: PerStage | None = None,
    ) -> Costs:
        """Scalar ``tf``/``tb``/``tr``/``tw``/``act_bytes`` are for one rank's share of the model (model / P).

        They are split evenly over that rank's stages, so schedules with more stages per rank
        (interleaved, waves) do the same total work and their step times compare directly. This is
        Hanayo's T_F / T_B convention and what ``autopar simulate --tf --tb`` means. Per-stage lists
        and ``tc`` (one transfer) are used as given.
        """
        per = Fraction(schedule.num_ranks, schedule.num_stages)

        def split(v: PerStage) -> PerStage:
            return _scaled(v, per)

        return cls.uniform(
            schedule.num_stages,
            tf=split(tf),
            tb=split(tb),
            tr=None if tr is None else split(tr),
            tc=tc,
            act_bytes=None if act_bytes is None else split(act_bytes),
            tw=None if tw is None else split(tw),
        )
