"""The strategy problem as data: one node per decision with the cost (and memory) of each candidate, and
edges whose cost depends on the candidate groups chosen at both ends. solver/sharding/ilp.py solves it (after the
exact presolve of solver/sharding/eliminate.py); solver/sharding/solve.py builds it from a program.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


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


def objective_of(nodes: list[Node], edges: list[Edge], choice: list[int]) -> float:
    """The objective of a choice of one candidate per node, computed directly."""
    total = sum(n.costs[c] for n, c in zip(nodes, choice))
    for e in edges:
        total += e.cost.get((e.u_group[choice[e.u]], e.v_group[choice[e.v]]), float("inf"))
    return total


def switch_costs(
    nodes: list[Node], edges: list[Edge], choice: list[int], i: int, free: Collection[int] = ()
) -> list[float]:
    """For each candidate of node ``i``: how much the objective of ``choice`` grows when node ``i`` alone takes
    it, the neighbours of ``i`` in ``free`` re-choosing their best candidate for it, measured from the choice's
    candidate with its free neighbours at their best (0 for it; a negative entry: the choice is not optimal).
    Free nodes must not neighbour each other (a ``SharedReads`` node neighbours its producer and readers)."""
    inf = float("inf")
    incident: dict[int, list[Edge]] = {}
    for e in edges:
        if i in (e.u, e.v) or e.u in free or e.v in free:
            incident.setdefault(e.u, []).append(e)
            incident.setdefault(e.v, []).append(e)
    loose = {e.v if e.u == i else e.u for e in incident.get(i, ())} & set(free)
    if any(e.u in loose and e.v in loose for n in loose for e in incident[n]):
        raise ValueError("switch_costs: free nodes neighbour each other")

    def edge(e: Edge, at: dict[int, int]) -> float:
        return e.cost.get((e.u_group[at.get(e.u, choice[e.u])], e.v_group[at.get(e.v, choice[e.v])]), inf)

    def value(c: int) -> float:
        at = {i: c}
        total = nodes[i].costs[c] + sum(edge(e, at) for e in incident.get(i, ()) if not {e.u, e.v} & loose)
        for n in loose:
            total += min(
                nodes[n].costs[k] + sum(edge(e, {**at, n: k}) for e in incident[n]) for k in range(len(nodes[n].costs))
            )
        return total

    values = [value(c) for c in range(len(nodes[i].costs))]
    return [v - values[choice[i]] for v in values]


def fold_repeated(nodes: list[Node], edges: list[Edge], rep: list[int]) -> tuple[list[Node], list[Edge], list[int]]:
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
