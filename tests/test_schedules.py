"""Schedule generators: sound lists for every P, M, v, W; right placement; documented memory bounds."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.api import parse_mesh
from autopar.cli import main as cli_main
from autopar.config import TrainConfig
from autopar.errors import ScheduleError
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.flow import FlowOptions, plan_program
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import P2P_KINDS, Action, Kind, Schedule
from autopar.schedule.generators import (
    SCHEDULES,
    gpipe,
    inflight_per_rank,
    make_schedule,
    register,
    stage_aware_ratios,
)
from autopar.schedule.placement import stage_ranks
from autopar.schedule.simulator import simulate


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """Any registered schedule with its options drawn too."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    P = draw(st.integers(1, 6))
    M = draw(st.integers(1, 12))
    options: dict[str, int | Fraction] = {}
    if name == "interleaved":
        options["chunks"] = draw(st.integers(1, 3))
    if name == "wave":
        options["waves"] = draw(st.integers(1, 3))
    if name in ("1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"):
        options["recompute"] = draw(st.integers(0, 1))
    if name == "scp":
        options["alpha1"] = draw(st.sampled_from([Fraction(0), Fraction(1, 10), Fraction(1, 3), Fraction(1)]))
    if name == "dualpipev":
        M = max(M, 2 * P)  # its minimum: one microbatch per stage
    return make_schedule(name, P, M, **options)


def stash_bound(s: Schedule, rank: int) -> int | None:
    """The peak stashed activations each generator's docstring promises for ``rank``."""
    P, M, opts = s.num_ranks, s.num_microbatches, dict(s.options)
    if s.name == "gpipe":
        return M
    if s.name == "1f1b":
        return min(P - rank, M)
    if s.name == "scp":
        return min(3 if rank == P - 2 else P - rank, M)
    if s.name == "interleaved":
        v = int(opts["chunks"])
        return min(2 * (P - rank - 1) + (v - 1) * P + 1, M * v)
    if s.name == "wave":
        return 2 * int(opts["waves"]) * min(int(opts["max_inflight"]), M)
    if s.name == "zb-h1":  # counted until each W: P on every rank (1F1B's rank 0)
        return min(P, M)
    if s.name == "zb-h2":
        return min(2 * P - 1, M)
    if s.name == "zbv":  # 2P half-share stashes: 1F1B's P shares
        return 2 * P
    if s.name == "dualpipev":  # DualPipe's PP + 1 chunks
        return 2 * P + 1
    return None  # a newly registered schedule: soundness is still checked


@settings(max_examples=80, deadline=None)
@given(schedules())
def test_generated_schedules_are_sound(s: Schedule) -> None:
    costs = Costs.uniform(s.num_stages, tf=1, tb=2, tr=1)
    # the simulator raises on deadlock, unmatched or mismatched p2p, B before F, F before its input
    eager = simulate(s, costs)
    simulate(s, costs, p2p="batched")  # and the lists cannot deadlock under blocking batched p2p
    # every microbatch has exactly one F and one B per stage, on the rank that holds the stage, and at
    # most one W: one for every B of the zero-bubble schedules but DualPipeV (whose steady state runs
    # whole backwards), none for the others
    seen = Counter((a.kind, a.mb, a.stage, r) for r, lst in enumerate(s.actions) for a in lst)
    split = s.name in ("zb-h1", "zb-h2", "zbv")
    for stage in range(s.num_stages):
        for mb in range(s.num_microbatches):
            for kind in (Kind.F, Kind.B):
                assert seen[(kind, mb, stage, s.stage_to_rank[stage])] == 1
            weights = seen[(Kind.W, mb, stage, s.stage_to_rank[stage])]
            assert weights == 1 if split else weights <= (s.name == "dualpipev")
    assert sum(n for (k, *_), n in seen.items() if k in (Kind.F, Kind.B)) == 2 * s.num_stages * s.num_microbatches
    # no send or receive between stages on the same rank: that hand-over is local
    for r, lst in enumerate(s.actions):
        assert all(s.stage_to_rank[a.peer] != r for a in lst if a.kind in P2P_KINDS)
        assert lst[-1] == Action(Kind.STEP)
    for r in range(s.num_ranks):
        bound = stash_bound(s, r)
        assert bound is None or eager.peak_activations[r] <= bound


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_text_round_trip(s: Schedule) -> None:
    text = s.to_text()
    assert Schedule.from_text(text) == s
    assert all(str(Action.parse(line)) == line.strip() for line in text.splitlines()[2:] if line.startswith(" "))


@pytest.mark.parametrize("P,M", [(1, 3), (4, 2), (4, 8), (5, 5)])
def test_documented_bounds_are_reached(P: int, M: int) -> None:
    """The bounds are tight where the papers say: GPipe stashes M everywhere, 1F1B P on rank 0."""
    costs = Costs.uniform(P)
    assert simulate(make_schedule("gpipe", P, M), costs).peak_activations == [M] * P
    assert simulate(make_schedule("1f1b", P, M), costs).peak_activations == [min(P - r, M) for r in range(P)]


def test_placements() -> None:
    s = make_schedule("interleaved", 4, 8, chunks=3)
    assert s.stage_to_rank == tuple(st % 4 for st in range(12))
    assert s.stages_of_rank(1) == [1, 5, 9]
    assert stage_ranks(3, waves=2) == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    w = make_schedule("wave", 3, 3, waves=2)
    assert w.stages_of_rank(0) == [0, 5, 6, 11] and w.stages_of_rank(2) == [2, 3, 8, 9]
    # the V's turns (2->3 on rank 2, 5->6 on rank 0, 8->9 on rank 2) carry no p2p at all
    local = {(2, 3), (5, 6), (8, 9)}
    p2p = {tuple(sorted((a.stage, a.peer))) for lst in w.actions for a in lst if a.kind in P2P_KINDS}
    assert p2p == {(s, s + 1) for s in range(11)} - local


def test_interleaved_rejects_bad_chunks_and_unknown_names() -> None:
    with pytest.raises(ScheduleError, match="chunks >= 1"):
        make_schedule("interleaved", 4, 8, chunks=0)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 4, 8)
    with pytest.raises(ScheduleError, match="at least one"):
        make_schedule("1f1b", 0, 8)


def test_stage_aware_ratios_follow_merak() -> None:
    """alpha_i = min(1, (s-1) alpha_1 / (s-i)) for 2 <= i < s-1, alpha_{s-1} = alpha_{s-2}, alpha_s = 1."""
    a = stage_aware_ratios(8, Fraction(1, 10))
    assert a == [Fraction(1, 10), Fraction(7, 60), Fraction(7, 50), Fraction(7, 40), Fraction(7, 30),
                 Fraction(7, 20), Fraction(7, 20), Fraction(1)]  # fmt: skip
    assert stage_aware_ratios(4, Fraction(1, 2)) == [Fraction(1, 2), Fraction(3, 4), Fraction(3, 4), 1]
    assert stage_aware_ratios(5, Fraction(1, 2))[2] == 1  # capped at 1
    with pytest.raises(ScheduleError):
        stage_aware_ratios(4, Fraction(3, 2))


def test_scp_recompute_flags() -> None:
    """Each F carries its stage's recompute fraction 1 - alpha_i; RECOMPUTE exists exactly when it is > 0."""
    s = make_schedule("scp", 6, 6, alpha1=Fraction(1, 10))
    ratios = stage_aware_ratios(6, Fraction(1, 10))
    for r, lst in enumerate(s.actions):
        fwd = {a.recompute for a in lst if a.kind is Kind.F}
        assert fwd == {1 - ratios[r]}
        recomputes = [a for a in lst if a.kind is Kind.RECOMPUTE]
        assert len(recomputes) == (6 if ratios[r] < 1 else 0)
    assert not any(a.kind is Kind.RECOMPUTE for a in s.actions[-1])  # the last stage never recomputes


def test_a_new_schedule_is_one_registered_function() -> None:
    """Adding a schedule is one decorated function: generation, simulation, the planner's pricing, the config
    and the command lines all read the one registry."""

    @register("gpipe-test-only")
    def reversed_backwards(num_ranks: int, num_microbatches: int) -> Schedule:
        base = gpipe(num_ranks, num_microbatches)
        return Schedule.from_text(base.to_text().replace("schedule gpipe", "schedule gpipe-test-only"))

    try:
        s = make_schedule("gpipe-test-only", 3, 4)
        assert s.name == "gpipe-test-only"
        assert simulate(s, Costs.uniform(3)).bubble_ratio == Fraction(2, 4)
        with pytest.raises(ValueError, match="twice"):
            register("gpipe-test-only")(reversed_backwards)
        # the planner prices it from the registry: in-flight counts off its own lists (no formula given),
        # the stage balance of a pp mesh, TrainConfig and the command lines
        assert inflight_per_rank("gpipe-test-only", 3, 4) == [4.0, 4.0, 4.0]
        spec = build("tiny-gpt2", device="meta")
        captured = capture(spec.model, spec.args, spec.kwargs)
        flow = FlowOptions(microbatches=4, stage_to_rank=s.stage_to_rank, schedule="gpipe-test-only", cache=False)
        assert [st.inflight for st in plan_program(captured, parse_mesh("pp=3"), flow).stage_plan.stages] == [4] * 3
        assert TrainConfig(schedule="gpipe-test-only").schedule == "gpipe-test-only"
        assert cli_main(["simulate", "--schedule", "gpipe-test-only", "--stages", "3", "--microbatches", "4"]) == 0
    finally:
        del SCHEDULES["gpipe-test-only"]
