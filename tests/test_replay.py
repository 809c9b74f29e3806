"""The search's timing-only replay of a schedule (``schedule/replay.py``) gives exactly what ``simulate`` gives:
per rank the end of its last compute action and its compute seconds, bit for bit, on every registered schedule."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from autopar.errors import ScheduleError
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import COMPUTE_KINDS, Kind, Schedule
from autopar.schedule.generators import SCHEDULES, make_replay, make_schedule
from autopar.schedule.replay import Replay
from autopar.schedule.simulator import simulate


def _variants(name: str) -> list[dict]:
    opts = SCHEDULES[name].options()
    if "chunks" in opts:
        return [{"chunks": 2}, {"chunks": 3}]
    if "waves" in opts:
        return [{"waves": 1}, {"waves": 2}]
    if "alpha1" in opts:
        return [{}, {"alpha1": Fraction(1, 2)}]
    if "recompute" in opts:
        return [{}, {"recompute": 1}]
    return [{}]


def _shapes(name: str):
    """(P, M, options, schedule) for 1-4 ranks, 1-9 microbatches and every option, where the generator accepts them."""
    for P in (1, 2, 3, 4):
        for M in (1, 2, 3, 5, 8, 9):
            for opts in _variants(name):
                try:
                    sched = make_schedule(name, P, M, **opts)
                except Exception:  # a shape the generator refuses (DualPipeV below 2P microbatches, ...)
                    continue
                yield P, M, opts, sched


def _costs(rng: random.Random, stages: int) -> Costs:
    tb = [rng.uniform(0.2, 4) for _ in range(stages)]
    return Costs.uniform(
        stages,
        tf=[rng.uniform(0.1, 2) for _ in range(stages)],
        tb=tb,
        tr=[rng.uniform(0.1, 2) for _ in range(stages)],
        tc=[rng.uniform(0, 0.5) for _ in range(stages - 1)] if stages > 1 else 0.0,
        tw=[b * rng.uniform(0.2, 0.8) for b in tb],
        t_send=rng.choice([0, 0.01]),
        t_action=rng.choice([0, 0.003]),
        t_reduce=[rng.uniform(0, 1) for _ in range(stages)],
        t_step=0.5,
    )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_replay_times_every_schedule_as_simulate_does(name):
    """Random float costs (transfers, per-send and per-action overheads, reduce and step included), every option
    the generator takes, 1-4 ranks, 1-9 microbatches: the replay's finish and busy equal ``simulate``'s exactly."""
    rng = random.Random(name)
    checked = 0
    for P, M, opts, sched in _shapes(name):
        replay = Replay(sched)
        if M == 5:  # the text form the schedule cache keeps times the same
            replay = Replay.from_text(replay.to_text())
        for _ in range(2):
            costs = _costs(rng, sched.num_stages)
            res = simulate(sched, costs)
            finish = [
                max((float(e.end) for e in evs if e.action.kind in COMPUTE_KINDS), default=0.0) for evs in res.timeline
            ]
            assert replay.run(costs) == (finish, list(res.busy)), (name, P, M, opts)
            checked += 1
    assert checked >= 12, checked


def test_replay_exact_with_fractions_and_refuses_what_never_arrives():
    """Fraction costs give the simulator's exact Fractions; a list waiting for a tensor nobody sends is refused by
    name (the replay is only for sound schedules: ``simulate`` names what is wrong)."""
    sched = make_schedule("1f1b", 3, 5)
    costs = Costs.uniform(sched.num_stages, tf=Fraction(1, 3), tb=Fraction(2, 3), tc=Fraction(1, 7))
    res = simulate(sched, costs)
    finish, busy = Replay(sched).run(costs)
    assert busy == list(res.busy) and all(isinstance(b, Fraction) for b in busy)
    assert finish == [max(float(e.end) for e in evs if e.action.kind in COMPUTE_KINDS) for evs in res.timeline]
    one = make_schedule("1f1b", 2, 1)  # rank 0 never sends microbatch 0's activation
    first = tuple(a for a in one.actions[0] if a.kind is not Kind.SEND_ACT)
    broken = Schedule(2, 2, 1, one.stage_to_rank, (first, one.actions[1]), "broken")
    with pytest.raises(ScheduleError, match="never sent"):
        Replay(broken)


def test_a_damaged_replay_text_is_refused_by_name():
    text = Replay(make_schedule("zbv", 2, 4)).to_text()
    for bad in ("", "schedule zbv ranks=2\n", text.replace("ranks=", "rank="), text[:-3] + "\n"):
        with pytest.raises(ScheduleError, match="replay"):
            Replay.from_text(bad)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_lists_with_receives_before_their_consumers_compile_to_the_same_replay(name):
    """What the search compiles (``make_schedule(post_ahead=False)``: no receive posted ahead, the lists not timed
    once to place them) is the same program as the schedule's own lists: the same ops and cost slots, every option,
    1-4 ranks, 1-9 microbatches; the lists themselves differ (the receives moved) wherever two ranks exchange. And
    ``make_replay`` (compiled straight from the compute orders, no transfer actions) is that program too."""
    checked = moved = 0
    for P, M, opts, sched in _shapes(name):
        unplaced = make_schedule(name, P, M, post_ahead=False, **opts)
        a, b, c = Replay(sched), Replay(unplaced), make_replay(name, P, M, **opts)
        assert (a.ops, a.recipe, a.num_sends) == (b.ops, b.recipe, b.num_sends), (name, P, M, opts)
        assert (c.ops, c.recipe, c.num_sends, c.num_ranks, c.num_stages) == (
            b.ops, b.recipe, b.num_sends, b.num_ranks, b.num_stages
        ), (name, P, M, opts)  # fmt: skip
        same = [sorted(map(str, lst)) for lst in sched.actions]
        assert same == [sorted(map(str, lst)) for lst in unplaced.actions]  # the same actions, moved only
        checked += 1
        moved += sched.actions != unplaced.actions
    assert checked >= 12 and (moved or name == "gpipe"), (checked, moved)  # GPipe's receives never move
