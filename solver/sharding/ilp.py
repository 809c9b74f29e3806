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

A time limit never loses a plan that exists. Before the solver runs, ``feasible_start`` finds a plan of its
own (the problem restricted to a maximum spanning forest of its edges, solved exactly by elimination, then
improved one node at a time against every edge) and hands it to the solver as its first incumbent (a warm
start). When the limit passes, the solver's best plan is returned with status ``feasible`` and the relative
gap to the solver's lower bound (CBC's log, HiGHS's dual bound); a solver that ends with no plan (CBC may
refuse a warm start) leaves autopar's own, status ``heuristic``. Whatever the solver returns is checked:
binary, one candidate per node, no forbidden pair, within the budget.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import pulp

from autopar.errors import InfeasibleError, SolverError
from autopar.solver.sharding.eliminate import Elimination
from autopar.solver.sharding.eliminate import eliminate as reduce_problem
from autopar.solver.sharding.problem import Edge, Node, objective_of


def _drop_pulp_import_tracebacks() -> None:
    """pulp keeps the error of each solver it could not load as a class attribute (``COPT_DLL.err``,
    ``CPLEX_PY.err``: the exception of ``import cplex`` or of loading COPT's library), traceback and all.
    That traceback's frames lead back (``f_back``) through the import to the frame that first imported
    autopar's stack: since ``import autopar`` is lazy (PEP 562), the user's function that called
    ``autopar.init_mesh``, whose locals (its process groups, a model) then live until the interpreter's
    teardown, after ``runtime/comm/teardown.py`` freed the groups, so their gloo threads outlive it
    (tests/test_teardown.py). The message, all pulp uses of it (``actualSolve`` raises it), stays."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "pulp" or name.startswith("pulp.")):
            continue
        for value in list(vars(module).values()):
            errors = list(vars(value).values()) if isinstance(value, type) else [value]
            while errors:
                err = errors.pop()
                if isinstance(err, BaseException) and err.__traceback__ is not None:
                    err.__traceback__ = None
                    errors += [err.__cause__, err.__context__]


_drop_pulp_import_tracebacks()


@dataclass
class Solution:
    choice: list[int]
    objective: float
    # "optimal": proven; "feasible": the solver's best plan when its time limit passed; "heuristic": the time
    # limit passed with no plan from the solver, autopar's own (``feasible_start``)
    status: str
    seconds: float
    variables: int  # of the ILP handed to the solver (after elimination; 0: none was needed)
    constraints: int
    layers: int = 0  # identical layers solved once (0: no repeated-layer folding)
    eliminated: int = 0  # nodes solved by exact elimination (solver/sharding/eliminate.py) before the ILP
    # relative gap between the plan's ILP objective and the solver's lower bound: 0 when optimal, None when
    # the solver reported no bound
    gap: float | None = 0.0

    def explained(self) -> str:
        """What a plan that is not proven optimal is, and what to do: for warnings and reports."""
        if self.status == "optimal":
            return "the strategy ILP was solved to optimality"
        gap = "an unknown gap" if self.gap is None else f"a gap of {100 * self.gap:.2f}% to the solver's bound"
        what = {
            "feasible": "the solver's best plan",
            "heuristic": "no plan from the solver; autopar's own feasible plan (a spanning-forest solve improved "
            "node by node)",
        }[self.status]
        return (
            f"the strategy ILP hit its time limit ({what}, status {self.status!r}, {gap}): the plan is valid but "
            "may be slower than the optimum; raise the time limit (TrainConfig(time_limit=...), autopar plan "
            "--time-limit) or try the HiGHS back end (TrainConfig(solver='highs'), --solver highs)"
        )


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
            out = _ilp(reduced.nodes, reduced.edges, None, time_limit, backend)
            choice = reduced.expand(out.choice)
            # the optimum without the budget is the optimum with it whenever it fits (a plan that is not proven
            # optimal is kept when it fits: the ILP under the budget is no smaller)
            if budget is None or sum(_memory(n, c) for n, c in zip(nodes, choice)) <= budget:
                return _solution(nodes, edges, choice, out, t0, reduced.eliminated)
    out = _ilp(nodes, edges, budget, time_limit, backend)
    return _solution(nodes, edges, out.choice, out, t0, 0)


@dataclass
class _Result:
    choice: list[int]
    status: str  # "optimal" | "feasible" | "heuristic" (Solution.status)
    gap: float | None
    size: tuple[int, int]  # (variables, constraints)


def _solution(nodes, edges, choice, out: _Result, t0: float, eliminated: int) -> Solution:
    return Solution(
        choice=choice,
        objective=objective_of(nodes, edges, choice),
        status=out.status,
        seconds=time.perf_counter() - t0,
        variables=out.size[0],
        constraints=out.size[1],
        eliminated=eliminated,
        gap=out.gap,
    )


def _ilp(nodes: list[Node], edges: list[Edge], budget: float | None, time_limit: float | None, backend: str) -> _Result:
    """Eq. 5-8 with PuLP, warm-started from ``feasible_start``: the plan, its status and gap, the ILP's size."""
    if not edges and budget is None:  # independent nodes: each takes its cheapest (then least memory)
        choice = [min(range(len(n.costs)), key=lambda c, n=n: (n.costs[c], _memory(n, c))) for n in nodes]
        return _Result(choice, "optimal", 0.0, (0, 0))
    start = feasible_start(nodes, edges, budget)
    prob = pulp.LpProblem("autopar_strategy", pulp.LpMinimize)
    s = []
    pairs: list[tuple[Edge, dict[tuple[int, int], pulp.LpVariable]]] = []
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
        xs = {}
        for (a, b), cost in e.cost.items():
            if a in rows and b in cols:
                x = xs[a, b] = pulp.LpVariable(f"e_{k}_{a}_{b}", lowBound=0)
                rows[a].append((x, 1.0))
                cols[b].append((x, 1.0))
                if cost:
                    objective.append((x, cost))
        pairs.append((e, xs))
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
    if start is not None:
        _warm(s, pairs, start)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        prob.solve(_solver(backend, time_limit, log, warm=start is not None))
        bound = _lower_bound(prob, backend, log)
    size = (len(prob.variables()), len(prob.constraints))
    status = pulp.LpStatus[prob.status]
    found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    choice = _checked(nodes, edges, s, budget) if found else None
    if choice is not None and prob.sol_status == pulp.LpSolutionOptimal:
        return _Result(choice, "optimal", 0.0, size)
    if choice is None and start is None:
        if status == "Infeasible" or prob.sol_status == pulp.LpSolutionInfeasible:
            if budget is not None:
                raise InfeasibleError("no strategy fits the per-device memory budget")
            raise InfeasibleError("the strategy ILP has no solution; this is a bug in autopar, please report it")
        raise SolverError(
            f"the ILP solver ({backend}) ended with status {status!r} and no plan after its time limit of "
            f"{time_limit} s, and autopar found no feasible plan of its own: raise the time limit "
            "(TrainConfig(time_limit=...), autopar plan --time-limit) or try the HiGHS back end "
            "(TrainConfig(solver='highs'), --solver highs)"
        )
    how = "feasible"
    if choice is None or objective_of(nodes, edges, start) < objective_of(nodes, edges, choice):
        choice, how = start, "heuristic"  # the solver had no plan (or one worse than the warm start it was given)
    ilp_value = (objective_of(nodes, edges, choice) - _constant(edges)) * scale
    gap = None if bound is None else max(0.0, ilp_value - bound) / max(abs(ilp_value), 1e-9)
    return _Result(choice, how, gap, size)


def feasible_start(nodes: list[Node], edges: list[Edge], budget: float | None = None) -> list[int] | None:
    """A plan with a finite objective (within ``budget``), found without the ILP: the problem restricted to a
    maximum spanning forest of its edges (an edge that forbids a pair first, then by the spread of its
    costs) is solved exactly by elimination, then each node in turn takes its best candidate against all its
    edges while that lowers the objective. With a budget the plan that does not fit is retried with memory as
    the objective. None when neither is feasible."""
    choice = _descend(nodes, edges, _forest_optimum(nodes, edges))
    if objective_of(nodes, edges, choice) < math.inf and _fits(nodes, choice, budget):
        return choice
    if budget is None:
        return None
    least = [Node(n.name, list(n.memory) or [0.0] * len(n.costs), n.memory) for n in nodes]
    allowed = [Edge(e.u, e.v, e.u_group, e.v_group, dict.fromkeys(e.cost, 0.0)) for e in edges]
    choice = _descend(least, allowed, _forest_optimum(least, allowed))
    if objective_of(nodes, edges, choice) < math.inf and _fits(nodes, choice, budget):
        return choice
    return None


def _forest_optimum(nodes: list[Node], edges: list[Edge]) -> list[int]:
    """The optimum of the problem with only a maximum spanning forest of its edges (elimination solves a forest)."""
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def weight(e: Edge) -> tuple[bool, float]:
        pairs = {(a, b) for a in set(e.u_group) for b in set(e.v_group)}
        finite = list(e.cost.values())
        return (not pairs <= e.cost.keys(), max(finite) - min(finite) if finite else 0.0)

    forest = []
    for e in sorted((e for e in edges if e.u != e.v), key=weight, reverse=True):
        a, b = root(e.u), root(e.v)
        if a != b:
            parent[a] = b
            forest.append(e)
    forest += [e for e in edges if e.u == e.v]  # node terms
    cheapest = [min(range(len(n.costs)), key=lambda c, n=n: n.costs[c]) for n in nodes]
    try:
        reduced = reduce_problem(nodes, forest)
    except InfeasibleError:  # some node has no candidate its forest neighbours allow: descend from the cheapest
        return cheapest
    if reduced.edges:  # a forest table too big to eliminate
        return cheapest
    return reduced.expand([min(range(len(n.costs)), key=lambda c, n=n: n.costs[c]) for n in reduced.nodes])


def _descend(nodes: list[Node], edges: list[Edge], choice: list[int], sweeps: int = 20) -> list[int]:
    """``choice`` improved by moving one node at a time to its best candidate given its neighbours' (coordinate
    descent: the objective never rises, an infinite one falls to finite where one move can make it so)."""
    incident: list[list[Edge]] = [[] for _ in nodes]
    for e in edges:
        incident[e.u].append(e)
        if e.v != e.u:
            incident[e.v].append(e)
    choice = list(choice)
    inf = math.inf

    def local(i: int, c: int) -> float:
        total = nodes[i].costs[c]
        for e in incident[i]:
            cu = c if e.u == i else choice[e.u]
            cv = c if e.v == i else choice[e.v]
            total += e.cost.get((e.u_group[cu], e.v_group[cv]), inf)
        return total

    for _ in range(sweeps):
        moved = False
        for i, n in enumerate(nodes):
            now = local(i, choice[i])
            best = min(range(len(n.costs)), key=lambda c, i=i: local(i, c))
            if local(i, best) < now:
                choice[i], moved = best, True
        if not moved:
            break
    return choice


def _fits(nodes: list[Node], choice: list[int], budget: float | None) -> bool:
    return budget is None or sum(_memory(n, c) for n, c in zip(nodes, choice)) <= budget


def _warm(s: list[list[pulp.LpVariable]], pairs: list, start: list[int]) -> None:
    """Set ``start`` (and the edge variables it implies) as the solver's initial values."""
    for xs, c in zip(s, start):
        for k, x in enumerate(xs):
            x.setInitialValue(1.0 if k == c else 0.0)
    for e, xs in pairs:
        chosen = (e.u_group[start[e.u]], e.v_group[start[e.v]])
        for key, x in xs.items():
            x.setInitialValue(1.0 if key == chosen else 0.0)


def _checked(nodes: list[Node], edges: list[Edge], s: list[list[pulp.LpVariable]], budget: float | None):
    """The choice the solver's values make, or None unless they are binary with one candidate per node, allow
    every edge and fit the budget (a time-limited solver's values are checked, not trusted)."""
    choice = []
    for xs in s:
        values = [x.value() for x in xs]
        if any(v is None for v in values):
            return None
        ones = [c for c, v in enumerate(values) if v > 1 - 1e-6]
        if len(ones) != 1 or any(abs(v) > 1e-6 for c, v in enumerate(values) if c != ones[0]):
            return None
        choice.append(ones[0])
    if objective_of(nodes, edges, choice) == math.inf or not _fits(nodes, choice, budget):
        return None
    return choice


def _constant(edges: list[Edge]) -> float:
    """The cost of the edges with one group at each end (no variables: left out of the ILP's objective)."""
    total = 0.0
    for e in edges:
        ga, gb = set(e.u_group), set(e.v_group)
        if len(ga) == 1 and len(gb) == 1:
            total += e.cost[next(iter(ga)), next(iter(gb))]
    return total


def _lower_bound(prob: pulp.LpProblem, backend: str, log: str) -> float | None:
    """The solver's lower bound on the (scaled) ILP objective: CBC's log line, HiGHS's MIP dual bound."""
    if backend == "highs":
        bound = prob.solverModel.getInfo().mip_dual_bound if getattr(prob, "solverModel", None) else None
        return bound if bound is not None and math.isfinite(bound) else None
    try:
        with open(log) as f:
            text = f.read()
    except OSError:
        return None
    bounds = re.findall(r"^Lower bound:\s+(\S+)", text, re.M)
    return float(bounds[-1]) if bounds else None


def _memory(node: Node, c: int) -> float:
    return node.memory[c] if node.memory else 0.0


def _size(nodes: list[Node], edges: list[Edge]) -> int:
    """Variables of the ILP (at most: edges with one group at each end need none)."""
    return sum(len(n.costs) for n in nodes) + sum(len(e.cost) for e in edges)


def _expr(terms) -> pulp.LpAffineExpression:
    """A linear expression from (variable, coefficient) pairs, without lpSum's term-by-term merging."""
    return pulp.LpAffineExpression(list(terms))


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS (highspy) with the variables' initial values as its starting solution (PuLP's has none)."""

    def __init__(self, warm: bool, **kwargs):
        super().__init__(**kwargs)
        self.warm = warm

    def buildSolverModel(self, lp):
        super().buildSolverModel(lp)
        if self.warm:
            import highspy  # PuLP's HiGHS back end needs it already

            start = highspy.HighsSolution()
            start.col_value = [v.varValue or 0.0 for v in lp.variables()]
            start.value_valid = True
            lp.solverModel.setSolution(start)


def _solver(backend: str, time_limit: float | None, log: str | None = None, warm: bool = False):
    if backend == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, logPath=log, warmStart=warm)
    if backend == "highs":
        return _HiGHS(warm, msg=False, timeLimit=time_limit)
    raise SolverError(f"unknown ILP back end {backend!r}; use 'cbc' (default) or 'highs'")
