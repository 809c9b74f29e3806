"""The simulator reproduces the papers' closed forms exactly and rejects unsound action lists.

All costs are ints or Fractions, so every equality below is exact.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from autopar.cli import main
from autopar.errors import ScheduleError
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import COMPUTE_KINDS, RECOMPUTE, Action, B, F, Kind, Schedule
from autopar.schedule.comm_actions import insert_comm_actions
from autopar.schedule.generators import make_schedule
from autopar.schedule.simulator import simulate

# ---- closed forms -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tf,tb", [(1, 2), (3, 5)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(name: str, tf: int, tb: int) -> None:
    """Megatron 2.2.1: equal stages, no transfer time: bubble / ideal compute = (p-1)/m, any t_b/t_f."""
    for P in (1, 2, 3, 4, 7):
        for M in sorted({1, 2, P - 1, P, P + 1, 2 * P, 3 * P + 1} - {0}):
            r = simulate(make_schedule(name, P, M), Costs.uniform(P, tf=tf, tb=tb))
            assert r.bubble_ratio == Fraction(P - 1, M)
            assert r.bubble_ratio_per_rank == [Fraction(P - 1, M)] * P
            assert r.idle_fraction == Fraction(P - 1, M + P - 1)  # Chimera/Hanayo's bubble / total


@pytest.mark.parametrize("tf,tb", [(1, 2), (1, 1), (3, 2)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(tf: int, tb: int) -> None:
    """Megatron 2.2.2: v chunks of t_f/v, t_b/v; m a multiple of p: (p-1)/(v m), any t_b/t_f."""
    for P in (2, 3, 4, 8) if (tf, tb) == (1, 2) else (2, 4):
        for v in (1, 2, 4):
            for M in (P, 2 * P, 3 * P):
                s = make_schedule("interleaved", P, M, chunks=v)
                r = simulate(s, Costs.from_rank_share(s, tf=tf, tb=tb))
                assert r.bubble_ratio == Fraction(P - 1, v * M), (P, v, M)


def test_interleaved_general_m_is_sound_but_not_the_formula() -> None:
    """M not a multiple of P works (Megatron refuses it); the short last group costs extra bubble."""
    s = make_schedule("interleaved", 4, 5, chunks=2)
    r = simulate(s, Costs.from_rank_share(s, tf=1, tb=2))
    assert Fraction(3, 10) < r.bubble_ratio < Fraction(3, 5)  # worse than (p-1)/(vm), better than 1F1B


def test_early_recomputation_bubble_is_3_s_minus_1_over_4m() -> None:
    """Merak 5.1, Fig. 3b: T_R = T_F, T_B = 2 T_F, recompute before the gradient arrives: 3(s-1)/(4m)."""
    for s in (2, 3, 4, 5, 8):
        for m in sorted({1, 2, s - 1, s, s + 1, 2 * s + 1}):
            r = simulate(make_schedule("1f1b", s, m, recompute=1), Costs.uniform(s, tf=1, tb=2, tr=1))
            assert r.bubble_ratio == Fraction(3 * (s - 1), 4 * m)


def test_shifted_critical_path_bubble_is_3_s_minus_2_over_4m() -> None:
    """Merak 5.1, Fig. 3c: same assumptions, m >= 3 (the penultimate stage needs a third forward)."""
    for s in (2, 3, 4, 5, 8):
        for m in sorted({3, 4, s - 1, s, s + 1, 2 * s + 1} - {0, 1, 2}):
            r = simulate(make_schedule("scp", s, m), Costs.uniform(s, tf=1, tb=2, tr=1))
            assert r.bubble_ratio == Fraction(3 * (s - 2), 4 * m), (s, m)
            assert max(r.busy) == 4 * m  # Merak's running time 4 m T_m (the last stage runs 3 m)
    # Fig. 3's own example: 4 stages, 5 microbatches
    assert simulate(make_schedule("scp", 4, 5), Costs.uniform(4, tr=1)).step_time == 26


def hanayo_formula(P: int, W: int) -> Fraction:
    """Hanayo Eq. (1) with T_B = 2 T_F and T_C = 0."""
    return Fraction(2 * P - 2, 3 * P * W + P - 1)


@pytest.mark.parametrize("P,W", [(2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (2, 2), (2, 4), (3, 2), (3, 3)])
def test_hanayo_wave_at_m_equal_p(P: int, W: int) -> None:
    """Hanayo 3.4 with its figures' microbatch count M = P, T_B = 2 T_F, T_C = 0 (T_F = model / P).

    The simulated per-rank bubble is (P-1) T_B / W: exactly the numerator of Eq. (1). Eq. (1)'s
    denominator, P(T_F + T_B) + (P-1) T_B / (2W), is the compute plus only *half* that bubble, so
    the paper's (2P-2)/(3PW+P-1) is bubble / (compute + bubble/2). The bubble / total time that
    section 3 describes is (2P-2)/(3PW+2P-2). docs/schedules.md has the derivation.
    """
    s = make_schedule("wave", P, P, waves=W)
    tf, tb = 1, 2
    r = simulate(s, Costs.from_rank_share(s, tf=tf, tb=tb))
    bubble = r.step_time - r.busy[0]
    assert r.busy == [P * (tf + tb)] * P
    assert bubble == Fraction((P - 1) * tb, W)
    assert r.idle_fraction == Fraction(2 * P - 2, 3 * P * W + 2 * P - 2)
    assert hanayo_formula(P, W) == bubble / (r.busy[0] + bubble / 2)


@pytest.mark.parametrize("P", [4, 6])
def test_hanayo_more_waves_smaller_bubble(P: int) -> None:
    """For P >= 4 and W >= 2 the list-scheduled wave is a stage-forward or two above (P-1) T_B / W;
    it still obeys the pipeline lower bound (P-1)(f+b) per rank and shrinks with W as Hanayo says."""
    previous = None
    for W in (1, 2, 3):
        s = make_schedule("wave", P, P, waves=W)
        r = simulate(s, Costs.from_rank_share(s, tf=1, tb=2))
        f, b = Fraction(1, 2 * W), Fraction(2, 2 * W)  # one stage's forward / backward
        bubble = r.step_time - r.busy[0]
        assert (P - 1) * (f + b) <= bubble <= Fraction((P - 1) * 2, W) + 2 * f
        assert previous is None or r.idle_fraction < previous
        previous = r.idle_fraction


def test_wave_reaches_the_interleaved_bound_for_more_microbatches() -> None:
    """With M = 2P and W = 1 the wave's bubble is (P-1)(f+b), Megatron's bound for v = 2 chunks."""
    for P in (2, 4, 8):
        s = make_schedule("wave", P, 2 * P, waves=1)
        assert simulate(s, Costs.from_rank_share(s, tf=1, tb=2)).bubble_ratio == Fraction(P - 1, 2 * 2 * P)


# ---- mechanics ----------------------------------------------------------------------------------


def test_transfer_time() -> None:
    """GPipe with a transfer time tc per boundary: (M+P-1)(tf+tb) + 2(P-1) tc."""
    for P, M in [(2, 1), (3, 4), (4, 8)]:
        r = simulate(make_schedule("gpipe", P, M), Costs.uniform(P, tf=2, tb=3, tc=Fraction(1, 2)))
        assert r.step_time == (M + P - 1) * 5 + 2 * (P - 1) * Fraction(1, 2)
        assert all(t.end - t.start == Fraction(1, 2) for t in r.transfers)
        assert len(r.transfers) == 2 * (P - 1) * M


def test_timeline_is_sequential_per_rank_and_charges_costs() -> None:
    s = make_schedule("scp", 4, 6, alpha1=Fraction(1, 3))
    costs = Costs.uniform(4, tf=[1, 2, 1, 3], tb=[2, 4, 2, 5], tr=[1, 2, 1, 3], tc=1)
    r = simulate(s, costs)
    for events in r.timeline:
        compute = [e for e in events if e.action.kind in (Kind.F, Kind.B, Kind.RECOMPUTE)]
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:]))
        for e in compute:
            st = e.action.stage
            want = {
                Kind.F: costs.tf[st],
                Kind.B: costs.tb[st],
                Kind.RECOMPUTE: costs.tr[st] * e.action.recompute,
            }
            assert e.end - e.start == want[e.action.kind]


def test_activation_bytes_with_recomputation() -> None:
    """1F1B rank 0 stashes P activations; with full recomputation P inputs plus one re-materialised."""
    P, M = 4, 8
    plain = simulate(make_schedule("1f1b", P, M), Costs.uniform(P, act_bytes=10, input_bytes=1))
    assert plain.peak_activation_bytes == [10 * (P - r) for r in range(P)]
    ckpt = simulate(make_schedule("1f1b", P, M, recompute=1), Costs.uniform(P, act_bytes=10, input_bytes=1))
    assert ckpt.peak_activation_bytes == [(P - r) * 1 + 10 for r in range(P)]
    assert ckpt.peak_activations == plain.peak_activations


def test_stage_aware_recomputation_equalises_memory() -> None:
    """Merak 5.2: alpha_i makes M_r + (s-i) alpha_i M_a equal across stages. With SCP the stages
    that recompute reach the same peak activation bytes; alpha_{s-1} = alpha_{s-2} is right because
    the penultimate stage stashes one microbatch more (its early third forward)."""
    s, m, act = 8, 16, 8
    sched = make_schedule("scp", s, m, alpha1=Fraction(1, 10))
    r = simulate(sched, Costs.uniform(s, tr=1, act_bytes=act))
    assert r.peak_activations == [8, 7, 6, 5, 4, 3, 3, 1]
    assert r.peak_activation_bytes == [Fraction(68, 5)] * (s - 1) + [act]  # 13.6 = act (1 + (s-1) alpha_1)


# ---- rejections ---------------------------------------------------------------------------------


def two_ranks(rank0: list[Action], rank1: list[Action], M: int = 1) -> Schedule:
    return Schedule(2, 2, M, (0, 1), (tuple(rank0), tuple(rank1)))


def S_ACT(mb: int, s: int) -> Action:
    return Action(Kind.SEND_ACT, s, mb, s + 1)


def R_ACT(mb: int, s: int) -> Action:
    return Action(Kind.RECV_ACT, s, mb, s - 1)


def S_GRAD(mb: int, s: int) -> Action:
    return Action(Kind.SEND_GRAD, s, mb, s - 1)


def R_GRAD(mb: int, s: int) -> Action:
    return Action(Kind.RECV_GRAD, s, mb, s + 1)


GOOD1 = [R_ACT(0, 1), F(0, 1), B(0, 1), S_GRAD(0, 1)]


def test_a_correct_hand_written_list_passes() -> None:
    s = two_ranks([F(0, 0), S_ACT(0, 0), R_GRAD(0, 0), B(0, 0)], GOOD1)
    assert simulate(s, Costs.uniform(2)).step_time == 6


@pytest.mark.parametrize(
    "rank0,rank1,match",
    [
        # rank 0 sends its activation only after its backward, which waits for rank 1: deadlock
        (
            [F(0, 0), R_GRAD(0, 0), B(0, 0), S_ACT(0, 0)],
            GOOD1,
            r"deadlock.*rank 0 at action 2 \(B mb=0 stage=0\).*rank 1 at action 1 \(F mb=0 stage=1\)",
        ),
        (
            [B(0, 0), F(0, 0)],
            [F(0, 1), B(0, 1)],
            r"rank 0 action 0 \(B mb=0 stage=0\): backward before its forward",
        ),
        (
            [F(0, 0), S_ACT(0, 0), R_GRAD(0, 0), B(0, 0)],
            [F(0, 1), B(0, 1), S_GRAD(0, 1)],
            r"rank 1 action 0 \(F mb=0 stage=1\): input from stage 0 on rank 0: no RECV_ACT",
        ),
        (
            [F(0, 0), S_ACT(0, 0), F(1, 0), S_ACT(1, 0), R_GRAD(0, 0), B(0, 0), R_GRAD(1, 0), B(1, 0)],
            [R_ACT(1, 1), R_ACT(0, 1), F(0, 1), B(0, 1), S_GRAD(0, 1), F(1, 1), B(1, 1), S_GRAD(1, 1)],
            r"rank 1 action 0 \(RECV_ACT mb=1 stage=1 peer=0\): pairs \(FIFO from rank 0\) with its action 1",
        ),
        ([F(0, 0, 1), S_ACT(0, 0), R_GRAD(0, 0), B(0, 0)], GOOD1, r"rank 0 action 3 .*before the RECOMPUTE"),
        ([F(0, 0), S_ACT(0, 0), R_GRAD(0, 0)], GOOD1, r"rank 0 never runs B\(mb=0, stage=0\)"),
        (
            [F(0, 0), S_ACT(0, 0), R_GRAD(0, 0), B(0, 0), Action(Kind.STEP)],
            GOOD1,
            r"rank 0 action 4 \(STEP\): optimizer step before REDUCE_GRADS",
        ),
        (
            [F(0, 0), S_ACT(0, 0), R_GRAD(0, 0), RECOMPUTE(0, 0), B(0, 0)],
            GOOD1,
            r"rank 0 action 3 \(RECOMPUTE mb=0 stage=0 recompute=1\): its forward checkpointed a fraction 0",
        ),
        (
            [F(0, 0, 1), S_ACT(0, 0), R_GRAD(0, 0), RECOMPUTE(0, 0), B(0, 0), RECOMPUTE(0, 0)],
            GOOD1,
            r"rank 0 action 5 \(RECOMPUTE .*\): recompute needs a stashed forward whose backward has not run",
        ),
    ],
)
def test_unsound_lists_are_rejected(rank0: list[Action], rank1: list[Action], match: str) -> None:
    M = 1 + max(a.mb or 0 for a in rank0 + rank1)
    with pytest.raises(ScheduleError, match=match):
        simulate(two_ranks(rank0, rank1, M), Costs.uniform(2))


def test_send_to_the_same_rank_and_unreceived_sends_are_rejected() -> None:
    # a wave's turn: stages 1 and 2 are both on rank 1; a send between them is an error
    local = Schedule(2, 3, 1, (0, 1, 1), ((F(0, 0), S_ACT(0, 0)), (R_ACT(0, 1), F(0, 1), S_ACT(0, 1), F(0, 2))))
    with pytest.raises(ScheduleError, match=r"rank 1 action 2 .*hand-over is local"):
        simulate(local, Costs.uniform(3))
    # rank 1 never posts the receive for rank 0's second send
    extra = two_ranks(
        [F(0, 0), S_ACT(0, 0), F(1, 0), S_ACT(1, 0)],
        [R_ACT(0, 1), F(0, 1)],
        M=2,
    )
    with pytest.raises(ScheduleError, match=r"rank 0 action 3 \(SEND_ACT mb=1 stage=0 peer=1\): no matching receive"):
        simulate(extra, Costs.uniform(2))


def receives_just_in_time(s: Schedule) -> Schedule:
    """The same compute orders with every receive right before its consumer (FIFO kept)."""
    compute = [[a for a in actions if a.kind in COMPUTE_KINDS] for actions in s.actions]
    lists = insert_comm_actions(compute, s.stage_to_rank, s.num_microbatches, post_ahead=False)
    return Schedule(s.num_ranks, s.num_stages, s.num_microbatches, s.stage_to_rank, lists)


def test_batched_mode_catches_cross_communication_deadlock() -> None:
    """Interleaved chunks wrap from rank P-1 back to rank 0, so two ranks send to each other. With
    receives posted just before their consumers the lists run under eager p2p but deadlock under
    blocking batched p2p: each rank blocks on a send whose receive the other posts one compute
    later. The generators' receive placement (autopar.schedule.comm_actions, rule 5) avoids exactly this."""
    s = make_schedule("interleaved", 2, 4, chunks=2)
    costs = Costs.from_rank_share(s)
    late = receives_just_in_time(s)
    assert simulate(late, costs).step_time == simulate(s, costs).step_time
    with pytest.raises(ScheduleError, match=r"deadlock.*waits for its batch's partners"):
        simulate(late, costs, p2p="batched")
    simulate(s, costs, p2p="batched")


# ---- command line -------------------------------------------------------------------------------


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_ratio"] == pytest.approx(3 / 8)
    assert out["step_time"] == pytest.approx(33)
    assert out["peak_activations"] == [4, 3, 2, 1]


def test_cli_simulates_the_zero_bubble_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    """``autopar simulate --schedule zb-h1|zb-h2|zbv|dualpipev``: ZB-H1's step is M (T_F + T_B) plus its closed-form
    bubble (p-1)(T_F + T_B - T_W) with T_B = T_W = 1 the input and weight halves of ``--tb 2``; the V schedules'
    bubble is no larger."""
    steps = {}
    for name in ("zb-h1", "zb-h2", "zbv", "dualpipev"):
        argv = ["simulate", "--schedule", name, "-P", "4", "-M", "8", "--tf", "1", "--tb", "2", "--tw", "1", "--json"]
        assert main(argv) == 0
        steps[name] = json.loads(capsys.readouterr().out)["step_time"]
    assert steps["zb-h1"] == pytest.approx(8 * 3 + 3 * (1 + 1 - 1))
    assert steps["zbv"] <= steps["zb-h1"] and steps["dualpipev"] <= steps["zb-h1"]


def test_cli_print_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--schedule",
        "wave",
        "--stages",
        "3",
        "--microbatches",
        "3",
        "--waves",
        "2",
        "--print",
    ]
    assert main(argv) == 0
    assert Schedule.from_text(capsys.readouterr().out) == make_schedule("wave", 3, 3, waves=2)


def test_cli_chart_and_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "gantt.png"
    argv = ["simulate", "--schedule", "interleaved", "-P", "4", "-M", "8", "--chunks", "2", "--tc", "1/10"]
    assert main([*argv, "--chart", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble ratio" in capsys.readouterr().out
    assert main(["simulate", "--schedule", "gpipe", "--waves", "2"]) == 2
    assert "--waves does not apply to the gpipe schedule" in capsys.readouterr().err


def test_simulate_a_plan_files_pipeline(tmp_path, capsys):
    """`autopar simulate --plan` runs the plan's schedule on its stage times: for 1F1B on two stages the
    step is t0 + t1 + (M - 1) max(t0, t1) with t_s a stage's forward plus backward per microbatch."""
    plan = tmp_path / "plan.json"
    assert (
        main(["plan", "tiny-gpt2", "--mesh", "pp=2,tp=2", "--microbatches", "4", "--no-baselines", "-o", str(plan)])
        == 0
    )
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stages = json.loads(plan.read_text())["pipeline"]["stage_plan"]["stages"]
    t = [st["compute_seconds"] + st["comm_seconds"] for st in stages]
    assert float(out["step_time"]) == pytest.approx(t[0] + t[1] + 3 * max(t), rel=1e-9)
