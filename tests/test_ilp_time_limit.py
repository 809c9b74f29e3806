"""The strategy ILP never gives up on a problem that has a plan: a time limit returns the solver's best plan (or
autopar's own feasible one) with its status and gap, checked, never a SolverError (solver/sharding/ilp.py); and
the problem of a mixture-of-experts stack folds its alike layers (solver/sharding/solve.py:repeated_layers).

Before the warm start and the fallback, each problem here ended in ``SolverError: the ILP solver ended with
status 'Not Solved'`` (CBC stops on its time limit before it has an integer solution)."""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import replace

import pulp
import pytest

from autopar.api import parse_mesh
from autopar.errors import NotOptimalPlanWarning
from autopar.ir.core import Op
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions, shard
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding import ilp
from autopar.solver.sharding.blocks import layer_key
from autopar.solver.sharding.ilp import feasible_start, solve
from autopar.solver.sharding.problem import Edge, Node, fold_repeated, objective_of
from autopar.solver.sharding.solve import build_problem, repeated_layers

TINY_LIMIT = 0.01  # seconds: far less than either solver needs for the root LP of these problems


def _grid(n: int, k: int, seed: int = 0) -> tuple[list[Node], list[Edge]]:
    """An n x n grid of nodes with k candidates, random costs, edges that cost nothing where both ends agree:
    its LP relaxation is fractional, so a solver stopped early has no proof (and, alone, often no plan)."""
    r = random.Random(seed)
    nodes = [Node(f"n{i}", [r.random() for _ in range(k)], [1.0] * k) for i in range(n * n)]
    edges = []
    for i in range(n):
        for j in range(n):
            for di, dj in ((0, 1), (1, 0)):
                if i + di < n and j + dj < n:
                    cost = {(a, b): 0.0 if a == b else 2 * r.random() for a in range(k) for b in range(k)}
                    edges.append(Edge(i * n + j, (i + di) * n + j + dj, list(range(k)), list(range(k)), cost))
    return nodes, edges


def _assert_valid(nodes: list[Node], edges: list[Edge], sol: ilp.Solution) -> None:
    assert len(sol.choice) == len(nodes)
    assert all(0 <= c < len(n.costs) for n, c in zip(nodes, sol.choice))
    assert math.isfinite(sol.objective) and sol.objective == objective_of(nodes, edges, sol.choice)


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_a_time_limited_ilp_returns_a_valid_plan_with_its_status_and_gap(backend):
    nodes, edges = _grid(10, 6)
    sol = solve(nodes, edges, time_limit=TINY_LIMIT, backend=backend, eliminate=False)
    _assert_valid(nodes, edges, sol)
    assert sol.status in ("feasible", "heuristic")
    assert sol.gap is None or sol.gap >= 0
    # never worse than the plan autopar hands the solver to start from
    assert sol.objective <= objective_of(nodes, edges, feasible_start(nodes, edges)) + 1e-12
    assert "time limit" in sol.explained() and "--time-limit" in sol.explained()


def test_a_solver_that_ends_without_a_plan_leaves_autopars_own(monkeypatch):
    """CBC without the warm start ends this problem with no integer solution: the plan is autopar's own."""
    nodes, edges = _grid(10, 6)
    cold = lambda backend, limit, log=None, warm=False: pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, logPath=log)  # noqa: E731
    monkeypatch.setattr(ilp, "_solver", cold)
    sol = solve(nodes, edges, time_limit=TINY_LIMIT, eliminate=False)
    _assert_valid(nodes, edges, sol)
    assert sol.status == "heuristic"
    assert sol.choice == feasible_start(nodes, edges)


def test_feasible_start_respects_forbidden_pairs_and_the_budget():
    """A chain whose cheap candidates are forbidden together, and a budget only the dear ones fit."""
    nodes = [Node(f"n{i}", [0.0, 5.0], [10.0, 1.0]) for i in range(4)]
    edges = [Edge(i, i + 1, [0, 1], [0, 1], {(0, 1): 0.0, (1, 0): 0.0, (1, 1): 0.0}) for i in range(3)]
    start = feasible_start(nodes, edges)
    assert math.isfinite(objective_of(nodes, edges, start))
    assert sum(n.memory[c] for n, c in zip(nodes, feasible_start(nodes, edges, budget=4.0))) <= 4.0
    assert feasible_start(nodes, edges, budget=3.0) is None  # nothing fits


def test_the_shard_pass_warns_and_records_a_plan_not_proven_optimal():
    """The full ILP of a small model over three axes (tens of thousands of variables) under a tiny limit: a
    valid program (verified, its collectives inserted), the status and gap in its attributes and a warning."""
    spec = build("tiny-mlp:batch=2,seq=2")
    prog = lower(capture(spec.model, spec.args, spec.kwargs), parse_mesh("a0=2,a1=2,a2=2"))
    opts = ShardOptions(
        cluster=ClusterSpec.load("dgx-a100"), objective="memory", eliminate=False, time_limit=TINY_LIMIT
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = shard(prog, opts)
    sol = res.solution
    assert sol.variables > 10_000 and sol.status in ("feasible", "heuristic")
    assert [w for w in caught if issubclass(w.category, NotOptimalPlanWarning) and sol.status in str(w.message)]
    assert res.program.attrs["ilp_status"] == sol.status and "ilp_gap" in res.program.attrs
    verify(res.program)
    verify(insert_collectives(res.program))
    optimal = shard(prog, replace(opts, eliminate=True, time_limit=60.0))
    assert optimal.solution.status == "optimal" and "ilp_gap" not in optimal.program.attrs
    assert optimal.solution.objective <= sol.objective * (1 + 1e-9)


@pytest.mark.slow
def test_tiny_deepseek_v3_gets_a_valid_plan_within_its_time_limit():
    """Issue 31's case: DeepSeek-V3 at tiny size (MLA, a shared expert, routed experts; bench/solver_scale.py
    builds it) on dp=2 x tp=2 ended in 'Not Solved' once the limit passed. Its ILP is still large after
    elimination (MLA's rotary embedding multiplies two halves of q by two halves of cos and sin: not
    series-parallel): a bound on its size, and a valid plan under a short limit on HiGHS, which keeps to it
    (CBC's root LP of this ILP runs minutes past any limit). Minutes: most of it PuLP building the ILP."""
    from bench.solver_scale import deepseek_v3_tiny

    prog = lower(capture(*deepseek_v3_tiny()), parse_mesh("dp=2,tp=2"))
    opts = ShardOptions(cluster=ClusterSpec.load("dgx-a100"), backend="highs", time_limit=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotOptimalPlanWarning)
        res = shard(prog, opts)
    sol = res.solution
    assert 0 < sol.variables <= 400_000  # of the ILP left after elimination (303,909 when measured)
    assert sol.status in ("optimal", "feasible", "heuristic") and math.isfinite(sol.objective)
    assert res.program.attrs["ilp_status"] == sol.status
    verify(res.program)
    verify(insert_collectives(res.program))


def test_a_stack_of_two_kinds_of_layers_folds_each_kind_onto_its_first():
    """DeepSeek-V3's first layer is dense and the others mixtures of experts: the identical MoE layers are solved
    once (before, one layer unlike the others left the whole stack unfolded: 61 layers at full size)."""
    from bench.solver_scale import deepseek_v3_tiny

    prog = lower(capture(*deepseek_v3_tiny(layers=3)), parse_mesh("dp=2,tp=2"))
    _, groups, nodes, edges = build_problem(prog, ShardOptions(cluster=ClusterSpec.load("dgx-a100")))
    rep, folded = repeated_layers(groups)
    assert folded == 2  # the two MoE layers; the dense one stands alone
    layer = {i: layer_key(g.head.path if isinstance(g.head, Op) else g.head.name) for i, g in enumerate(groups)}
    moved = {(layer[i][1], layer[r][1]) for i, r in enumerate(rep) if r != i and layer.get(i) and layer.get(r)}
    assert moved == {(2, 1)}  # layer 2's groups stand for layer 1's, nothing else is folded
    rnodes, redges, _ = fold_repeated(nodes, edges, rep)
    assert len(rnodes) < len(nodes)


@pytest.mark.slow
def test_autopar_plan_prints_a_time_limited_plans_status_and_gap(monkeypatch, capsys, tmp_path):
    """Elimination switched off (its step budget 0), the small model's full ILP under a tiny limit: the report
    says the plan is not proven optimal, with its gap and what to do; the plan file records both."""
    from autopar.cli import main
    from autopar.solver.sharding.eliminate import eliminate

    monkeypatch.setattr(ilp, "reduce_problem", lambda nodes, edges: eliminate(nodes, edges, max_work=0))
    args = ["plan", "tiny-mlp:batch=2,seq=2", "--mesh", "a0=2,a1=2,a2=2", "--roles", "auto"]  # the paper's free axes
    args += ["--objective", "memory", "--no-baselines"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotOptimalPlanWarning)
        assert main([*args, "--time-limit", str(TINY_LIMIT), "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "not proven optimal (gap to the solver's bound:" in out and "--time-limit" in out
    stats = json.loads((tmp_path / "p.json").read_text())["stats"]
    assert stats["status"] in ("feasible", "heuristic") and "ilp_gap" in stats
