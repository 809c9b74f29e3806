"""Stage assignment (solver/stages/balance.py, passes/assign_stages.py): DP optimal against brute force, mappings,
in-flight counts, costs, plan, errors."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autopar.errors import NoLegalCutError, PipelineError, StageMemoryError, TooFewSubgraphsError
from autopar.ir.core import MeshSpec, Program
from autopar.ir.parser import parse
from autopar.models.resolve import build
from autopar.passes import pipeline_split as ps
from autopar.passes.assign_stages import assign_stages, assign_stages_pass
from autopar.passes.capture import capture
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.lower import lower
from autopar.schedule import placement as shape
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import stash_points
from autopar.schedule.generators import SCHEDULES, inflight_per_rank, inflight_per_stage, make_schedule
from autopar.schedule.simulator import simulate
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.stages import partition
from autopar.solver.stages.balance import balance_stages
from autopar.solver.stages.cost import StageContext, megatron_tp_comm_seconds
from autopar.solver.stages.plan import StagePlan, module_units

A100 = ClusterSpec.load("dgx-a100")


@functools.cache
def gpt2(mesh: MeshSpec | None = None) -> Program:
    """tiny-gpt2 (2 layers) captured on the meta device."""
    spec = build("tiny-gpt2", device="meta")
    return lower(capture(spec.model, spec.args, spec.kwargs), mesh)


def balance(prog: Program, split: ps.Split, pp: int, **kw) -> StagePlan:
    """The solver's balance of a split, with the program's common nodes as the pass gives them."""
    return balance_stages(prog, split, pp, commons=frozenset(ps.common_nodes(prog)), **kw)


# ---------------------------------------------------------------------------------------------
# The DP against brute force


Runs = Callable[[int, int, int], float]


def brute_force(n: int, stages: int, cost: Runs, fits: Callable[[int, int, int], bool]) -> tuple[float, float]:
    """(min over partitions of the max run cost, min sum of squares among the optimal ones)."""
    best, squares = math.inf, math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = (0, *cuts, n)
        runs = [(s, b[s], b[s + 1]) for s in range(stages)]
        if not all(fits(*r) for r in runs):
            continue
        worst, sq = max(cost(*r) for r in runs), sum(cost(*r) ** 2 for r in runs)
        if (worst, sq) < (best, squares):
            best, squares = worst, sq
    return best, squares


@st.composite
def instances(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 8))
    stages = draw(st.integers(1, n))
    times = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    acts = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    k = draw(st.lists(st.integers(1, 4), min_size=stages, max_size=stages))
    budget = draw(st.integers(0, 80))
    return n, stages, times, weights, acts, k, budget


@settings(max_examples=300, deadline=None)
@given(instances())
# a stage-dependent fit that a greedy longest-run feasibility check got wrong (item 5 fits stages 0 and 2 only)
@example((7, 3, [0] * 7, [0] * 7, [0, 0, 0, 0, 0, 1, 0], [1, 2, 1], 1))
def test_dp_equals_brute_force(inst):
    n, stages, times, weights, acts, k, budget = inst

    def cost(s, j, i):
        return sum(times[j:i])

    def fits(s, j, i):
        return sum(weights[j:i]) + k[s] * sum(acts[j:i]) <= budget

    best, starts = partition.min_max_partition(n, stages, cost, fits)
    want, want_sq = brute_force(n, stages, cost, fits)
    assert best == want
    assert partition.feasible(n, stages, fits) == (want < math.inf)
    if math.isinf(want):
        assert starts == []
        return
    assert len(starts) == stages and starts[0] == 0 and starts == sorted(set(starts))
    even = partition.even_partition(n, stages, cost, best, fits)
    runs = [(s, j, (even + [n])[s + 1]) for s, j in enumerate(even)]
    assert all(fits(*r) for r in runs)
    assert max(cost(*r) for r in runs) == want
    assert sum(cost(*r) ** 2 for r in runs) == want_sq


def test_plan_bottleneck_is_the_brute_force_optimum_on_a_real_model():
    prog = gpt2()
    split = ps.split_program(prog)
    one_each = balance(prog, split, len(split))  # stage i = subgraph i: its own time
    t = [s.seconds for s in one_each.stages]
    for pp in (2, 3, 4):
        plan = balance(prog, split, pp)
        want, _ = brute_force(len(t), pp, lambda s, j, i: sum(t[j:i]), lambda s, j, i: True)
        assert plan.bottleneck_seconds == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Mappings and in-flight microbatches


def test_interleaved_rank_r_holds_chunks_r_r_plus_p():
    assert shape.stage_ranks(4, chunks=2) == [0, 1, 2, 3, 0, 1, 2, 3]
    ranks = shape.stage_ranks(3, chunks=3)
    assert [s for s, r in enumerate(ranks) if r == 1] == [1, 4, 7]


def test_waves_are_v_shaped_with_2PW_stages():
    assert shape.stage_ranks(4, waves=1) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert shape.stage_ranks(2, waves=2) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert shape.num_stages(4, waves=3) == 24 == len(shape.stage_ranks(4, waves=3))


def test_inflight_formulas():
    assert inflight_per_stage(4) == [4, 3, 2, 1]
    assert inflight_per_stage(4, microbatches=2) == [2, 2, 2, 1]
    # interleaved: warm-up 2(p-r-1) + (v-1)p forwards plus one, spread over the rank's v chunks
    assert inflight_per_stage(2, chunks=2) == [2.5, 1.5, 2.5, 1.5]
    assert inflight_per_stage(2, waves=1) == [4, 4, 4, 4]
    assert inflight_per_stage(2, waves=1, microbatches=3) == [3, 3, 3, 3]


@pytest.mark.parametrize(("name", "options"), [("1f1b", {}), ("interleaved", {"chunks": 2}), ("wave", {"waves": 1})])
@pytest.mark.parametrize(("P", "M"), [(2, 4), (3, 6), (4, 8), (4, 3)])
def test_inflight_never_below_the_simulated_peak(name, options, P, M):
    sched = make_schedule(name, P, M, **options)
    peaks = simulate(sched, Costs.uniform(sched.num_stages)).peak_activations
    k = inflight_per_stage(P, options.get("chunks", 1), options.get("waves"), M)
    ranks = shape.stage_ranks(P, options.get("chunks", 1), options.get("waves"))
    assert tuple(ranks) == sched.stage_to_rank
    per_rank = [sum(k[s] for s in range(len(k)) if ranks[s] == r) for r in range(P)]
    assert all(mine >= sim for mine, sim in zip(per_rank, peaks))
    if name == "1f1b" or (name == "interleaved" and M % P == 0):  # exact; waves: an upper bound
        assert per_rank == list(peaks)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "wave", "scp", "zb-h1", "zb-h2", "zbv", "dualpipev"])
def test_every_registered_in_flight_count_bounds_the_lists(name):
    """The registry's closed forms (what the stage balance prices) never fall below the peaks counted off
    each schedule's own action lists, and equal them for the schedules whose formula is exact."""
    kind = SCHEDULES[name]
    for P, M in [(2, 4), (3, 6), (4, 8), (4, 3), (3, 1)]:
        if name == "dualpipev" and M < 2 * P:
            continue
        shape_opts = {"chunks": 2} if "chunks" in kind.options() else {}
        counted = [max(n for n, _ in stash_points(lst)) for lst in make_schedule(name, P, M, **shape_opts).actions]
        formula = inflight_per_rank(name, P, M, chunks=shape_opts.get("chunks", 1), waves=1 if kind.v_shape else None)
        assert all(f >= c for f, c in zip(formula, counted)), (P, M, formula, counted)
        if name in ("gpipe", "1f1b", "zb-h1"):
            assert formula == counted, (P, M)


def test_gpipe_stages_are_priced_with_every_microbatch_in_flight():
    """compile(schedule="gpipe") on a pp mesh balances its stages with GPipe's in-flight counts: every rank
    stashes all m microbatches. Before the one registry the solver's own list of schedules lacked gpipe, so
    the flow priced 1F1B's [4, 3, 2, 1] for 4 stages and 8 microbatches: up to 8x too few activations."""
    sched = make_schedule("gpipe", 4, 8)
    assert list(simulate(sched, Costs.uniform(4)).peak_activations) == [8] * 4
    assert inflight_per_stage(4, microbatches=8, schedule="gpipe") == [8] * 4
    spec = build("tiny-gpt2", device="meta")
    captured = capture(spec.model, spec.args, spec.kwargs)
    options = FlowOptions(microbatches=8, stage_to_rank=sched.stage_to_rank, schedule="gpipe", cache=False)
    gpipe = plan_program(captured, MeshSpec((("pp", 4),)), options).stage_plan
    assert [s.inflight for s in gpipe.stages] == [8] * 4
    for s in gpipe.stages:
        assert s.memory_bytes == pytest.approx(s.weight_bytes + 8 * s.activation_bytes)
    options = FlowOptions(microbatches=8, stage_to_rank=sched.stage_to_rank, schedule="1f1b", cache=False)
    one_f_one_b = plan_program(captured, MeshSpec((("pp", 4),)), options).stage_plan
    assert [s.inflight for s in one_f_one_b.stages] == [4, 3, 2, 1]


# ---------------------------------------------------------------------------------------------
# Costs


def test_tensor_parallel_comm_is_two_all_reduces_per_attention_and_mlp():
    prog = gpt2(MeshSpec((("tp", 2),)))
    split = ps.split_program(prog)
    ctx = StageContext(prog, A100, 1, 2, False, "bf16", 0.5)
    one = A100.collective_seconds("all_reduce", 64 * 64 * 2, 2, True)  # [b*s, h] in bf16
    got = [megatron_tp_comm_seconds(ctx, s) for s in split.subgraphs]
    assert got == [0.0, 2 * one, 2 * one, 2 * one, 2 * one, 0.0]
    no_tp = StageContext(gpt2(), A100, 1, 1, False, "bf16", 0.5)
    assert all(megatron_tp_comm_seconds(no_tp, s) == 0.0 for s in split.subgraphs)
    plan = balance(prog, split, 2)
    assert sum(s.comm_seconds for s in plan.stages) == pytest.approx(8 * one)
    assert sum(s.params for s in plan.stages) > 0


def test_stage_compute_memory_and_parameters():
    from autopar.solver.cluster import compute

    prog = gpt2()
    split = ps.split_program(prog)
    plan = balance(prog, split, 3, efficiency=0.4)
    total = sum(v.type.numel for v in prog.params)
    tied = next(v.type.numel for v in prog.params if v.name == "lm_head.weight")
    assert sum(s.params for s in plan.stages) == total + tied  # the tied embedding is on two stages
    assert [s.inflight for s in plan.stages] == [3, 2, 1]
    types, device, matmuls = prog.types(), compute.device_of(A100, 0.4), 0.0
    for s in plan.stages:
        ops = [op for sub in split.subgraphs[s.first : s.last + 1] for op in prog.ops[sub.start : sub.stop]]
        works = [compute.op_work(op, types, "bf16") for op in ops]
        assert s.compute_seconds == pytest.approx(3 * sum(compute.seconds(w, device) for w in works), rel=1e-12)
        # the constant efficiency replaces the curves: the matmuls run at 0.4 of the A100's 312 TFLOP/s
        mm = sum(w.flops for w in works if w.kind != "elementwise")
        assert 3 * mm / (312e12 * 0.4) <= s.compute_seconds
        matmuls += mm
        assert s.weight_bytes == 18 * s.params  # bf16: fp32 weight, grad, Adam moments (16) + the per-use bf16 copy
        assert s.memory_bytes == s.weight_bytes + s.inflight * s.activation_bytes
        assert s.activation_bytes > 0
    assert matmuls > 0
    assert plan.stage_of_subgraph == sorted(plan.stage_of_subgraph)
    assert [(s.first, s.last) for s in plan.stages][0][0] == 0 and plan.stages[-1].last == len(split) - 1
    assert plan.stages[0].modules[0] == "transformer.wte" and plan.stages[-1].modules[-1] == "lm_head"


def test_module_units_compress_layer_ranges():
    paths = ["transformer.wte", "transformer", "transformer.h.0.attn", "transformer.h.0"]
    paths += [f"transformer.h.{i}.mlp.c_fc" for i in range(1, 4)] + ["lm_head", ""]
    assert module_units(paths) == ("transformer.wte", "transformer.h.0-3", "lm_head")


# ---------------------------------------------------------------------------------------------
# The assign-stages pass, the plan's outputs and mappings


def test_assign_stages_annotates_stages_and_serializes():
    prog, plan, split = assign_stages(gpt2(), 2)
    assert split.seconds >= 0 and len(split) == 6 and plan.num_stages == 2 and plan.schedule == "1f1b"
    stages = [op.attrs["stage"] for op in prog.ops]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    first_use = {v.name: v.attrs.get("stage") for v in prog.inputs}
    assert first_use["lm_head.weight"] == 0 and first_use["labels"] == 1
    data = json.loads(plan.to_json())
    assert data["stage_to_rank"] == [0, 1] and data["num_subgraphs"] == 6
    assert data["stages"][1]["seconds"] == pytest.approx(plan.stages[1].seconds)
    text = plan.format()
    assert "balance max/mean" in text and "lm_head" in text
    assert plan.balance >= 1.0


def test_interleaved_and_wave_plans_map_stages_to_ranks():
    _, inter, _ = assign_stages(gpt2(), 2, chunks=2)
    assert inter.stage_to_rank == (0, 1, 0, 1) and inter.schedule == "interleaved"
    assert len(inter.rank_memory()) == 2
    assert inter.rank_memory()[0] == pytest.approx(inter.stages[0].memory_bytes + inter.stages[2].memory_bytes)
    _, wave, _ = assign_stages(gpt2(), 2, waves=1, microbatches=None)
    assert wave.stage_to_rank == (0, 1, 1, 0) and wave.schedule == "wave"
    assert [s.inflight for s in wave.stages] == [4, 4, 4, 4]
    _, one, _ = assign_stages(gpt2(), 2, waves=1)  # the default: one microbatch per step
    assert [s.inflight for s in one.stages] == [1, 1, 1, 1]


# ---------------------------------------------------------------------------------------------
# Errors


def test_more_stages_than_subgraphs_says_how_many_exist():
    with pytest.raises(TooFewSubgraphsError, match="only 6 subgraphs") as e:
        assign_stages(gpt2(), 7)
    assert e.value.num_subgraphs == 6
    with pytest.raises(TooFewSubgraphsError, match="pp <= 1 with waves=2"):
        assign_stages(gpt2(), 2, waves=2)
    with pytest.raises(PipelineError, match="not both"):
        assign_stages(gpt2(), 2, chunks=2, waves=1)
    with pytest.raises(PipelineError, match=">= 1"):
        assign_stages(gpt2(), 0)


def test_budget_too_small_reports_the_smallest_budget_and_pipeline():
    prog = gpt2()
    with pytest.raises(StageMemoryError, match="smallest budget") as e:
        assign_stages(prog, 2, budget_bytes=1000)
    need = e.value.smallest_budget_bytes
    _, plan, _ = assign_stages(prog, 2, budget_bytes=need)
    assert max(s.memory_bytes for s in plan.stages) == pytest.approx(need)
    with pytest.raises(StageMemoryError):
        assign_stages(prog, 2, budget_bytes=need * 0.999)
    with pytest.raises(StageMemoryError) as e3:
        assign_stages(prog, 3, budget_bytes=1000)
    budget3 = e3.value.smallest_budget_bytes
    assert budget3 < need  # deeper pipelines need less per device here
    with pytest.raises(StageMemoryError, match="smallest pipeline that fits is pp=3") as e2:
        assign_stages(prog, 2, budget_bytes=budget3)
    assert e2.value.smallest_pp == 3
    with pytest.raises(StageMemoryError, match="no deeper pipeline"):
        assign_stages(prog, 2, budget_bytes=1000)


NO_CUT = """mesh @m = []
param %w : f32[4,4] {}
%0, %1 : f32[2,4] {}, f32[2,4] {} = aten.split.Tensor(%w, 2)  # a | flops=8 bytes=128
%2 : f32[2,4] {} = aten.relu(%0)  # b | flops=8 bytes=64
%3 : f32[2,4] {} = aten.mul.Tensor(%2, %1)  # c | flops=8 bytes=96
output (%3,)
"""


def test_graph_with_no_legal_cut_names_what_crosses():
    prog = parse(NO_CUT)
    opts = ps.SplitOptions(max_crossing=1, cache=False)
    assert len(ps.split_program(prog, opts)) == 1
    with pytest.raises(NoLegalCutError, match="no legal cut.*%1 from op 0"):
        assign_stages(prog, 2, split_options=opts)
    _, plan, _ = assign_stages(prog, 1, split_options=opts)  # one stage is always fine
    assert plan.num_stages == 1


def test_the_pass_gives_what_assign_stages_gives():
    """assign_stages_pass (the assign-stages pass of the flow) gives what assign_stages gives, with the stage
    plan and the split's seconds as its report; pp=1 is one stage; it needs pp and refuses unknown options."""
    prog, plan, split = assign_stages(gpt2(), 3, microbatches=None)
    out, (report, seconds) = assign_stages_pass(gpt2(), {"pp": 3, "microbatches": None})
    assert out == prog.with_(attrs=dict(prog.attrs, pipeline_stages=3))
    assert report.stages == plan.stages and seconds >= 0
    one, (none, _) = assign_stages_pass(gpt2(), {"pp": 1})
    assert none is None and {op.attrs["stage"] for op in one.ops} == {0} and one.attrs["pipeline_stages"] == 1
    with pytest.raises(PipelineError, match="needs pp"):
        assign_stages_pass(gpt2(), {"chunks": 2})
    with pytest.raises(PipelineError, match="unknown assign-stages option"):
        assign_stages_pass(gpt2(), {"pp": 2, "chunk": 2})


def test_a_v_is_balanced_per_rank_as_brute_force(monkeypatch) -> None:
    """On a V (ZB-V's one wave: rank r holds stages r and 2P - 1 - r) the balancer minimizes the slowest rank,
    both its stages together, as brute force over every cut of tiny GPT-2's split into 2P stages; the
    per-stage balance (what it did before, the V layout switched off here) leaves a slower rank."""
    from autopar.solver.stages import balance as stages
    from autopar.solver.stages.cost import subgraph_costs

    prog, pp = gpt2(), 2
    split = ps.split_program(prog)
    ctx = StageContext(prog, A100, 1, 1, False, "bf16", None, frozenset(ps.common_nodes(prog)))
    t = [c.seconds for c in subgraph_costs(ctx, split.subgraphs, megatron_tp_comm_seconds).subgraphs]

    def slowest_rank(bounds) -> float:
        loads = [sum(t[bounds[s] : bounds[s + 1]]) for s in range(2 * pp)]
        return max(loads[r] + loads[2 * pp - 1 - r] for r in range(pp))

    n = len(t)
    brute = min(slowest_rank((0, *c, n)) for c in itertools.combinations(range(1, n), 2 * pp - 1))
    plan = balance(prog, split, pp, waves=1, microbatches=8, schedule="zbv")
    assert max(plan.rank_seconds()) == pytest.approx(brute, rel=1e-12)
    monkeypatch.setattr(stages, "balanced_v_layout", lambda w, p: None)
    per_stage = balance(prog, split, pp, waves=1, microbatches=8, schedule="zbv")
    assert max(per_stage.rank_seconds()) > brute * (1 + 1e-9)
