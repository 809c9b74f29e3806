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
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import pulp

from autopar.errors import InfeasibleError, SolverError


@dataclass
class Node:
    name: str
    costs: list[float]
    memory: list[float] = field(default_factory=list)  # per candidate, for the budget constraint


@dataclass
class Edge:
    u: int
    v: int
    u_group: list[int]  # group id of each candidate of u
    v_group: list[int]
    cost: dict[tuple[int, int], float]  # (group of u, group of v) -> cost; a missing pair is forbidden
    keys: tuple = ()  # what the caller needs to interpret the groups (not used by the solver)


@dataclass
class Solution:
    choice: list[int]
    objective: float
    status: str  # "optimal" | "feasible" (time limit hit with an incumbent)
    seconds: float
    variables: int
    constraints: int
    layers: int = 0  # identical layers solved once (0: no repeated-layer folding)


def solve(*args, **kwargs) -> Solution:
    """Build and solve the ILP; see the module docstring for the formulation."""
    with warnings.catch_warnings():  # PuLP 3.x warns about APIs that change in PuLP 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(*args, **kwargs)


def _solve(
    nodes: list[Node],
    edges: list[Edge],
    budget: float | None = None,
    time_limit: float | None = 60.0,
    backend: str = "cbc",
) -> Solution:
    t0 = time.perf_counter()
    prob = pulp.LpProblem("autopar_strategy", pulp.LpMinimize)
    s = []
    objective = []
    constant = 0.0
    for i, node in enumerate(nodes):
        xs = [pulp.LpVariable(f"s_{i}_{c}", cat="Binary") for c in range(len(node.costs))]
        prob += pulp.lpSum(xs) == 1, f"one_{i}"
        objective += [node.costs[c] * x for c, x in enumerate(xs) if node.costs[c]]
        s.append(xs)
    for k, e in enumerate(edges):
        ga, gb = sorted(set(e.u_group)), sorted(set(e.v_group))
        if len(ga) == 1 and len(gb) == 1:
            cost = e.cost.get((ga[0], gb[0]))
            if cost is None:
                raise InfeasibleError(
                    f"edge {nodes[e.u].name} -> {nodes[e.v].name} has no allowed placement pair"
                )
            continue  # constant cost
        ev = {}
        for a in ga:
            for b in gb:
                if (a, b) in e.cost:
                    ev[a, b] = pulp.LpVariable(f"e_{k}_{a}_{b}", lowBound=0)
                    if e.cost[a, b]:
                        objective.append(e.cost[a, b] * ev[a, b])
        for a in ga:
            members = [s[e.u][c] for c, g in enumerate(e.u_group) if g == a]
            prob += (
                pulp.lpSum(x for (aa, _), x in ev.items() if aa == a) == pulp.lpSum(members),
                f"eu_{k}_{a}",
            )
        for b in gb:
            members = [s[e.v][c] for c, g in enumerate(e.v_group) if g == b]
            prob += (
                pulp.lpSum(x for (_, bb), x in ev.items() if bb == b) == pulp.lpSum(members),
                f"ev_{k}_{b}",
            )
    if budget is not None:
        prob += (
            pulp.lpSum(
                n.memory[c] * s[i][c] for i, n in enumerate(nodes) for c in range(len(n.costs)) if n.memory
            )
            <= budget,
            "memory_budget",
        )
    prob += pulp.lpSum(objective) + constant
    solver = _solver(backend, time_limit)
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    seconds = time.perf_counter() - t0
    if status == "Infeasible":
        raise InfeasibleError("no strategy satisfies the constraints (memory budget too small?)")
    if status not in ("Optimal",) and prob.sol_status not in (pulp.LpSolutionIntegerFeasible,):
        raise SolverError(f"the ILP solver ended with status {status!r}")
    choice = [max(range(len(xs)), key=lambda c, xs=xs: xs[c].value() or 0.0) for xs in s]
    return Solution(
        choice=choice,
        objective=objective_of(nodes, edges, choice),
        status="optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible",
        seconds=seconds,
        variables=len(prob.variables()),
        constraints=len(prob.constraints),
    )


def objective_of(nodes: list[Node], edges: list[Edge], choice: list[int]) -> float:
    """The objective of a choice of one candidate per node, computed directly."""
    total = sum(n.costs[c] for n, c in zip(nodes, choice))
    for e in edges:
        total += e.cost.get((e.u_group[choice[e.u]], e.v_group[choice[e.v]]), float("inf"))
    return total


def _solver(backend: str, time_limit: float | None):
    if backend == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    if backend == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    raise SolverError(f"unknown ILP back end {backend!r}; use 'cbc' (default) or 'highs'")


def fold_repeated(
    nodes: list[Node], edges: list[Edge], rep: list[int]
) -> tuple[list[Node], list[Edge], list[int]]:
    """The ILP with node i replaced by its representative rep[i] (identical candidates and costs).

    Costs of the nodes a representative stands for are summed into it, and edges between them are
    folded onto the representatives (edges that coincide are merged by adding their costs), so L
    identical layers cost about one layer to solve. Returns the reduced nodes and edges and, for
    each original node, the index of its representative in the reduced node list.
    """
    keep = sorted(set(rep))
    index = {old: new for new, old in enumerate(keep)}
    reduced = [Node(nodes[i].name, [0.0] * len(nodes[i].costs), [0.0] * len(nodes[i].memory)) for i in keep]
    for i, node in enumerate(nodes):
        r = reduced[index[rep[i]]]
        r.costs = [a + b for a, b in zip(r.costs, node.costs)]
        r.memory = [a + b for a, b in zip(r.memory, node.memory)]
    merged: dict[tuple, Edge] = {}
    for e in edges:
        u, v = index[rep[e.u]], index[rep[e.v]]
        key = (u, v, tuple(e.u_group), tuple(e.v_group), tuple(sorted(e.cost)))
        if key in merged:
            m = merged[key]
            m.cost = {k: m.cost[k] + e.cost[k] for k in m.cost}
        else:
            merged[key] = Edge(u, v, list(e.u_group), list(e.v_group), dict(e.cost))
    return reduced, list(merged.values()), [index[rep[i]] for i in range(len(nodes))]
