"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV): the papers' bubbles, soundness, memory, B/W in lists.

Every cost is a Fraction, so each equality is exact. T_F, T_B, T_W are one microbatch's forward,
input-gradient and weight-gradient times on one stage (``Costs.tb`` is the whole backward T_B + T_W,
``Costs.tw`` is T_W). Single process, about 10 s.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from fractions import Fraction
from functools import cache

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.execute.split_backward import deferring_weights, run_backward
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import P2P_KINDS, Action, B, F, Kind, Schedule, W
from autopar.schedule.formulas import dualpipev_equal, paper_bubble, zb_h1, zb_h2
from autopar.schedule.generators import SCHEDULES, make_schedule
from autopar.schedule.simulator import simulate
from autopar.schedule.timeline import SimResult
from autopar.search.space import SearchSpace

ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv", "dualpipev")
MINIMUM_M = {  # the fewest microbatches each schedule's published bubble needs
    "zb-h1": lambda p: p,
    "zb-h2": lambda p: 2 * p - 1,
    "zbv": lambda p: 2 * p - 1,
    "dualpipev": lambda p: 2 * p,
}
times = st.fractions(min_value=Fraction(1, 4), max_value=4, max_denominator=4)


@cache
def schedule(name: str, p: int, m: int) -> Schedule:
    return make_schedule(name, p, m)  # building one is most of a simulation's cost; they are immutable


def run(name: str, p: int, m: int, tf, tb, tw, share: bool = False) -> SimResult:
    """Simulate ``name`` with T_F, T_B, T_W per stage (``share``: per rank share, split over its stages)."""
    s = schedule(name, p, m)
    if share:
        return simulate(s, Costs.from_rank_share(s, tf=tf, tb=tb + tw, tw=tw))
    return simulate(s, Costs.uniform(s.num_stages, tf=tf, tb=tb + tw, tw=tw))


def sync_bubble(r: SimResult) -> Fraction:
    return r.step_time - max(r.busy)  # type: ignore[return-value]


# ---- the papers' bubbles ----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), extra=st.integers(0, 4), tf=times, tb=times, tw=times)
def test_zb_h1_bubble_is_p_minus_1_times_tf_plus_tb_minus_tw(p, extra, tf, tb, tw) -> None:
    """Qi et al. Table 2: (p-1)(T_F + T_B - T_W), step time minus compute, for m >= p when T_W <= T_F, T_B
    (the paper's T_W < T_F < T_B); beyond that the simulator gives (p-1)(T_F + T_B - min(T_F, T_B, T_W))."""
    r = run("zb-h1", p, p + extra, tf, tb, tw)
    if tw <= min(tf, tb):
        assert sync_bubble(r) == zb_h1(p, tf, tb, tw)
    assert sync_bubble(r) == (p - 1) * (tf + tb - min(tf, tb, tw))


def test_zb_h1_formula_needs_its_condition_and_beats_1f1b() -> None:
    """The condition is not vacuous: T_W > T_F leaves (p-1) T_B; and 1F1B pays (p-1)(T_F + T_B + T_W)."""
    r = run("zb-h1", 4, 8, 1, 1, 2)
    assert sync_bubble(r) == 3 != zb_h1(4, 1, 1, 2)
    one = simulate(make_schedule("1f1b", 4, 8), Costs.uniform(4, tf=1, tb=2))
    assert sync_bubble(one) == 3 * 3 and sync_bubble(run("zb-h1", 4, 8, 1, 1, 1)) == 3


@settings(max_examples=30, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), extra=st.integers(0, 4), tf=times, tb=times, tw=times)
@example(p=4, extra=1, tf=Fraction(1), tb=Fraction(1), tw=Fraction(1))  # the paper's Fig. 3: zero
def test_zb_h2_bubble_inside_each_span_is_p_minus_1_times_tf_plus_tb_minus_2tw(p, extra, tf, tb, tw) -> None:
    """Qi et al. Table 2: (p-1)(T_F + T_B - 2T_W) inside each rank's span (the parallelogram), for
    m >= 2p - 1 when T_W <= T_F and 2 T_W <= T_F + T_B; a synchronous step adds the staggered ends."""
    r = run("zb-h2", p, 2 * p - 1 + extra, tf, tb, tw)
    if tw <= tf and 2 * tw <= tf + tb:
        assert r.span_bubble == zb_h2(p, tf, tb, tw)
    assert sync_bubble(r) >= r.span_bubble >= 0


def test_zb_h2_reaches_zero_where_zb_h1_does_not_and_needs_enough_microbatches() -> None:
    assert run("zb-h2", 4, 7, 1, 1, 1).span_bubble == 0 < run("zb-h1", 4, 7, 1, 1, 1).span_bubble
    assert run("zb-h2", 4, 6, 1, 1, 1).span_bubble > 0  # m = 2p - 2: short of the minimum


@settings(max_examples=25, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), extra=st.integers(0, 4), t=times)
def test_zbv_and_dualpipev_at_equal_costs_are_the_published_values(p, extra, t) -> None:
    """T_F = T_B = T_W = t per chunk: ZB-V has zero bubble inside each span (Qi et al. 6, m >= 2p - 1);
    DualPipeV (p - 1) t, DeepSeek's (PP/2-1)(F&B + B - 3W) (``formulas.dualpipev_equal``, m >= 2p)."""
    v = run("zbv", p, 2 * p - 1 + extra, t, t, t)
    assert v.span_bubble == 0
    d = run("dualpipev", p, 2 * p + extra, t, t, t)
    assert sync_bubble(d) == d.span_bubble == dualpipev_equal(p, t)


@settings(max_examples=25, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), extra=st.integers(0, 4), tf=times, tb=times, tw=times)
def test_zbv_and_dualpipev_are_never_above_zb_h1(p, extra, tf, tb, tw) -> None:
    """On the same work (costs of a rank's share, split over its two chunks), for any T_W <= T_F, T_B:
    both the step's bubble and the bubble inside the spans are at most ZB-H1's."""
    tw = min(tw, tf, tb)
    m = 2 * p + extra
    h1 = run("zb-h1", p, m, tf, tb, tw, share=True)
    for name in ("zbv", "dualpipev"):
        r = run(name, p, m, tf, tb, tw, share=True)
        assert sync_bubble(r) <= sync_bubble(h1) and r.span_bubble <= h1.span_bubble, name


def test_paper_bubble_matches_the_simulator_at_the_default_costs() -> None:
    """``paper_bubble`` (T_B = 2 T_F split evenly: T_F = T_B = T_W) equals the simulated ratio of its
    definition for every zero-bubble schedule at and above its minimum m."""
    for name in ZERO_BUBBLE:
        for p in (2, 4, 8):
            for m in (MINIMUM_M[name](p), 3 * p):
                s = schedule(name, p, m)
                r = simulate(s, Costs.from_rank_share(s, tf=1, tb=2))
                value, definition, _ = paper_bubble(name, p, m)  # type: ignore[misc]
                got = r.span_bubble / max(r.busy) if definition.startswith("span") else r.bubble_ratio
                assert got == value, (name, p, m)
    assert paper_bubble("zb-h2", 4, 6) is None and paper_bubble("dualpipev", 4, 7) is None


# ---- sound lists, each F, B and W once ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ZERO_BUBBLE), p=st.sampled_from([1, 2, 3, 4, 8]), m=st.integers(1, 20))
def test_every_list_is_sound_and_runs_each_f_b_w_once(name, p, m) -> None:
    if name == "dualpipev":
        m = max(m, 2 * p)
    s = schedule(name, p, m)
    costs = Costs.uniform(s.num_stages, tf=1, tb=2)
    simulate(s, costs)  # deadlock, a W before its B, F before its input, ... raise
    simulate(s, costs, p2p="batched")  # and no deadlock under blocking batched p2p either
    seen = Counter((a.kind, a.mb, a.stage) for lst in s.actions for a in lst)
    for stage in range(s.num_stages):
        for mb in range(m):
            assert seen[(Kind.F, mb, stage)] == seen[(Kind.B, mb, stage)] == 1
            assert seen[(Kind.W, mb, stage)] == (1 if name != "dualpipev" else seen[(Kind.W, mb, stage)])
            assert seen[(Kind.W, mb, stage)] <= 1
    for r, lst in enumerate(s.actions):  # the V's turns hand over locally: no p2p to oneself
        assert all(s.stage_to_rank[a.peer] != r for a in lst if a.kind in P2P_KINDS)
        computes = [a for a in lst if a.kind in (Kind.B, Kind.W)]
        last = {a.stage: i for i, a in enumerate(computes)}
        reduced = [a.stage for a in lst if a.kind is Kind.REDUCE_GRADS]
        assert reduced == sorted(last, key=last.__getitem__)  # after each stage's last W (or B)
    if name == "dualpipev":  # its steady state runs whole backwards, its ends split ones
        split = sum(n for (k, *_), n in seen.items() if k is Kind.W)
        assert 0 < split < s.num_stages * m


def test_dualpipev_refuses_too_few_microbatches() -> None:
    with pytest.raises(ScheduleError, match="at least 2P = 8 microbatches"):
        make_schedule("dualpipev", 4, 7)


def test_orders_read_like_the_papers() -> None:
    """ZB-H1 and ZB-H2 on P = 4, M = 8, rank 1, as Qi et al. Fig. 3 draws them; ZB-V and DualPipeV hold
    stage r and 2P-1-r on rank r (the V) and start as the papers describe."""
    h1 = [str(a) for a in make_schedule("zb-h1", 4, 8).actions[1] if a.kind in (Kind.F, Kind.B, Kind.W)]
    assert " ".join(a.split()[0] + a.split()[1][3:] for a in h1) == (
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7"
    )
    h2 = [str(a) for a in make_schedule("zb-h2", 4, 8).actions[1] if a.kind in (Kind.F, Kind.B, Kind.W)]
    assert " ".join(a.split()[0] + a.split()[1][3:] for a in h2) == (
        "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7"
    )
    for name in ("zbv", "dualpipev"):
        s = make_schedule(name, 4, 8)
        assert [s.stages_of_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    bottom = [a for a in make_schedule("zbv", 4, 8).actions[3] if a.kind in (Kind.F, Kind.B, Kind.W)]
    assert bottom[:2] == [F(0, 3), F(0, 4)]  # the V's turn: stage 3 hands over to stage 4 on rank 3


# ---- memory ----------------------------------------------------------------------------------------------


def test_activation_memory_counts_until_w() -> None:
    """A microbatch-stage stays stashed until its W: ZB-H1 holds P on every rank (1F1B's rank 0 peak),
    ZB-H2 2P - 1, ZB-V 2P chunk stashes (P shares: 1F1B's peak, balanced), DualPipeV 2P + 1 (DeepSeek's
    PP + 1). In bytes of a rank's share, ZB-V peaks where 1F1B's rank 0 does; a split B's ``w_bytes``
    live until its W."""
    p, m = 4, 12
    assert run("zb-h1", p, m, 1, 1, 1).peak_activations == [p] * p
    assert run("zb-h2", p, m, 1, 1, 1).peak_activations == [2 * p - 1] * p
    assert run("zbv", p, m, 1, 1, 1).peak_activations == [2 * p] * p
    assert run("dualpipev", p, m, 1, 1, 1).peak_activations == [2 * p + 1] * p
    one = simulate(make_schedule("1f1b", p, m), Costs.uniform(p, act_bytes=1))
    v = make_schedule("zbv", p, m)
    peak = simulate(v, Costs.from_rank_share(v, act_bytes=1)).peak_activation_bytes
    assert peak == [max(one.peak_activation_bytes)] * p  # type: ignore[arg-type]
    # one stage, one microbatch: F stashes 4, B adds 1 (the output gradients W needs), W frees both
    lone = Schedule(1, 1, 1, (0,), ((F(0, 0), B(0, 0), W(0, 0), Action(Kind.REDUCE_GRADS, 0), Action(Kind.STEP)),))
    r = simulate(lone, Costs.uniform(1, tf=1, tb=3, tw=1, act_bytes=4, w_bytes=1))
    assert r.peak_activation_bytes == [5] and r.peak_activations == [1]
    assert [e.end - e.start for e in r.timeline[0][:3]] == [1, 2, 1]  # a split B costs tb - tw


REDUCE, STEP = Action(Kind.REDUCE_GRADS, 0), Action(Kind.STEP)


@pytest.mark.parametrize(
    "actions,match",
    [
        ((F(0, 0), W(0, 0), B(0, 0), REDUCE, STEP), "weight gradients before the B"),
        ((F(0, 0), B(0, 0), W(0, 0), W(0, 0), REDUCE, STEP), "second W"),
        ((F(0, 0), B(0, 0), REDUCE, W(0, 0), STEP), "before every backward"),
        ((F(0, 0), B(0, 0), REDUCE, STEP), None),  # without a W the B is the whole backward
    ],
)
def test_unsound_weight_passes_are_rejected(actions: tuple[Action, ...], match: str | None) -> None:
    s = Schedule(1, 1, 1, (0,), (actions,))
    if match is None:
        simulate(s, Costs.uniform(1))
        return
    with pytest.raises(ScheduleError, match=match):
        simulate(s, Costs.uniform(1))


def test_w_round_trips_through_text_and_costs_refuse_a_weight_part_above_the_backward() -> None:
    s = make_schedule("zbv", 2, 4)
    assert Schedule.from_text(s.to_text()) == s and "W mb=0 stage=3" in s.to_text()
    with pytest.raises(ScheduleError, match="tw"):
        Costs.uniform(2, tb=1, tw=2)


def test_zbv_and_dualpipev_orders_equal_torchs() -> None:
    """The F/B/W order of every rank equals what torch.distributed.pipelining's ScheduleZBVZeroBubble and
    ScheduleDualPipeV compute (their per-rank order functions, read without process groups); torch's
    overlapped forward+backward is our F then a whole B, its BACKWARD_INPUT a B that a W follows."""
    from types import SimpleNamespace

    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    names = {ts.FORWARD: "F", ts.BACKWARD_INPUT: "I", ts.FULL_BACKWARD: "B", ts.BACKWARD_WEIGHT: "W"}

    def theirs(cls, p: int, m: int, r: int) -> list[tuple[str, int, int]]:
        owner = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        out = []
        for a in cls._calculate_single_rank_operations(owner, r):
            for x in a.sub_actions if a is not None and a.computation_type == ts.OVERLAP_F_B else [a]:
                if x is not None:
                    out.append((names[x.computation_type], x.microbatch_index, x.stage_index))
        return out

    def ours(s: Schedule, r: int) -> list[tuple[str, int, int]]:
        lst = [a for a in s.actions[r] if a.kind in (Kind.F, Kind.B, Kind.W)]
        split = {(a.mb, a.stage) for a in lst if a.kind is Kind.W}
        return [("I" if a.kind is Kind.B and (a.mb, a.stage) in split else a.kind.value, a.mb, a.stage) for a in lst]

    for p in (2, 3, 4):
        for m in range(1, 3 * p + 1):
            for name, cls in (("zbv", ts.ScheduleZBVZeroBubble), ("dualpipev", ts.ScheduleDualPipeV)):
                if name == "dualpipev" and m < 2 * p:
                    continue
                s = schedule(name, p, m)
                assert all(ours(s, r) == theirs(cls, p, m, r) for r in range(p)), (name, p, m)


# ---- the split backward itself ----------------------------------------------------------------------------


class _Branchy(torch.nn.Module):
    """Linears, a layer norm, a weight used twice (once on the other's input path), and an output no input
    reaches: every case ``split_backward`` distinguishes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)
        self.shared, self.pos = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))) @ self.shared
        return torch.tanh(y) @ self.shared.t() + self.pos, self.pos * 2


def _gradients(model: torch.nn.Module, x: torch.Tensor, split: bool, run_w: bool = True):
    x = x.clone().requires_grad_(True)
    y, z = model(x)
    pairs = [(y, torch.full_like(y, 0.3)), (z, torch.ones_like(z))]
    todo, node = [y.grad_fn], None
    while node is None:  # the GELU's backward: on the input path only
        n = todo.pop()
        node = n if n.name().startswith("Gelu") else None
        todo += [c for c, _ in n.next_functions if c is not None]
    runs: list[str] = []
    node.register_prehook(lambda g: runs.append("gelu"))
    if not split:
        torch.autograd.backward(*zip(*pairs))
        return x.grad, {n: p.grad for n, p in model.named_parameters()}, runs
    with deferring_weights() as pending:
        run_backward(*zip(*pairs))
    assert all(p.grad is None for p in model.parameters()), "B computed weight gradients"
    after_b = list(runs)
    if run_w:
        for w in pending:
            w.run()
    assert runs == after_b, "W ran a node of the input path again"
    return x.grad, {n: p.grad for n, p in model.named_parameters()}, runs


def test_split_backward_equals_the_whole_backward_and_runs_each_node_once() -> None:
    """B fills the input's gradient and no weight's; W then fills every weight's, equal to one whole backward
    (bit for bit here), without running the input path again (the GELU's backward ran once, in B)."""
    torch.manual_seed(0)
    model = _Branchy().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    whole = _gradients(copy.deepcopy(model), x, split=False)
    split = _gradients(copy.deepcopy(model), x, split=True)
    assert torch.equal(whole[0], split[0]) and split[2] == ["gelu"]
    assert all(torch.equal(whole[1][n], split[1][n]) for n in whole[1])
    skipped = _gradients(copy.deepcopy(model), x, split=True, run_w=False)  # the check is not vacuous
    assert torch.equal(whole[0], skipped[0]) and all(g is None for g in skipped[1].values())


def test_split_backward_of_a_generated_stage() -> None:
    """A stage GraphModule codegen made (tiny GPT-2's second stage, float64): the received activation's
    gradient after B and every parameter's after W equal a whole backward's."""
    from autopar.models.resolve import build
    from autopar.passes.assign_stages import assign_stages
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.prune import prune_outputs
    from autopar.passes.stage_program import stage_program
    from autopar.passes.transfers import insert_transfers
    from autopar.runtime.build.codegen import codegen
    from autopar.runtime.execute.stage_runner import Part

    spec = build("tiny-gpt2", device="cpu", seed=0)
    model = spec.model.double()
    kw = {k: v[:2] for k, v in spec.kwargs.items()}
    prog = insert_transfers(assign_stages(prune_outputs(lower(capture(model, (), kw))), 2)[0])
    first, second = stage_program(prog, 0), stage_program(prog, 1)
    named = dict(model.named_parameters(remove_duplicate=False))
    env: dict[str, torch.Tensor] = dict(kw)
    sent = Part.of(codegen(first.program, {}, lambda n: named[n]), first.program)(env)
    results = []
    for split in (False, True):
        gm = codegen(second.program, {}, lambda n: named[n].detach())
        params, stage = dict(gm.named_parameters()), Part.of(gm, second.program)
        leaves = {v.name: t.detach().clone().requires_grad_(t.is_floating_point()) for v, t in zip(second.recv, sent)}
        loss = stage({**env, **leaves})[0]
        with deferring_weights() if split else contextlib.nullcontext() as pending:
            run_backward([loss], [torch.ones_like(loss)])
        if split:
            assert all(p.grad is None for p in params.values())
            for w in pending:
                w.run()
        results.append(([t.grad for t in leaves.values() if t.grad is not None], params))
    (x0, p0), (x1, p1) = results
    assert x0 and all(torch.allclose(a, b, rtol=1e-13, atol=0) for a, b in zip(x0, x1))
    trained = [n for n, p in p0.items() if p.grad is not None]
    assert trained and all(torch.allclose(p0[n].grad, p1[n].grad, rtol=1e-13, atol=1e-300) for n in trained)


# ---- the search -------------------------------------------------------------------------------------------


def test_the_search_prices_zero_bubble_and_picks_the_v_when_memory_allows() -> None:
    """A 16-layer GPT on pp=4 x dp=2: with memory to spare the search's best plans are the V schedules
    (DualPipeV, then ZB-V: the smallest bubbles); a budget below DualPipeV's price but above ZB-V's
    picks ZB-V; one below ZB-V's picks a schedule with 1F1B's memory. Memory is priced with each
    schedule's in-flight count (a microbatch counted until its W), the step by simulating its lists
    with the weight-gradient part of each backward as W."""
    from autopar.search import search
    from autopar.solver.cluster.spec import ClusterSpec
    from tests.test_search import gpt_profile

    prof, cluster = gpt_profile(layers=16, V=8192), ClusterSpec.load("dgx-a100:nodes=1")
    space = SearchSpace(pp=(4,), dp=(2,), tp=(1,), zero=(1,), recompute=("none",), mics=False, micro_batch=(1,))
    best = search(prof, cluster, 32, space=space, top=20).best
    by_name = {e.candidate.schedule: e for e in reversed(best)}  # each schedule's fastest plan
    assert [e.candidate.schedule for e in best[:2]] == ["dualpipev", "zbv"]
    assert by_name["zbv"].bubble < by_name["zb-h1"].bubble < by_name["1f1b"].bubble
    assert by_name["zbv"].info["inflight"] == [8.0] * 4 and by_name["zb-h1"].info["inflight"] == [4.0] * 4
    assert by_name["zbv"].memory < by_name["dualpipev"].memory
    budget = (by_name["zbv"].memory + by_name["dualpipev"].memory) / 2
    assert search(prof, cluster, 32, budget, space=space).best[0].candidate.schedule == "zbv"
    tight = search(prof, cluster, 32, by_name["zbv"].memory * 0.99, space=space).best[0]
    assert tight.candidate.schedule not in ("zbv", "dualpipev") and tight.memory < by_name["zbv"].memory


# ---- memory and layout as the planners price them ----------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(ZERO_BUBBLE), p=st.sampled_from([2, 3, 4]), extra=st.integers(0, 5), act=times, grad=times)
def test_stash_points_price_the_simulated_peak_with_w_kept_gradients(name, p, extra, act, grad) -> None:
    """The search prices a zero-bubble rank's activation memory at the worst of its (stashed, awaiting W)
    points: equal to the simulator's peak bytes for any stash and W-kept gradient sizes."""
    from autopar.schedule.actions import stash_points

    sched = schedule(name, p, max(2 * p, p + extra))
    peak = simulate(sched, Costs.uniform(sched.num_stages, act_bytes=act, w_bytes=grad)).peak_activation_bytes
    priced = [max(n * act + k * grad for n, k in stash_points(sched.actions[r])) for r in range(p)]
    assert priced == peak


def _analytic(wgrad: float, cluster: str = "dgx-a100:nodes=1"):
    """The search's price of a 16-layer GPT (pp=4 x dp=2) whose layers keep ``wgrad`` bytes per sample from B to W."""
    import dataclasses

    from autopar.search.price import Analytic
    from autopar.solver.cluster.spec import ClusterSpec
    from tests.test_search import gpt_profile

    prof = gpt_profile(layers=16, V=8192)
    units = tuple(dataclasses.replace(u, wgrad_tp=wgrad) if u.kind == "layer" else u for u in prof.units)
    prof = dataclasses.replace(prof, units=units)
    return Analytic(prof, ClusterSpec.load(cluster), 32, precision="fp32"), prof


def test_the_price_of_zb_h2_zb_h1_and_1f1b_memory_and_the_w_kept_gradients() -> None:
    """Per rank r of P: ZB-H1 keeps P stashes (1F1B P - r) and r + 1 microbatches' W-kept gradients at
    its peak; ZB-H2 2P - 1 stashes and 2r + 1 gradients; the gradients are the layers' weight-op outputs.
    Without them (wgrad = 0) the schedules differ by the stashes alone."""
    from autopar.search.space import Candidate

    P, b = 4, 1
    wg = 1e6
    an, prof = _analytic(wg)
    plain, _ = _analytic(0.0)
    mem, kept, grads = {}, {}, {}
    for name in ("1f1b", "zb-h1", "zb-h2"):
        c = Candidate(pp=P, dp=2, tp=1, micro_batch=b, microbatches=8, schedule=name, zero=1)
        e, e0 = an.evaluate(c), plain.evaluate(c)
        assert e is not None and e0 is not None
        mem[name], kept[name] = e.rank_memory, e.info["act_kept"]
        # what a stage keeps from B to W: its layers' weight-op outputs, per microbatch
        grads[name] = [wg * b * sum(u.kind == "layer" for u in prof.units[a:z]) for a, z in e.stages]
        if name == "1f1b":
            assert e.rank_memory == e0.rank_memory  # no split backward: nothing kept for a W
    for r in range(P):
        a, g = kept["1f1b"][r], grads["1f1b"][r]
        assert mem["zb-h1"][r] - mem["1f1b"][r] == pytest.approx(r * a + (r + 1) * g, rel=1e-12)
        assert mem["zb-h2"][r] - mem["zb-h1"][r] == pytest.approx((P - 1) * a + r * g, rel=1e-12)


def test_the_price_of_zero3_under_a_split_backward_gathers_again_at_w() -> None:
    """ZeRO-3 with a split backward: W gathers the stage's weights again and reduce-scatters the
    gradient, so the whole backward costs one gather (the forward's) more than 1F1B's, all of it
    in W apart from B's own gather. On gloo, where every collective waits for the compute (on NCCL the prefetch
    hides part of each: tests/test_search.py)."""
    from autopar.search.space import Candidate

    an, _ = _analytic(0.0, "dgx-a100:nodes=1,backend=gloo")

    def ev(name: str, zero: int):
        return an.evaluate(Candidate(pp=4, dp=2, tp=1, micro_batch=1, microbatches=8, schedule=name, zero=zero))

    one, one3, zb, zb3 = ev("1f1b", 1), ev("1f1b", 3), ev("zb-h1", 1), ev("zb-h1", 3)
    gather = [a - b for a, b in zip(one3.tf, one.tf)]  # the forward's gather
    both = [a - b for a, b in zip(one3.tb, one.tb)]  # the whole backward's gather and scatter
    assert all(g > 0 for g in gather) and all(x > g for x, g in zip(both, gather))
    assert [a - b for a, b in zip(zb3.tb, zb.tb)] == pytest.approx([x + g for x, g in zip(both, gather)], rel=1e-12)
    assert [a - b for a, b in zip(zb3.tw, zb.tw)] == pytest.approx(both, rel=1e-12)


def _rank_max(w, layout, pp) -> float:
    loads = [sum(w[a:b]) for a, b in layout]
    return max(loads[r] + loads[2 * pp - 1 - r] for r in range(pp))


@settings(max_examples=60, deadline=None)
@given(pp=st.sampled_from([1, 2, 3]), w=st.lists(st.sampled_from([0.5, 1, 2, 3, 5, 8, 13]), min_size=2, max_size=9))
def test_the_v_layout_balances_each_rank_as_brute_force(pp, w) -> None:
    """The search's V layout (rank r: stages r and 2P - 1 - r) has the least largest rank load, and among
    those the least largest stage, of every cut into 2P contiguous stages."""
    import itertools

    from autopar.search.stage_layout import balanced_v_layout

    n = len(w)
    lay = balanced_v_layout(w, pp)
    if 2 * pp > n:
        assert lay is None
        return
    assert lay is not None and lay[0][0] == 0 and lay[-1][1] == n and all(a < b for a, b in lay)
    assert all(lay[s][1] == lay[s + 1][0] for s in range(2 * pp - 1))
    best = min(
        (_rank_max(w, cut, pp), max(sum(w[a:b]) for a, b in cut))
        for c in itertools.combinations(range(1, n), 2 * pp - 1)
        for cut in [list(zip((0, *c), (*c, n)))]
    )
    got = (_rank_max(w, lay, pp), max(sum(w[a:b]) for a, b in lay))
    assert got == pytest.approx(best, rel=1e-12)


def test_the_per_stage_layout_can_overload_a_rank_of_the_v() -> None:
    """Why the V has its own layout: balancing each stage can put two heavy stages on one rank."""
    from autopar.search.stage_layout import balanced_layout, balanced_v_layout

    w = [1, 1, 1, 2, 1]
    per_stage, per_rank = balanced_layout(w, 4), balanced_v_layout(w, 2)
    assert per_stage == ((0, 1), (1, 3), (3, 4), (4, 5))  # stages 1 and 2, both on rank 1, weigh 2 each
    assert per_rank == ((0, 2), (2, 3), (3, 4), (4, 5))
    assert (_rank_max(w, per_stage, 2), _rank_max(w, per_rank, 2)) == (4, 3)


def test_the_stage_balancer_prices_the_schedule_that_runs() -> None:
    """ZB-H1/H2 have 1F1B's shape and ZB-V/DualPipeV a wave's; the stage balancer counts their own
    in-flight microbatches (until W), from the flow's options down to the stage plan."""
    from autopar.passes.assign_stages import assign_stages_pass
    from autopar.schedule.generators import inflight_per_stage
    from tests.test_pipeline_split import preset

    assert inflight_per_stage(4) == [4, 3, 2, 1]
    assert inflight_per_stage(4, schedule="zb-h1") == [4] * 4
    assert inflight_per_stage(4, microbatches=8, schedule="zb-h2") == [7] * 4
    assert inflight_per_stage(4, waves=1, microbatches=8, schedule="zbv") == [4] * 8  # 2P per rank, two chunks
    assert inflight_per_stage(4, waves=1, microbatches=8) == [8] * 8  # a wave's own count
    _, prog, _ = preset("tiny-gpt2")
    plans = {}
    for name in (None, "zb-h2"):
        opts = {"pp": 2, "microbatches": 8} | ({"schedule": name} if name else {})
        _, (plans[name], _) = assign_stages_pass(prog, opts)
    assert [s.inflight for s in plans[None].stages] == [2, 1] and plans[None].schedule == "1f1b"
    assert [s.inflight for s in plans["zb-h2"].stages] == [3, 3] and plans["zb-h2"].schedule == "zb-h2"
    for s in plans["zb-h2"].stages:
        assert s.memory_bytes == s.weight_bytes + 3 * s.activation_bytes


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_the_flows_stage_balancer_predicts_each_ranks_peak_as_the_simulator(name: str) -> None:
    """Given the schedule's stash points (``schedule/actions.stage_stash_points``, as ``autopar/build.py`` passes
    them), the flow's balancer prices each rank's activations at its worst point: the stages' stashes plus
    the output gradients a split B keeps until W, a V rank's two stages together. Equal to the simulator's
    peak for the plan's own per-stage bytes; the W-kept gradients are not zero there (the in-flight count
    alone, what the balancer had before, is below the peak). Cost: ~1 s."""
    from autopar.passes.assign_stages import assign_stages_pass
    from autopar.schedule.actions import stage_stash_points
    from tests.test_pipeline_split import preset

    _, prog, _ = preset("tiny-gpt2")
    sched = make_schedule(name, 2, 8)
    points = tuple(tuple(stage_stash_points(lst)) for lst in sched.actions)
    opts = {"pp": 2, "microbatches": 8, "schedule": name, "stash_points": points}
    _, (plan, _) = assign_stages_pass(prog, opts | ({"waves": 1} if name == "zbv" else {}))
    assert plan.stage_to_rank == sched.stage_to_rank
    act = [s.activation_bytes for s in plan.stages]
    wkept = [s.wkept_bytes for s in plan.stages]
    assert all(w > 0 for w in wkept)
    peak = simulate(sched, Costs.uniform(sched.num_stages, act_bytes=act, w_bytes=wkept)).peak_activation_bytes
    weights = [sum(s.weight_bytes for s in plan.stages if s.rank == r) for r in range(2)]
    predicted = [m - w for m, w in zip(plan.rank_memory(), weights)]
    assert predicted == pytest.approx(peak, rel=1e-12)
    stashes = simulate(sched, Costs.uniform(sched.num_stages, act_bytes=act)).peak_activation_bytes
    assert all(a < b for a, b in zip(stashes, peak))


def test_the_simulator_charges_each_send_its_issue_time() -> None:
    """``Costs.t_send``: the sender is held while it issues a send (the runtime's fixed cost per message),
    its data leaving as it is posted. 1F1B on 2 ranks and 2 microbatches: rank 1 sends B0's gradient
    between B0 and F1, on the critical path (rank 0's B1 waits for F1, B1 of rank 1); no other send is:
    the step grows by one t_send. Without it the step is exactly the 1F1B one."""
    sched = make_schedule("1f1b", 2, 2)
    tc, ts = Fraction(1, 10), Fraction(1, 3)
    base = simulate(sched, Costs.uniform(2, tf=1, tb=2, tc=tc)).step_time
    assert base == 1 + tc + 1 + 2 + 1 + 2 + tc + 2  # F0, hop, F0, B0, F1, B1 on rank 1, hop, B1
    assert simulate(sched, Costs.uniform(2, tf=1, tb=2, tc=tc, t_send=ts)).step_time == base + ts


def test_the_simulator_charges_each_action_the_executors_own_time() -> None:
    """``Costs.t_action``: a compute action starts t_action after its rank is free and its data has arrived
    (the executor's own time comes after a wait too: waking, posting the channel's next receive,
    dispatch). 1F1B on 2 ranks and 2 microbatches (T_F = 1, T_B = 2, no transfer time), worked by hand:
    rank 0's F0 [a, 1+a], F1 [1+2a, 2+2a]; rank 1's F0 [1+2a, 2+2a], B0 [2+3a, 4+3a], F1 [4+4a, 5+4a],
    B1 [5+5a, 7+5a]; rank 0's B0 [4+4a, 6+4a], B1 [7+6a, 9+6a]: the step is 9 + 6 t_action, one t_action
    for each of the six actions on the critical path (rank 0's F0, rank 1's four, rank 0's B1)."""
    sched = make_schedule("1f1b", 2, 2)
    a = Fraction(1, 7)
    assert simulate(sched, Costs.uniform(2, tf=1, tb=2)).step_time == 9
    assert simulate(sched, Costs.uniform(2, tf=1, tb=2, t_action=a)).step_time == 9 + 6 * a


def test_stash_points_repeat_from_2p_microbatches_on() -> None:
    """The search reads a zero-bubble rank's memory off its order for min(m, 4P) microbatches: from 2P on
    the orders only repeat their steady state, so the points are those of any larger m."""
    from autopar.schedule.actions import stash_points
    from autopar.schedule.generators import zero_bubble_orders

    for name in ZERO_BUBBLE:
        for p in (2, 3, 5):
            ref = [stash_points(o) for o in zero_bubble_orders(name, p, 2 * p)]
            for m in (2 * p + 1, 4 * p, 7 * p + 3):
                assert [stash_points(o) for o in zero_bubble_orders(name, p, m)] == ref, (name, p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_stage_peaks_are_each_stages_most_stashed_point(name) -> None:
    """``actions.stage_peaks`` (what the search reads an interleaved rank's chunks by, ``price._stage_peaks``) is,
    per stage of each rank, the largest stashed count among ``stage_stash_points``' points, on every registered
    schedule and its options (a split B's stash kept until its W, recomputation, the V's two stages per rank)."""
    from autopar.schedule.actions import stage_peaks, stage_stash_points
    from tests.test_replay import _variants

    checked = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 8, 9):
            for opts in _variants(name):
                try:
                    sched = make_schedule(name, p, m, **opts)
                except ScheduleError:  # a shape the generator refuses (DualPipeV below 2P microbatches, ...)
                    continue
                for lst in sched.actions:
                    pts = stage_stash_points(lst)
                    assert stage_peaks(lst) == tuple(max(pt[i][0] for pt in pts) for i in range(len(pts[0])))
                    checked += 1
    assert checked >= 20


@settings(max_examples=200, deadline=None)
@given(st.sets(st.tuples(*[st.integers(0, 4)] * 3), max_size=40), st.booleans())
def test_frontier_is_the_points_nothing_else_covers(points, collide) -> None:
    """``actions._frontier`` (a sweep in decreasing order) against its definition, comparing every pair: the
    points no other point reaches or exceeds in every coordinate; with ``collide`` the coordinates drop the last
    entry, so distinct points can share them (and then cover each other)."""
    from autopar.schedule.actions import _frontier

    def flat(p):
        return p[:2] if collide else p

    def covers(q, p):
        return all(x >= y for x, y in zip(flat(q), flat(p)))

    assert _frontier(points, flat) == sorted(p for p in points if not any(q != p and covers(q, p) for q in points))
