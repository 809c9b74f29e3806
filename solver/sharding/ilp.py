"""The strategy ILP (Eq. 5-8 of the minimal-memory-redundancy paper), solved with PuLP.

Given nodes with candidate costs and edges whose cost depends on both endpoints' choices:

    minimize    sum_v sum_c  cost_v[c] * s_v[c]  +  sum_(u,v) sum_(a,b)  cost_uv[a,b] * e_uv[a,b]
    subject to  sum_c s_v[c] = 1                                for every node v        (Eq. 6)
                sum_b e_uv[a,b] = sum_{c in group a} s_u[c]     for every edge, group a (Eq. 7)
                sum_a e_uv[a,b] = sum_{c in group b} s_v[c]     for every edge, group b (Eq. 7)
                sum_v sum_c mem_v[c] * s_v[c] <= budget          (optional)
                s binary, e >= 0                                                        (Eq. 8)

Edges are over *groups* of candidates (candidates of u with the same output placement, of v with the
same required input placement), which is the paper's formulation with the identical rows merged:
fewer variables, the same optimum. Fixing the s variables leaves e a transportation problem with 0/1
marginals, so e is integral at the optimum without being declared binary.

`solve` first hands the problem to exact variable elimination (`solver/sharding/eliminate.py`): nodes with at
most two neighbours are minimized away by dynamic programming, which solves a transformer layer
outright, and only what is left (often nothing) goes to CBC or HiGHS. On a mesh of three axes of 2
one encoder layer is 120-160k edge variables, whose LP relaxation alone takes CBC seconds and is not
always integral (branch and bound then takes minutes); elimination takes a tenth of a second.
With a memory budget elimination cannot see the constraint: its optimum is returned when it fits the
budget (it is then also the optimum under the budget), otherwise the full ILP above is solved.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import pulp

from autopar.errors import InfeasibleError, SolverError
from autopar.solver.sharding.eliminate import Elimination
from autopar.solver.sharding.eliminate import eliminate as reduce_problem
from autopar.solver.sharding.problem import Edge, Node, objective_of


@dataclass
class Solution:
    choice: list[int]
    objective: float
    status: str  # "optimal" | "feasible" (time limit hit with an incumbent)
    seconds: float
    variables: int  # of the ILP handed to the solver (after elimination; 0: none was needed)
    constraints: int
    layers: int = 0  # identical layers solved once (0: no repeated-layer folding)
    eliminated: int = 0  # nodes solved by exact elimination (solver/sharding/eliminate.py) before the ILP


def solve(*args, **kwargs) -> Solution:
    """Solve the strategy problem exactly; see the module docstring for the formulation."""
    with warnings.catch_warnings():  # PuLP 3.x warns about APIs that change in PuLP 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(*args, **kwargs)


def _solve(
    nodes: list[Node],
    edges: list[Edge],
    budget: float | None = None,
    time_limit: float | None = 60.0,
    backend: str = "cbc",
    eliminate: bool = True,
    reduced: Elimination | None = None,
) -> Solution:
    """``reduced``: ``eliminate(nodes, edges)`` where the caller has it already."""
    t0 = time.perf_counter()
    if eliminate:
        reduced = reduced or reduce_problem(nodes, edges)
        if _size(reduced.nodes, reduced.edges) <= _size(nodes, edges):  # else elimination did not pay
            choice, optimal, size = _ilp(reduced.nodes, reduced.edges, None, time_limit, backend)
            choice = reduced.expand(choice)
            # the optimum without the budget is the optimum with it whenever it fits
            if budget is None or sum(_memory(n, c) for n, c in zip(nodes, choice)) <= budget:
                return _solution(nodes, edges, choice, optimal, t0, size, reduced.eliminated)
    choice, optimal, size = _ilp(nodes, edges, budget, time_limit, backend)
    return _solution(nodes, edges, choice, optimal, t0, size, 0)


def _solution(nodes, edges, choice, optimal: bool, t0: float, size: tuple[int, int], eliminated: int) -> Solution:
    return Solution(
        choice=choice,
        objective=objective_of(nodes, edges, choice),
        status="optimal" if optimal else "feasible",
        seconds=time.perf_counter() - t0,
        variables=size[0],
        constraints=size[1],
        eliminated=eliminated,
    )


def _ilp(
    nodes: list[Node], edges: list[Edge], budget: float | None, time_limit: float | None, backend: str
) -> tuple[list[int], bool, tuple[int, int]]:
    """Eq. 5-8 with PuLP: (choice, proven optimal, (variables, constraints))."""
    if not edges and budget is None:  # independent nodes: each takes its cheapest (then least memory)
        return [min(range(len(n.costs)), key=lambda c, n=n: (n.costs[c], _memory(n, c))) for n in nodes], True, (0, 0)
    prob = pulp.LpProblem("autopar_strategy", pulp.LpMinimize)
    s = []
    objective: list[tuple[pulp.LpVariable, float]] = []
    for i, node in enumerate(nodes):
        xs = [pulp.LpVariable(f"s_{i}_{c}", cat="Binary") for c in range(len(node.costs))]
        prob += _expr((x, 1.0) for x in xs) == 1, f"one_{i}"
        objective += [(x, node.costs[c]) for c, x in enumerate(xs) if node.costs[c]]
        s.append(xs)
    for k, e in enumerate(edges):
        ga, gb = sorted(set(e.u_group)), sorted(set(e.v_group))
        if len(ga) == 1 and len(gb) == 1:
            if (ga[0], gb[0]) not in e.cost:
                raise InfeasibleError(f"edge {nodes[e.u].name} -> {nodes[e.v].name} has no allowed placement pair")
            continue  # constant cost
        rows: dict[int, list] = {a: [(x, -1.0) for c, x in enumerate(s[e.u]) if e.u_group[c] == a] for a in ga}
        cols: dict[int, list] = {b: [(x, -1.0) for c, x in enumerate(s[e.v]) if e.v_group[c] == b] for b in gb}
        for (a, b), cost in e.cost.items():
            if a in rows and b in cols:
                x = pulp.LpVariable(f"e_{k}_{a}_{b}", lowBound=0)
                rows[a].append((x, 1.0))
                cols[b].append((x, 1.0))
                if cost:
                    objective.append((x, cost))
        for a, terms in rows.items():  # sum_b e[a,b] = sum_{c in group a} s_u[c]
            prob += _expr(terms) == 0, f"eu_{k}_{a}"
        for b, terms in cols.items():
            prob += _expr(terms) == 0, f"ev_{k}_{b}"
    if budget is not None:
        terms = [(x, n.memory[c]) for n, xs in zip(nodes, s) if n.memory for c, x in enumerate(xs)]
        prob += _expr(terms) <= budget, "memory_budget"
    # scaled so its largest coefficient is 1e6: the solvers' tolerances are absolute, and step times
    # in seconds (the comm objective, ~1e-6 per term) are below them (CBC then stops short)
    scale = 1e6 / max((abs(c) for _, c in objective), default=1.0)
    prob += _expr((x, c * scale) for x, c in objective)
    prob.solve(_solver(backend, time_limit))
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        if budget is not None:
            raise InfeasibleError("no strategy fits the per-device memory budget")
        raise InfeasibleError("the strategy ILP has no solution; this is a bug in autopar, please report it")
    if status not in ("Optimal",) and prob.sol_status not in (pulp.LpSolutionIntegerFeasible,):
        raise SolverError(f"the ILP solver ended with status {status!r}")
    choice = [max(range(len(xs)), key=lambda c, xs=xs: xs[c].value() or 0.0) for xs in s]
    size = (len(prob.variables()), len(prob.constraints))
    return choice, prob.sol_status == pulp.LpSolutionOptimal, size


def _memory(node: Node, c: int) -> float:
    return node.memory[c] if node.memory else 0.0


def _size(nodes: list[Node], edges: list[Edge]) -> int:
    """Variables of the ILP (at most: edges with one group at each end need none)."""
    return sum(len(n.costs) for n in nodes) + sum(len(e.cost) for e in edges)


def _expr(terms) -> pulp.LpAffineExpression:
    """A linear expression from (variable, coefficient) pairs, without lpSum's term-by-term merging."""
    return pulp.LpAffineExpression(list(terms))


def _solver(backend: str, time_limit: float | None):
    if backend == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    if backend == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    raise SolverError(f"unknown ILP back end {backend!r}; use 'cbc' (default) or 'highs'")
