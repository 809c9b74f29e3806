"""Exact presolve of the strategy ILP: nodes with at most two neighbours are solved away by min-sum
variable elimination (dynamic programming), leaving a smaller ILP, often none, for the solver.

Without a memory budget the ILP minimizes a sum of node terms f_v(x_v) and edge terms
g_uv(x_u, x_v) over one candidate x_v per node (a pair missing from an edge is +inf). Eliminating a
node k replaces the terms that mention it by their minimum over x_k:

    leaf k (one neighbour u):       f_u(x_u)      += min_{x_k} f_k(x_k) + sum_e g_e(x_u, x_k)
    series k (neighbours u and v):  g'_uv(x_u, x_v) = min_{x_k} f_k(x_k) + sum_e g_e(x_u, x_k) + sum_e g_e(x_k, x_v)

(the edges between k and one neighbour are summed first; an edge from a node to itself, which
repeated-layer folding makes, and an edge one of whose ends is always in the same group, such as a
node with one candidate, are node terms). Each step keeps its argmin, so once the rest is solved
the eliminated nodes are filled in backwards: the optimum is the ILP's, with the same objective.
A transformer layer is series-parallel (residual branches, Q/K/V, attention), so it reduces to a
single node; what does not reduce (nodes with three or more neighbours once the others are gone)
stays for the ILP with its edges and the new ones (each step removes a node with two or more edges
and adds one edge at most).

Ties are broken towards less memory: every term carries (objective, memory per device) and minima
are lexicographic, so of the optimal strategies elimination keeps one with the least memory (the ILP
solvers pick any). With a memory budget the memory is a constraint, not a tie-break, and this does
not apply (`solver/sharding/ilp.py`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import InfeasibleError
from autopar.solver.sharding.problem import Edge, Node

MAX_WORK = 5e7  # entries of the table one elimination step builds; bigger steps are left to the ILP
_CHUNK = 1 << 21  # (objective, memory) pairs of a min-plus block computed at once


@dataclass
class _Factor:
    """A pairwise term: matrix[gu[x_u], gv[x_v]] = (objective, memory); objective inf: forbidden."""

    u: int
    v: int
    gu: np.ndarray
    gv: np.ndarray
    matrix: np.ndarray


@dataclass
class _Step:
    """How to recover x_k from its neighbours' choices: argmin[keys[0][x_u], keys[1][x_v]]."""

    k: int
    neighbours: tuple[int, ...]
    keys: tuple[np.ndarray, ...]
    argmin: np.ndarray


@dataclass
class Elimination:
    """The ILP left after elimination, over the surviving nodes and candidates, and how to expand
    its solution into a choice for every original node."""

    nodes: list[Node]  # surviving nodes, finite-cost candidates only
    edges: list[Edge]  # between surviving nodes (indices into ``nodes``)
    keep: list[int]  # original index of each surviving node
    candidates: list[list[int]]  # original candidate index of each surviving candidate
    steps: list[_Step] = field(default_factory=list)
    n_original: int = 0

    @property
    def eliminated(self) -> int:
        return len(self.steps)

    def expand(self, choice: list[int]) -> list[int]:
        """Original choice for every node from a choice over the surviving nodes."""
        full = [-1] * self.n_original
        for i, c, cands in zip(self.keep, choice, self.candidates):
            full[i] = cands[c]
        for s in reversed(self.steps):
            full[s.k] = int(s.argmin[tuple(key[full[n]] for key, n in zip(s.keys, s.neighbours))])
        return full


def eliminate(nodes: list, edges: list, max_work: float = MAX_WORK) -> Elimination:
    """Eliminate nodes with at most two neighbours, cheapest step first (module docstring)."""
    g = _Graph([np.stack([n.costs, n.memory or np.zeros(len(n.costs))], axis=-1).astype(float) for n in nodes])
    for e in edges:
        g.add(_factor(e))
    heap = [(w, k) for k in range(len(nodes)) if (w := g.work(k)) is not None]
    heapq.heapify(heap)
    steps: list[_Step] = []
    while heap:
        work, k = heapq.heappop(heap)
        if k not in g.alive or g.work(k) != work or work > max_work:
            continue  # stale entry (its neighbourhood changed since) or too big a table
        nbrs = sorted(g.neighbours[k])
        tables = [g.table(k, u) for u in nbrs]
        if len(nbrs) == 1:
            (key, t), (u,) = tables[0], nbrs
            best, arg = _lexmin(t + g.cost[k][None], axis=1)
            g.cost[u] = g.cost[u] + best[key]
            steps.append(_Step(k, (u,), (key,), arg))
        else:
            (key_u, tu), (key_v, tv) = tables
            best, arg = _min_plus(tu + g.cost[k][None], tv)
            steps.append(_Step(k, tuple(nbrs), (key_u, key_v), arg))
            g.add(_Factor(nbrs[0], nbrs[1], key_u, key_v, best))  # between u and v: not k's
        g.remove(k)
        for u in nbrs:
            if (w := g.work(u)) is not None:
                heapq.heappush(heap, (w, u))
    return _remaining(nodes, g, steps)


class _Graph:
    """Node costs and pairwise factors, with each node's factors and neighbours."""

    def __init__(self, cost: list[np.ndarray]):
        self.cost = cost  # per node: (candidates, 2) of (objective, memory)
        self.factors: dict[int, _Factor] = {}
        self.touching: list[set[int]] = [set() for _ in cost]
        self.neighbours: list[dict[int, int]] = [{} for _ in cost]  # neighbour -> number of factors
        self.alive = set(range(len(cost)))
        self._next = 0

    def add(self, f: _Factor) -> None:
        if f.u == f.v:  # both ends are the same choice: a node term
            self.cost[f.u] = self.cost[f.u] + f.matrix[f.gu, f.gv]
            return
        if (f.gu == f.gu[0]).all():  # u is always in one group (one candidate, say): a term of v alone
            self.cost[f.v] = self.cost[f.v] + f.matrix[f.gu[0], f.gv]
            return
        if (f.gv == f.gv[0]).all():
            self.cost[f.u] = self.cost[f.u] + f.matrix[f.gu, f.gv[0]]
            return
        self.factors[self._next] = f
        for a, b in ((f.u, f.v), (f.v, f.u)):
            self.touching[a].add(self._next)
            self.neighbours[a][b] = self.neighbours[a].get(b, 0) + 1
        self._next += 1

    def remove(self, k: int) -> None:
        for fid in self.touching[k]:
            f = self.factors.pop(fid)
            other = f.v if f.u == k else f.u
            self.touching[other].discard(fid)
            self.neighbours[other][k] -= 1
            if not self.neighbours[other][k]:
                del self.neighbours[other][k]
        self.touching[k] = set()
        self.neighbours[k] = {}
        self.alive.discard(k)

    def work(self, k: int) -> float | None:
        """Entries (at most) of the table that eliminating k builds: k's candidates times, for each
        neighbour, its combinations of groups on the factors to k; None with no or more than two
        neighbours."""
        nbrs = self.neighbours[k]
        if not nbrs or len(nbrs) > 2:
            return None
        combos = dict.fromkeys(nbrs, 1)
        for fid in self.touching[k]:
            f = self.factors[fid]
            u, groups = (f.u, f.matrix.shape[0]) if f.v == k else (f.v, f.matrix.shape[1])
            combos[u] *= groups
        return float(len(self.cost[k]) * math.prod(min(c, len(self.cost[u])) for u, c in combos.items()))

    def table(self, k: int, u: int) -> tuple[np.ndarray, np.ndarray]:
        """The factors between k and u summed into one table t[key[x_u], x_k], where key[x_u] numbers
        x_u's combination of groups on those factors."""
        sides = []
        for fid in self.touching[k]:
            f = self.factors[fid]
            if f.u == u:
                sides.append((f.gu, f.matrix[:, f.gv]))  # rows: u's groups, columns: k's candidates
            elif f.v == u:
                sides.append((f.gv, f.matrix[f.gu, :].swapaxes(0, 1)))
        combos, key = np.unique(np.stack([gu for gu, _ in sides], axis=1), axis=0, return_inverse=True)
        t = np.zeros((len(combos), len(self.cost[k]), 2))
        for j, (_, m) in enumerate(sides):
            t += m[combos[:, j]]
        return key.reshape(-1), t


def _factor(e) -> _Factor:
    """An Edge as a dense (objective, memory) matrix over its groups; edges hold no memory."""
    rows = max([*e.u_group, *(a for a, _ in e.cost)]) + 1
    cols = max([*e.v_group, *(b for _, b in e.cost)]) + 1
    m = np.zeros((rows, cols, 2))
    m[..., 0] = np.inf
    if e.cost:
        ab = np.array(list(e.cost), dtype=np.int64)
        m[ab[:, 0], ab[:, 1], 0] = list(e.cost.values())
    return _Factor(e.u, e.v, np.asarray(e.u_group, dtype=np.int64), np.asarray(e.v_group, dtype=np.int64), m)


def _lexmin(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic minimum of (objective, memory) pairs x[..., :] along an axis, and its first argmin."""
    obj = x[..., 0]
    tied = obj == obj.min(axis=axis, keepdims=True)
    arg = np.where(tied, x[..., 1], np.inf).argmin(axis=axis)
    best = np.take_along_axis(x, np.expand_dims(arg, axis)[..., None], axis=axis).squeeze(axis)
    return best, arg


def _min_plus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out[i, j] = lexicographic min over x of a[i, x] + b[j, x] ((objective, memory) pairs), and its
    first argmin x."""
    rows, n, _ = a.shape
    cols = b.shape[0]
    out = np.zeros((rows, cols, 2))
    out[..., 0] = np.inf
    arg = np.zeros((rows, cols), dtype=np.int64)
    step = max(1, _CHUNK // max(1, rows * cols))
    for x0 in range(0, n, step):
        block = a[:, x0 : x0 + step, None] + b.swapaxes(0, 1)[None, x0 : x0 + step]  # rows x chunk x cols x 2
        m, i = _lexmin(block, axis=1)
        better = (m[..., 0] < out[..., 0]) | ((m[..., 0] == out[..., 0]) & (m[..., 1] < out[..., 1]))
        out[better] = m[better]
        arg[better] = i[better] + x0
    return out, arg


def _remaining(nodes: list, g: _Graph, steps: list[_Step]) -> Elimination:
    """The surviving nodes and factors as an ILP, without candidates whose cost became infinite. A
    surviving node's memory is its own plus that of the choices eliminated into it (the tie-break)."""
    alive = sorted(g.alive)
    index = {k: i for i, k in enumerate(alive)}
    cands, rnodes = [], []
    for k in alive:
        ok = np.flatnonzero(np.isfinite(g.cost[k][:, 0]))
        if not len(ok):
            raise InfeasibleError(f"no candidate of {nodes[k].name} is compatible with its neighbours")
        cands.append(ok.tolist())
        rnodes.append(Node(nodes[k].name, g.cost[k][ok, 0].tolist(), g.cost[k][ok, 1].tolist()))
    redges = []
    for f in g.factors.values():
        obj = f.matrix[..., 0]
        rows, cols = np.nonzero(np.isfinite(obj))
        pairs = dict(zip(zip(rows.tolist(), cols.tolist()), obj[rows, cols].tolist()))
        gu, gv = f.gu[cands[index[f.u]]], f.gv[cands[index[f.v]]]
        redges.append(Edge(index[f.u], index[f.v], gu.tolist(), gv.tolist(), pairs))
    return Elimination(rnodes, redges, alive, cands, steps, len(nodes))
