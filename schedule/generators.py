"""The one schedule registry, and its generators: GPipe, 1F1B, interleaved 1F1B, Hanayo waves, Merak SCP, zero bubble.

A generator is ``(num_ranks, num_microbatches, **options) -> Schedule``. It decides the placement
(``stage_to_rank``) and each rank's order of ``F``/``B``/``W``/``RECOMPUTE``;
``autopar.schedule.comm_actions.insert_comm_actions`` adds the sends, receives, ``REDUCE_GRADS`` and ``STEP``.
Adding a schedule is one decorated function, in this file or any other::

    @register("my-schedule", inflight=lambda pp, m, chunks, waves: [min(pp - r, m) for r in range(pp)])
    def my_schedule(num_ranks: int, num_microbatches: int) -> Schedule: ...

after which ``make_schedule("my-schedule", P, M)``, ``autopar simulate --schedule my-schedule``,
``compile(schedule="my-schedule")`` and ``autopar plan --schedule my-schedule`` (whose stage balance prices its
in-flight activations from here: ``inflight_per_rank``) and the property tests (which iterate over
``SCHEDULES``) all pick it up. ``inflight`` is the closed form of each rank's peak stash; without it the
registry counts the peaks off the schedule's own action lists (``actions.stash_points``), exact and slower.
``v_shape=True`` says the generator places its stages in a V (two per rank and wave), ``split_backward=True``
that it splits backwards into B and W (zero bubble: each rank keeps a microbatch's activations until its W).

Placements (``schedule.placement.stage_ranks``): GPipe, 1F1B, SCP, ZB-H1 and ZB-H2 put stage ``r``
on rank ``r``. Interleaved puts stage ``s`` on rank ``s % P`` (rank ``r`` holds chunks ``r, r+P, r+2P,
...``). Waves, ZB-V and DualPipeV use the V shape: stage ``s = 2Pw + j`` is on rank ``j`` for ``j < P``
and on rank ``2P-1-j`` otherwise, so stages ``P-1, P`` share rank ``P-1`` and stages ``2P-1, 2P``
share rank 0 (local hand-overs, no p2p).

In-flight counts (each rank r's peak of stashed stage-microbatches, m microbatches per step; the stage
balance and the search read them through ``inflight_per_rank``, the property tests check every one against
the lists and the simulator): GPipe ``m``; 1F1B (and no pipeline) ``min(P - r, m)``, so ``P`` on rank 0; SCP
the same except ``min(3, m)`` on the penultimate rank (Fig. 3c runs a third forward ahead); interleaved
with v chunks its warm-up plus one, ``min(2(P-r-1) + (v-1)P + 1, vm)``; W waves ``2W min(2P, m)`` (the wave
schedule's in-flight cap is 2P microbatches); the zero-bubble schedules count a microbatch-stage until its
``W``: ZB-H1 ``min(P, m)``, ZB-H2 ``min(2P - 1, m)``, ZB-V ``min(2P, 2m)`` stage stashes of half a rank's share
each (1F1B's rank 0; fewer below m = 2P - 1: a bound), DualPipeV ``2P + 1`` of them (DualPipe's PP + 1; it
needs m >= 2P).
"""

from __future__ import annotations

import contextvars
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from autopar.errors import PipelineError, ScheduleError
from autopar.schedule.actions import RECOMPUTE, Action, B, F, Schedule, check_placement, stash_points
from autopar.schedule.comm_actions import insert_comm_actions
from autopar.schedule.list_scheduling import Priority, list_schedule
from autopar.schedule.placement import num_stages, schedule_of, stage_ranks
from autopar.schedule.replay import Replay
from autopar.schedule.zero_bubble import checkpointed, delay_weights, dualpipev_orders, zbv_orders

Generator = Callable[..., Schedule]
# (pp, m, chunks, waves) -> each rank's peak stashed stage-microbatches; m is math.inf for "m large enough"
Inflight = Callable[[int, float, int, int], Sequence[float]]


@dataclass(frozen=True)
class ScheduleKind:
    """A registered schedule: its generator and what planning reads of it."""

    name: str
    generator: Generator
    inflight: Inflight | None = None  # the closed form; None: counted off the generated lists
    v_shape: bool = False  # stages placed in a V, two per rank and wave (waves, ZB-V, DualPipeV)
    split_backward: bool = False  # backwards split into B and W (the zero-bubble schedules)

    def options(self) -> tuple[str, ...]:
        """The keyword options its generator takes (chunks=, waves=, recompute=, ...)."""
        return tuple(inspect.signature(self.generator).parameters)[2:]


SCHEDULES: dict[str, ScheduleKind] = {}


def register(
    name: str, *, inflight: Inflight | None = None, v_shape: bool = False, split_backward: bool = False
) -> Callable[[Generator], Generator]:
    """Decorator: make a generator available as ``make_schedule(name, ...)``, on the CLI and to the planner,
    whose stage balance prices ``inflight`` (see the module docstring)."""

    def add(fn: Generator) -> Generator:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} registered twice")
        SCHEDULES[name] = ScheduleKind(name, fn, inflight, v_shape, split_backward)
        return fn

    return add


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule ``name``; ``ScheduleError`` naming the known ones otherwise."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name]


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` splits its backwards into B and W (a zero-bubble schedule)."""
    return name in SCHEDULES and SCHEDULES[name].split_backward


def inflight_per_rank(
    schedule: str, pp: int, microbatches: int | None, chunks: int = 1, waves: int | None = None
) -> list[float]:
    """Stage-microbatches whose activations each rank stashes at its peak under ``schedule`` (the module
    docstring's table; "none" is no pipeline). ``microbatches=None``: m large enough not to cap anything."""
    m = microbatches if microbatches else math.inf
    if schedule == "none" or pp == 1:
        return [float(min(1, m))]
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; known: none, {', '.join(sorted(SCHEDULES))}")
    kind = SCHEDULES[schedule]
    if kind.inflight is not None:
        return [float(n) for n in kind.inflight(pp, m, chunks, waves or 1)]
    if m == math.inf:
        raise PipelineError(f"the {schedule} schedule's in-flight counts come from its action lists: give microbatches")
    shape = {k: v for k, v in (("chunks", chunks), ("waves", waves)) if k in kind.options() and v}
    lists = make_schedule(schedule, pp, int(m), **shape).actions
    return [float(max((n for n, _ in stash_points(lst)), default=0)) for lst in lists]


def inflight_per_stage(
    pp: int, chunks: int = 1, waves: int | None = None, microbatches: int | None = None, schedule: str | None = None
) -> list[float]:
    """Microbatches whose activations a stage stashes at its peak: its rank's count shared by the rank's
    stages. ``schedule``: the one that runs (ZB-H1 and ZB-H2 have 1F1B's shape but keep each microbatch
    until its W; ZB-V and DualPipeV a wave's); default the shape's own (``placement.schedule_of``)."""
    if schedule is not None and schedule != "none" and schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; known: none, {', '.join(sorted(SCHEDULES))}")
    name = schedule or schedule_of(pp, chunks, waves)
    per_rank = inflight_per_rank(name, pp, microbatches, chunks, waves)
    share = num_stages(pp, chunks, waves) // pp
    return [per_rank[r] / share for r in stage_ranks(pp, chunks, waves)]


def make_schedule(
    name: str, num_ranks: int, num_microbatches: int, *, post_ahead: bool = True, **options: int | Fraction
) -> Schedule:
    """Build the registered schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches``.

    ``post_ahead=False``: each receive left right before its consumer (``insert_comm_actions``' rule 5 skipped, so
    the lists are not timed once with nominal costs to place them, most of the build's time at pp = 64): sound under
    eager p2p only, and timed by it exactly as the placed lists are (the sends are where they are; posting a receive
    takes no time there). What the search builds to time a schedule (``replay.Replay``, ``search/score.py``); never
    for a runtime."""
    kind = schedule_kind(name)
    if num_ranks < 1 or num_microbatches < 1:
        raise ScheduleError(f"need at least one rank and microbatch, got P={num_ranks}, M={num_microbatches}")
    token = _POST_AHEAD.set(post_ahead)
    try:
        return kind.generator(num_ranks, num_microbatches, **options)
    finally:
        _POST_AHEAD.reset(token)


def make_replay(name: str, num_ranks: int, num_microbatches: int, **options: int | Fraction) -> Replay:
    """``Replay(make_schedule(name, ..., post_ahead=False))``, compiled straight from the generator's compute orders
    (``Replay.from_orders``: no transfer ``Action`` built, no lists assembled): what the search times. A generator
    registered without ``_build`` gives its Schedule, compiled as it is."""
    token = _REPLAY.set(True)
    try:
        out = make_schedule(name, num_ranks, num_microbatches, post_ahead=False, **options)
    finally:
        _REPLAY.reset(token)
    return out if isinstance(out, Replay) else Replay(out)


# make_replay's mode, read by _build: it returns the compute orders' Replay instead of the Schedule
_REPLAY: contextvars.ContextVar[bool] = contextvars.ContextVar("replay", default=False)

# make_schedule's post_ahead, read by _build (the generators' own signatures are the registry's: no flag through them)
_POST_AHEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("post_ahead", default=True)


def _build(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    compute: Sequence[Sequence[Action]],
    **options: int | Fraction,
) -> Schedule:
    check_placement(stage_to_rank, len(compute))
    if _REPLAY.get():
        return Replay.from_orders(name, compute, stage_to_rank)  # type: ignore[return-value]
    actions = insert_comm_actions(compute, stage_to_rank, num_microbatches, post_ahead=_POST_AHEAD.get())
    sizes = (len(compute), len(stage_to_rank), num_microbatches)
    return Schedule(*sizes, tuple(stage_to_rank), actions, name, tuple(options.items()))


Unit = list[Action]  # what 1F1B alternates: one forward, or one backward with its recompute


def one_f_one_b(forwards: Sequence[Unit], backwards: Sequence[Unit], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward / one backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    out: list[Action] = [a for unit in forwards[:warmup] for a in unit]
    steady = len(forwards) - warmup
    for i in range(steady):
        out += forwards[warmup + i] + backwards[i]
    for unit in backwards[steady:]:
        out += unit
    return out


@register("gpipe", inflight=lambda pp, m, chunks, waves: [m] * pp)
def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (in microbatch order). Stashes M activations."""
    mbs = range(num_microbatches)
    compute = [[F(m, r) for m in mbs] + [B(m, r) for m in mbs] for r in range(num_ranks)]
    return _build("gpipe", num_microbatches, range(num_ranks), compute)


@register("1f1b", inflight=lambda pp, m, chunks, waves: [min(pp - r, m) for r in range(pp)])
def one_f_one_b_schedule(num_ranks: int, num_microbatches: int, recompute: int = 0) -> Schedule:
    """PipeDream-Flush / DAPPLE 1F1B: rank r warms up with P-r-1 forwards, then alternates.

    ``recompute=1`` checkpoints every stage and puts each ``RECOMPUTE`` right before its backward;
    it does not wait for the gradient, so it fills the cool-down bubbles (Merak Fig. 3b, "early
    recomputation").
    """
    P, M = num_ranks, num_microbatches
    compute = []
    for r in range(P):
        fwd = [[F(m, r, recompute)] for m in range(M)]
        bwd = [([RECOMPUTE(m, r)] if recompute else []) + [B(m, r)] for m in range(M)]
        compute.append(one_f_one_b(fwd, bwd, P - r - 1))
    opts = {"recompute": 1} if recompute else {}
    return _build("1f1b", M, range(P), compute, **opts)


@register(
    "interleaved",
    inflight=lambda pp, m, v, waves: [min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m) for r in range(pp)],
)
def interleaved(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B with v = ``chunks`` model chunks per rank (PTD-P section 2.2.2).

    Rank r holds stages r, r+P, ..., r+(v-1)P. Microbatches go in groups of P: a rank runs the
    forward of chunk 0 for the group, then chunk 1, ..., then the next group; backwards go through
    the chunks in reverse. Warm-up is 2(P-r-1) + (v-1)P forwards, then 1F1B.

    Megatron requires M to be a multiple of P. Here any M >= 1 works: the lists are made for M
    rounded up to a multiple of P and the actions of the padding microbatches are dropped. Dropping
    actions only removes dependencies, so the lists stay deadlock-free (the simulator checks every
    one), but the short last group leaves extra bubbles: (p-1)/(v m) holds exactly only when P
    divides M (see docs/schedules.md).
    """
    P, M, v = num_ranks, num_microbatches, chunks
    return _build("interleaved", M, [s % P for s in range(P * v)], interleaved_orders(P, M, v), chunks=v)


def interleaved_orders(num_ranks: int, num_microbatches: int, chunks: int) -> list[list[Action]]:
    """The F/B compute order of every rank of interleaved 1F1B (``interleaved``), without the transfers (what a
    rank's memory depends on: ``actions.stage_stash_points``); cheap for any size."""
    P, M, v = num_ranks, num_microbatches, chunks
    if v < 1:
        raise ScheduleError(f"interleaved needs chunks >= 1, got {v}")
    padded = -(-M // P) * P
    groups = [range(g, g + P) for g in range(0, padded, P)]
    compute = []
    for r in range(P):
        fwd = [[F(m, c * P + r)] for grp in groups for c in range(v) for m in grp]
        bwd = [[B(m, c * P + r)] for grp in groups for c in reversed(range(v)) for m in grp]
        order = one_f_one_b(fwd, bwd, 2 * (P - r - 1) + (v - 1) * P)
        compute.append([a for a in order if a.mb is not None and a.mb < M])
    return compute


def stage_aware_ratios(num_stages: int, alpha1: Fraction | int) -> list[Fraction]:
    """Merak's non-recomputation ratios alpha_i (section 5.2), as a 0-based list for stages 1..s.

    alpha_1 is tuned by hand; alpha_i = min(1, (s-1) alpha_1 / (s-i)) for 2 <= i < s-1,
    alpha_{s-1} = alpha_{s-2} and alpha_s = 1 (the last stage of the shifted critical path schedule
    does not recompute). Equal-memory assumption: M_r + (s-i) alpha_i M_a is the same for every i.
    """
    s, a1 = num_stages, Fraction(alpha1)
    if not 0 <= a1 <= 1:
        raise ScheduleError(f"alpha_1 must be in [0, 1], got {a1}")
    if s == 1:
        return [Fraction(1)]
    alpha = {1: a1, s: Fraction(1)}
    for i in range(2, s - 1):
        alpha[i] = min(Fraction(1), (s - 1) * a1 / (s - i))
    if s - 1 > 1:
        alpha[s - 1] = alpha[s - 2]
    return [alpha[i] for i in range(1, s + 1)]


@register("wave", inflight=lambda pp, m, chunks, w: [2 * w * min(2 * pp, m)] * pp, v_shape=True)
def wave(num_ranks: int, num_microbatches: int, waves: int = 1, max_inflight: int = 0) -> Schedule:
    """Hanayo's wave pipeline: W = ``waves`` V-shaped waves over 2PW stages, no model replicas.

    ``waves=1`` is Chimera-wave (Chimera's two pipelines folded into one, Hanayo section 3.2).
    The order on each rank comes from ``list_schedule`` under nominal costs T_B = 2 T_F (per
    stage), trying the four ``Priority`` rules and keeping the shortest step (then the lowest
    memory). At most ``max_inflight`` microbatches are in flight (default 2P), so a rank stashes at
    most ``2W * max_inflight`` stage activations, i.e. ``max_inflight`` times its model share's
    activations (1F1B's rank 0 holds P).
    """
    P, M, W = num_ranks, num_microbatches, waves
    if W < 1:
        raise ScheduleError(f"wave needs waves >= 1, got {W}")
    cap = max_inflight or 2 * P
    placement = stage_ranks(P, waves=W)
    candidates = [list_schedule(placement, M, Priority(bf, df), cap) for bf in (True, False) for df in (True, False)]
    best = min(candidates, key=lambda ls: (ls.makespan, ls.peak_inflight))
    return _build("wave", M, placement, best.compute, waves=W, max_inflight=cap)


@register("scp", inflight=lambda pp, m, chunks, waves: [min(3 if r == pp - 2 else pp - r, m) for r in range(pp)])
def shifted_critical_path(num_ranks: int, num_microbatches: int, alpha1: Fraction | int = 0) -> Schedule:
    """Merak's shifted critical path schedule (section 5.1) with stage-aware recomputation (5.2).

    1F1B with early recomputation: each ``RECOMPUTE`` sits right before its ``B`` and does not
    wait for the gradient. The last stage stashes its one activation and never recomputes; the
    penultimate stage runs its third forward ahead of its first backward (Fig. 3c: F0 F1 F2 R0 B0
    R1 B1 F3 R2 B2 ...), which fills the bubble that waiting for the last stage left and moves the
    critical path to the penultimate stage: the bubble drops from 3(s-1) T_F to 3(s-2) T_F
    (T_R = T_F, T_B = 2 T_F). Stage i recomputes
    the fraction ``1 - alpha_i`` of its activations (``stage_aware_ratios``; ``alpha1=0``: full
    recomputation on every stage but the last).
    """
    P, M = num_ranks, num_microbatches
    ratios = stage_aware_ratios(P, Fraction(alpha1))
    compute = []
    for r in range(P):
        x = 1 - ratios[r]
        fwd = [[F(m, r, x)] for m in range(M)]
        bwd = [([RECOMPUTE(m, r, x)] if x else []) + [B(m, r)] for m in range(M)]
        order = one_f_one_b(fwd, bwd, P - r - 1)
        if r == P - 2 and M >= 3:  # Merak Fig. 3c: the third forward moves ahead of the first backward
            order.remove(fwd[2][0])
            order.insert(order.index(fwd[1][0]) + 1, fwd[2][0])
        compute.append(order)
    return _build("scp", M, range(P), compute, alpha1=Fraction(alpha1))


def _one_f_one_b_with_weights(num_ranks: int, num_microbatches: int, warmup, delay) -> list[list[Action]]:
    """Per rank r: 1F1B's F/B order with ``warmup(r)`` forwards first, W delayed by ``delay(r)`` backwards."""
    P, M = num_ranks, num_microbatches
    compute = []
    for r in range(P):
        order = one_f_one_b([[F(m, r)] for m in range(M)], [[B(m, r)] for m in range(M)], warmup(r))
        compute.append(delay_weights(order, delay(r)))
    return compute


def _zero_bubble(name: str, M: int, placement: Sequence[int], orders: list[list[Action]], recompute: int) -> Schedule:
    """``_build`` for a zero-bubble order, with every stage checkpointed when ``recompute=1``."""
    if recompute not in (0, 1):
        raise ScheduleError(f"{name} takes recompute=0 or 1, got {recompute}")
    if recompute:
        return _build(name, M, placement, [checkpointed(o) for o in orders], recompute=1)
    return _build(name, M, placement, orders)


def zero_bubble_orders(name: str, num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """The F/B/W compute order of every rank of zero-bubble schedule ``name``, without the transfers
    (what a rank's memory depends on: ``actions.stash_points``); cheap for any size."""
    P, M = num_ranks, num_microbatches
    if name == "zb-h1":
        return _one_f_one_b_with_weights(P, M, lambda r: P - r - 1, lambda r: r)
    if name == "zb-h2":
        return _one_f_one_b_with_weights(P, M, lambda r: 2 * (P - r - 1), lambda r: 2 * r)
    if name == "zbv":
        return zbv_orders(P, M)
    if name == "dualpipev":
        return dualpipev_orders(P, M)
    raise ScheduleError(f"{name!r} is not a zero-bubble schedule (zb-h1, zb-h2, zbv, dualpipev)")


@register("zb-h1", inflight=lambda pp, m, chunks, waves: [min(pp, m)] * pp, split_backward=True)
def zb_h1(num_ranks: int, num_microbatches: int, recompute: int = 0) -> Schedule:
    """Zero Bubble's ZB-H1 (Qi et al. 2.1): 1F1B whose rank r runs its W r backwards late.

    Bubble (p-1)(T_F + T_B - T_W) against 1F1B's (p-1)(T_F + T_B + T_W), at 1F1B's peak activation
    memory (P stage stashes on every rank, counted until the W). ``recompute=1`` checkpoints every
    stage (a ``RECOMPUTE`` right before each ``B``), as for every zero-bubble schedule here.
    """
    return _zero_bubble(
        "zb-h1", num_microbatches, range(num_ranks), zero_bubble_orders("zb-h1", num_ranks, num_microbatches), recompute
    )


@register("zb-h2", inflight=lambda pp, m, chunks, waves: [min(2 * pp - 1, m)] * pp, split_backward=True)
def zb_h2(num_ranks: int, num_microbatches: int, recompute: int = 0) -> Schedule:
    """Zero Bubble's ZB-H2 (Qi et al. 2.2): 2(P-r-1) warm-up forwards on rank r, W 2r backwards late.

    The layout is a parallelogram: bubble (p-1)(T_F + T_B - 2T_W) inside each rank's span, zero when
    T_F + T_B = 2 T_W, at 2P - 1 stashes (about twice 1F1B's). A synchronous step adds the staggered
    start and end (``SimResult.span_bubble`` against ``step_time``, docs/schedules.md).
    """
    return _zero_bubble(
        "zb-h2", num_microbatches, range(num_ranks), zero_bubble_orders("zb-h2", num_ranks, num_microbatches), recompute
    )


@register("zbv", inflight=lambda pp, m, c, w: [min(2 * pp, 2 * m)] * pp, v_shape=True, split_backward=True)
def zbv(num_ranks: int, num_microbatches: int, recompute: int = 0) -> Schedule:
    """Zero Bubble's ZB-V (Qi et al. 6): two chunks per rank in a V, F-B-W groups; zero bubble inside each
    rank's span when T_F = T_B = T_W, at 1F1B's peak activation memory."""
    P, M = num_ranks, num_microbatches
    return _zero_bubble("zbv", M, stage_ranks(P, waves=1), zbv_orders(P, M), recompute)


@register("dualpipev", inflight=lambda pp, m, c, w: [2 * pp + 1] * pp, v_shape=True, split_backward=True)
def dualpipev(num_ranks: int, num_microbatches: int, recompute: int = 0) -> Schedule:
    """DeepSeek's DualPipeV (DualPipe cut in half): the V placement, forward of one chunk beside the whole
    backward of the other in the steady state, split backwards at both ends; needs M >= 2P."""
    P, M = num_ranks, num_microbatches
    return _zero_bubble("dualpipev", M, stage_ranks(P, waves=1), dualpipev_orders(P, M), recompute)


__all__ = [
    "SCHEDULES",
    "ScheduleKind",
    "inflight_per_rank",
    "inflight_per_stage",
    "make_replay",
    "make_schedule",
    "register",
    "schedule_kind",
    "splits_backward",
]
