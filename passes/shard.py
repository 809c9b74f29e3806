"""The `shard` pass: build the strategy ILP over the program, solve it, write the chosen placements.

Decisions are made per *group*, not per op (DESIGN "Scale"):
- an op whose main (first tensor) input comes from a single-use op joins that op's group, so a chain
  linear -> add(bias) -> view -> gelu is one decision; its candidates are the head's strategies
  extended along the chain (branching only where a follower cannot take what arrives, in which
  case the group pays the resharding inside it);
- a parameter, buffer or input read by one op is folded into that op's group: it is stored the way
  its reader wants it.

Objectives: ``time`` (the default) is the least predicted step time, communication plus computation
seconds on the cluster spec, within the memory budget (``planning_options`` sets the budget to the
cluster's device memory); ``comm`` is the same objective under Alpa's name, kept for old plan files;
``memory`` is the minimal-memory-redundancy paper's: redundant bytes + alpha * communication bytes.

Values every rank can compute for itself (``recomputable``: inputs' integer tensors, buffers,
``arange`` and the cheap ops of those, nothing that needs a gradient) are never moved: every
placement change of one that would communicate is left out of the problem, so position ids and
masks are computed (replicated) where they are needed and sliced locally, never gathered. A partial
sum of such values (the count of non-ignored targets over rows split across ranks) is reduced.

Every op's result types get the chosen placements, and each op the attribute ``in`` with the
placements its inputs must have ("*" where any will do); `insert-collectives` turns every mismatch
into collectives and drops the attribute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import InfeasibleError, SolverError
from autopar.ir.core import (
    VIEW_OPS,
    Op,
    Partial,
    Placement,
    Program,
    R,
    Replicate,
    TensorType,
    Value,
    map_refs,
    parse_placement,
)
from autopar.solver.cluster import ClusterSpec
from autopar.solver.cost import INF, CostModel, TrainingSetup
from autopar.solver.ilp import Edge, Node, Solution, fold_repeated, solve
from autopar.solver.strategies import (
    Strategy,
    chunk_counts,
    is_divergent,
    is_follower,
    op_strategies,
    value_strategies,
)

MAX_GROUP_CANDIDATES = 2048
OBJECTIVES = ("time", "memory", "comm")  # "comm": "time" under Alpa's name
CHEAP_FLOPS_PER_ELEMENT = 16  # an op doing at most this many FLOPs per output element is cheap to recompute


@dataclass
class ShardOptions:
    objective: str = "time"  # "time": step time within the budget; "memory": redundancy + alpha * comm bytes
    alpha: float = 1.0
    budget_bytes: float | None = None  # per-device memory budget (None: none; see planning_options)
    time_limit: float | None = 60.0
    backend: str = "cbc"
    setup: TrainingSetup = field(default_factory=TrainingSetup)
    cluster: ClusterSpec | None = None
    shard_inputs: bool = True
    collapse: bool = True
    reuse_layers: bool = True  # solve identical repeated layers once
    eliminate: bool = True  # solve series-parallel parts exactly before the ILP (solver/eliminate.py)
    # restrict candidates (baselines): name of a value / op result -> predicate on its placements
    constrain: dict | None = None
    # a constrained value is read where it is stored, never moved by a collective: a hand-written layout
    # such as Megatron's computes with each weight shard in place (without this the cheapest execution of
    # Megatron's storage may gather the weights, ZeRO-3 style)
    pin_constrained: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SolverError(f"unknown objective {self.objective!r}; choose time (fastest within the memory "
                              "budget) or memory (least memory)")  # fmt: skip


def planning_options(opts: ShardOptions | None, cluster: ClusterSpec) -> ShardOptions:
    """What a user-facing entry point plans with: ``opts`` (default: the fastest plan) priced on
    ``cluster`` when they name none, and for the time objective a budget of the cluster's device
    memory when they set none."""
    from dataclasses import replace

    opts = opts or ShardOptions()
    if opts.cluster is None:
        opts = replace(opts, cluster=cluster)
    if opts.objective != "memory" and opts.budget_bytes is None:
        opts = replace(opts, budget_bytes=float(opts.cluster.device_memory))
    return opts


def recomputable(prog: Program) -> set[str]:
    """Values each rank can compute for itself at least as cheaply as it could receive them: non-float
    inputs (every rank holds the global batch), buffers, and the results of views and cheap ops
    (at most ``CHEAP_FLOPS_PER_ELEMENT`` per output element, e.g. ``arange``, comparisons, cumsum)
    whose tensor inputs are all recomputable; never a value whose gradient backward needs."""
    grad = prog.requires_grad()
    out = {v.name for v in prog.inputs if v.kind == "buffer" or (v.kind == "input" and not v.type.is_float)}
    for op in prog.ops:
        if any(r in grad for r in op.results) or any(r.name not in out for r in op.input_refs()):
            continue
        numel = sum(t.nbytes / max(t.itemsize, 1) for t in op.types)
        if op.target in VIEW_OPS or op.flops <= CHEAP_FLOPS_PER_ELEMENT * max(numel, 1):
            out.update(op.results)
    return out


@dataclass
class Group:
    head: Op | Value
    ops: list[Op] = field(default_factory=list)  # in program order (head first when it is an op)
    values: list[Value] = field(default_factory=list)  # folded params, buffers and inputs
    candidates: list[dict[str, Strategy]] = field(default_factory=list)  # member name -> strategy
    memory: list[float] = field(default_factory=list)  # bytes per device
    redundancy: list[float] = field(default_factory=list)
    comm_bytes: list[float] = field(default_factory=list)
    comm_seconds: list[float] = field(default_factory=list)
    compute_seconds: list[float] = field(default_factory=list)


@dataclass
class ShardResult:
    program: Program
    solution: Solution
    groups: list[Group]
    unruled: list[str]
    memory_bytes: float  # predicted per-device memory (sum over the chosen candidates)
    redundancy_bytes: float
    comm_bytes: float
    comm_seconds: float
    compute_seconds: float = 0.0  # predicted forward + backward computation per device

    @property
    def step_seconds(self) -> float:
        """The predicted step time the ``time`` objective minimizes: computation plus communication."""
        return self.compute_seconds + self.comm_seconds


def format_placements(p: tuple[Placement, ...] | None) -> str:
    return "*" if p is None else ",".join(str(x) for x in p)


def required_inputs(op: Op) -> list[tuple[Placement, ...] | None]:
    """The placements recorded by `shard` for each tensor input of op (None where any will do)."""
    out: list[tuple[Placement, ...] | None] = []
    for text in op.attrs.get("in", []):
        out.append(
            None if text == "*" else tuple(parse_placement(x) for x in re.findall(r"[^,(]+(?:\([^)]*\))?", text))
        )
    return out


class _Builder:
    def __init__(self, prog: Program, opts: ShardOptions):
        self.prog, self.opts = prog, opts
        self.mesh = prog.mesh
        self.types = prog.types()
        self.cost = CostModel(prog.mesh, opts.setup, opts.cluster)
        self.counts = chunk_counts(prog)
        self.users = prog.users()
        self.outputs = {r.name for r in prog.outputs if hasattr(r, "name")}
        self.unruled: set[str] = set()
        self.grad = prog.requires_grad()
        self.producers = prog.producers()
        self._value_cache: dict[str, list[Strategy]] = {}
        self._refs: dict[str, list] = {}
        self._allowed_sets: dict[str, set] = {}
        self._strat_cache: dict[tuple, tuple[list[Strategy], bool]] = {}
        self._reads: dict[int, dict[str, list[tuple[str, int]]]] = {}
        self._replicated = (R,) * len(prog.mesh.axes)
        self.recomputable = recomputable(prog)
        self.params = {v.name for v in prog.params}

    # -- strategies -----------------------------------------------------------------------------
    def op_strats(self, op: Op) -> list[Strategy]:
        # strategies depend on the target, the types and the non-tensor arguments only: ops repeated
        # in every layer share one enumeration
        key = (op.target, tuple(self.types[r.name] for r in self.refs(op)), op.types, _unnamed((op.args, op.kwargs)))
        if key not in self._strat_cache:
            self._strat_cache[key] = op_strategies(op, self.types, self.mesh, self.counts)
        strats, ruled = self._strat_cache[key]
        if not ruled:
            self.unruled.add(op.target)
        return [s for s in strats if self._allowed(op.result, s.outputs[0])]

    def value_strats(self, v: Value) -> list[Strategy]:
        if v.name not in self._value_cache:
            shardable = v.kind != "input" or self.opts.shard_inputs
            strats = value_strategies(v.type, self.mesh, self.counts, shardable)
            self._value_cache[v.name] = [s for s in strats if self._allowed(v.name, s.outputs[0])]
        return self._value_cache[v.name]

    def refs(self, op: Op) -> list:
        if op.result not in self._refs:
            self._refs[op.result] = op.input_refs()
        return self._refs[op.result]

    def _allowed(self, name: str, p: tuple[Placement, ...]) -> bool:
        pred = (self.opts.constrain or {}).get(name)
        return pred is None or pred(p)

    # -- grouping -------------------------------------------------------------------------------
    def build_groups(self) -> tuple[list[Group], dict[str, int]]:
        groups: list[Group] = []
        where: dict[str, int] = {}  # value / op result name -> group index
        folded: dict[str, str] = {}  # folded value name -> the op result that reads it
        for v in self.prog.inputs:
            users = self.users[v.name]
            constrained = v.name in (self.opts.constrain or {})
            if self.opts.collapse and len(users) == 1 and v.name not in self.outputs and not constrained:
                folded[v.name] = users[0].result
            else:
                groups.append(Group(v, candidates=[{v.name: s} for s in self.value_strats(v)]))
                where[v.name] = len(groups) - 1
        for op in self.prog.ops:
            strats = self.op_strats(op)
            g = self._follows(op, where)
            if g is not None:
                extended = self._extend(groups[g], op, strats)
                if extended is not None and len(extended) <= MAX_GROUP_CANDIDATES:
                    groups[g].ops.append(op)
                    groups[g].candidates = extended
                    for r in op.results:
                        where[r] = g
                    continue
            groups.append(Group(op, ops=[op], candidates=[{op.result: s} for s in strats]))
            for r in op.results:
                where[r] = len(groups) - 1
        for vname, reader in folded.items():
            v = next(x for x in self.prog.inputs if x.name == vname)
            g = groups[where[reader]]
            g.values.append(v)
            where[vname] = where[reader]
        for g in groups:
            g.candidates = [c for c in g.candidates if self._folded_ok(g, c)]
            if not g.candidates:
                raise InfeasibleError(self._why_no_candidate(g))
        return groups, where

    def _why_no_candidate(self, g: Group) -> str:
        """The message when every candidate of g is ruled out: by ShardOptions.constrain (which the caller
        gave) if it constrains a member, otherwise a bug (every op and value can at least be replicated)."""
        members = [g.head.name if isinstance(g.head, Value) else g.head.result] + [v.name for v in g.values]
        members += [op.result for op in g.ops]
        fixed = [m for m in members if m in (self.opts.constrain or {})]
        if fixed:
            return (
                f"no placement that ShardOptions.constrain allows for {', '.join('%' + m for m in fixed)} is valid "
                f"on mesh {self.mesh} (each sharded dim must divide over the devices of the axes splitting it); "
                f"allow other placements there or change the mesh"
            )
        return f"{_label(g.head)} has no sharding candidate on mesh {self.mesh}; a bug in autopar, please report it"

    def _follows(self, op: Op, where: dict[str, int]) -> int | None:
        if not self.opts.collapse or not is_follower(op.target):
            return None
        refs = self.refs(op)
        if not refs:
            return None
        main = refs[0].name
        producer = self.producers.get(main)
        if not isinstance(producer, Op) or len(producer.results) != 1:
            return None
        if len(self.users[main]) != 1 or main in self.outputs or main not in where:
            return None
        if _layer_key(producer.path) != _layer_key(op.path):
            return None  # chains stop at layer boundaries, so repeated layers stay identical
        return where[main]

    def _extend(self, g: Group, op: Op, strats: list[Strategy]) -> list[dict] | None:
        main = self.refs(op)[0].name
        by_input: dict = {}
        for s in strats:
            by_input.setdefault(s.inputs[0], []).append(s)
        anything = by_input.get(None, [])
        out = []
        for cand in g.candidates:
            incoming = self._placement_in(cand, g, main)
            fitting = by_input.get(incoming, []) + anything
            for s in fitting or strats:
                out.append({**cand, op.result: s})
            if len(out) > MAX_GROUP_CANDIDATES:
                return None
        return out

    def _placement_in(self, cand: dict[str, Strategy], g: Group, name: str) -> tuple[Placement, ...]:
        for op in g.ops:
            if name in op.results:
                return cand[op.result].outputs[op.results.index(name)]
        return cand[name].outputs[0]

    def _folded_ok(self, g: Group, cand: dict[str, Strategy]) -> bool:
        """Store each folded value the way its reader wants it; drop candidates where that's invalid."""
        reads = self._reads.get(id(g))
        if reads is None:  # where each folded value is read: (op result, input position)
            reads = self._reads[id(g)] = {
                v.name: [(op.result, i) for op in g.ops for i, r in enumerate(self.refs(op)) if r.name == v.name]
                for v in g.values
            }
        for v in g.values:
            allowed = self._allowed_sets.get(v.name)
            if allowed is None:
                allowed = self._allowed_sets[v.name] = {s.outputs[0] for s in self.value_strats(v)}
            want = None
            for res, i in reads[v.name]:
                p = cand[res].inputs[i]
                if p is not None:
                    if want is not None and want != p:
                        return False
                    want = p
            want = want or self._replicated
            if want not in allowed:
                return False
            cand[v.name] = Strategy((), (want,))
        return True

    # -- costs ----------------------------------------------------------------------------------
    def price(self, g: Group) -> None:
        for cand in g.candidates:
            mem = red = vol = sec = flop_sec = 0.0
            for v in g.values + ([g.head] if isinstance(g.head, Value) else []):
                p = cand[v.name].outputs[0]
                m, r = (
                    self.cost.param_memory(v.type, p) if v.kind == "param" else self.cost.activation_memory(v.type, p)
                )
                mem, red = mem + m, red + r
            for op in g.ops:
                s = cand[op.result]
                b, x = self.cost.inherent(op.target, [self.types[r.name] for r in self.refs(op)], s.inputs)
                vol, sec = vol + b, sec + x
                flop_sec += self.cost.compute_seconds(
                    op.flops,
                    [is_divergent(s, a) for a in range(len(self.mesh.axes))],
                    0.0 if op.target in VIEW_OPS else op.bytes,
                )
                for t, p in zip(op.types, s.outputs):
                    m, r = self.cost.activation_memory(t, p)
                    mem, red = mem + m, red + r
                for i, (ref, p) in enumerate(zip(self.refs(op), s.inputs)):
                    if p is None:
                        continue
                    t = self.types[ref.name]
                    if i == 0 and op is not g.ops[0] and ref.name in _results_of(g):
                        src = self._placement_in(cand, g, ref.name)
                        b, x = self.cost.redistribute(t, src, p, ref.name in self.grad)
                        if b and ref.name in self.recomputable and not _has_partial(src):
                            b = x = INF  # computed where it is needed, never moved (a partial sum is reduced)
                        vol, sec = vol + b, sec + x
                    if ref.name in self.grad:
                        # a parameter read by two ops whose gradients both need the sync is all-reduced
                        # once (grad_sync): `_shared_sync_edges` refunds one; by k > 2, each pays 1/k
                        readers = len(self.users[ref.name]) if ref.name in self.params else 1
                        share = 1.0 if readers <= 2 else 1 / readers
                        for a in range(len(self.mesh.axes)):
                            if isinstance(p[a], Replicate) and is_divergent(s, a):
                                b, x = self.cost.grad_reduce(t, p, a, ref.name in self.params)
                                vol, sec = vol + share * b, sec + share * x
            g.memory.append(mem)
            g.redundancy.append(red)
            g.comm_bytes.append(vol)
            g.comm_seconds.append(sec)
            g.compute_seconds.append(flop_sec)
        keep = [i for i, v in enumerate(g.comm_bytes) if v != INF]  # impossible reshards inside the group
        if not keep:
            raise InfeasibleError(f"every strategy of {_label(g.head)} needs an impossible redistribution")
        for name in ("candidates", "memory", "redundancy", "comm_bytes", "comm_seconds", "compute_seconds"):
            arr = getattr(g, name)
            setattr(g, name, [arr[i] for i in keep])

    def objective(self, red: float, vol: float, sec: float, mem: float, flop_sec: float = 0.0) -> float:
        if self.opts.objective == "memory":
            return red + self.opts.alpha * vol
        # the least step time, communication plus computation seconds (ties: less memory)
        return sec + flop_sec + 1e-15 * mem

    def edge_costs(self, t: TensorType, srcs: list, dsts: list, name: str = "") -> dict[tuple[int, int], float]:
        """Objective of moving value ``name`` of type t from each placement in srcs to each in dsts (None:
        as it is), keyed by (index in srcs, index in dsts); impossible pairs are left out, and so are
        those that would communicate a recomputable value."""
        vol, sec = self.cost.redistribute_matrix(t, srcs, dsts, name in self.grad if name else None)
        cost = self.objective(0.0, vol, sec, 0.0)
        possible = np.isfinite(vol)
        if name and self.opts.pin_constrained and name in (self.opts.constrain or {}):
            possible &= vol == 0  # used where it is stored
        if name in self.recomputable:  # never moved; but a partial sum (a count over split rows) is reduced
            reduced = np.array([_has_partial(s) for s in srcs], dtype=bool)[:, None]
            possible &= (vol == 0) | reduced
        rows, cols = np.nonzero(possible)
        return dict(zip(zip(rows.tolist(), cols.tolist()), cost[rows, cols].tolist()))


def _has_partial(placements) -> bool:
    return placements is not None and any(isinstance(p, Partial) for p in placements)


def _results_of(g: Group) -> set[str]:
    return {r for op in g.ops for r in op.results}


def _label(x: Op | Value) -> str:
    return f"%{x.result} = {x.target}" if isinstance(x, Op) else f"{x.kind} %{x.name}"


def build_problem(prog: Program, opts: ShardOptions):
    b = _Builder(prog, opts)
    groups, where = b.build_groups()
    priced: dict[tuple, Group] = {}
    for g in groups:
        # identical groups (the same group in every layer) have index-aligned candidates: price once
        sig = _signature(g)  # before pricing prunes impossible candidates
        same = priced.get(sig)
        if same is not None:
            g.candidates = _rename(same, g)
            g.memory, g.redundancy = list(same.memory), list(same.redundancy)
            g.comm_bytes, g.comm_seconds = list(same.comm_bytes), list(same.comm_seconds)
            g.compute_seconds = list(same.compute_seconds)
            continue
        b.price(g)
        priced[sig] = g
    nodes = [
        Node(
            _label(g.head),
            [
                b.objective(r, v, s, m, f)
                for r, v, s, m, f in zip(g.redundancy, g.comm_bytes, g.comm_seconds, g.memory, g.compute_seconds)
            ],
            g.memory,
        )
        for g in groups
    ]
    edges: list[Edge] = []
    for gi, g in enumerate(groups):
        members = _results_of(g) | {v.name for v in g.values}
        for op in g.ops:
            for pos, ref in enumerate(b.refs(op)):
                if ref.name in members:
                    continue
                hi = where[ref.name]
                edges.append(_edge(b, groups, hi, gi, ref.name, lambda c, op=op, pos=pos: c[op.result].inputs[pos]))
    out_refs = [r for r in prog.outputs if hasattr(r, "name")]
    if out_refs:
        sink = Group(Value("<output>", "input", TensorType("f32", ())), candidates=[{}])
        groups.append(sink)
        nodes.append(Node("<output>", [0.0], [0.0]))
        for ref in out_refs:
            edges.append(
                _edge(
                    b,
                    groups,
                    where[ref.name],
                    len(groups) - 1,
                    ref.name,
                    lambda c: (R,) * len(prog.mesh.axes),
                )
            )
    edges += _shared_sync_edges(b, groups, where)
    _keep_distinct_interfaces(groups, nodes, edges, budget=opts.budget_bytes is not None)
    return b, groups, nodes, edges


def _sync_needs(b: _Builder, g: Group, op: Op, pos: int, t: TensorType) -> list[tuple]:
    """Per candidate of g: for each mesh axis, the (bytes, seconds) of the gradient all-reduce that
    op's read of input ``pos`` needs there ((0, 0) where it needs none)."""
    out = []
    for c in g.candidates:
        s, p = c[op.result], c[op.result].inputs[pos]
        out.append(
            tuple(
                b.cost.grad_reduce(t, p, a, True) if isinstance(p[a], Replicate) and is_divergent(s, a) else (0.0, 0.0)
                for a in range(len(b.mesh.axes))
            )
        )
    return out


def _shared_sync_edges(b: _Builder, groups: list[Group], where: dict[str, int]) -> list[Edge]:
    """A parameter read by two ops in different groups (tied embeddings) whose gradients both need
    an axis's all-reduce gets it once, after backward (`insert-collectives` marks it grad_sync), but
    each read was priced with its own: an edge between the two readers refunds the smaller."""
    out = []
    for v in b.prog.params:
        readers = [(op, i) for op in b.users[v.name] for i, r in enumerate(b.refs(op)) if r.name == v.name]
        if v.name not in b.grad or len(readers) != 2:
            continue
        (op1, i1), (op2, i2) = readers
        g1, g2 = where[op1.result], where[op2.result]
        if g1 == g2:
            continue
        n1 = _sync_needs(b, groups[g1], op1, i1, v.type)
        n2 = _sync_needs(b, groups[g2], op2, i2, v.type)
        ug, uids = _group_ids(n1)
        vg, vids = _group_ids(n2)
        cost = {}
        for x, a in enumerate(uids):
            for y, c in enumerate(vids):
                both = [min(p, q) if p[0] and q[0] else (0.0, 0.0) for p, q in zip(a, c)]
                vol, sec = sum(x[0] for x in both), sum(x[1] for x in both)
                cost[(x, y)] = b.objective(0.0, -vol, -sec, 0.0)
        e = Edge(g1, g2, ug, vg, cost)
        e.keys = ("refund", list(uids), list(vids))
        out.append(e)
    return out


def _keep_distinct_interfaces(groups: list[Group], nodes: list[Node], edges: list[Edge], budget: bool) -> None:
    """Exact reduction: the rest of the ILP sees a group only through the placements on its edges, so
    of the candidates with the same placements on every edge only the cheapest can be optimal (with a
    memory budget, those not dominated in both cost and memory)."""
    touching: list[list[tuple[Edge, str]]] = [[] for _ in groups]
    for e in edges:
        touching[e.u].append((e, "u"))
        touching[e.v].append((e, "v"))
    for gi, g in enumerate(groups):
        node = nodes[gi]
        n = len(node.costs)
        if n <= 1:
            continue
        classes: dict[tuple, list[int]] = {}
        for c in range(n):
            key = tuple(e.u_group[c] if side == "u" else e.v_group[c] for e, side in touching[gi])
            classes.setdefault(key, []).append(c)
        keep: list[int] = []
        for members in classes.values():
            if not budget:
                keep.append(min(members, key=lambda c: (node.costs[c], node.memory[c])))
                continue
            for c in members:  # Pareto front on (cost, memory)
                dominated = any(
                    (node.costs[d] <= node.costs[c] and node.memory[d] <= node.memory[c])
                    and (node.costs[d] < node.costs[c] or node.memory[d] < node.memory[c] or d < c)
                    for d in members
                    if d != c
                )
                if not dominated:
                    keep.append(c)
        keep.sort()
        if len(keep) == n:
            continue
        node.costs = [node.costs[c] for c in keep]
        node.memory = [node.memory[c] for c in keep]
        for name in ("candidates", "memory", "redundancy", "comm_bytes", "comm_seconds", "compute_seconds"):
            arr = getattr(g, name)
            if arr:
                setattr(g, name, [arr[c] for c in keep])
        for e, side in touching[gi]:
            if side == "u":
                e.u_group = [e.u_group[c] for c in keep]
            else:
                e.v_group = [e.v_group[c] for c in keep]


def _edge(b: _Builder, groups: list[Group], hi: int, gi: int, name: str, want) -> Edge:
    h, g = groups[hi], groups[gi]
    u_keys = [b._placement_in(c, h, name) for c in h.candidates]
    v_keys = [want(c) for c in g.candidates]
    ug, uids = _group_ids(u_keys)
    vg, vids = _group_ids(v_keys)
    e = Edge(hi, gi, ug, vg, b.edge_costs(b.types[name], list(uids), list(vids), name))
    e.keys = (name, list(uids), list(vids))  # for reporting the chosen pair's volume and time
    return e


def _group_ids(keys):
    ids: dict = {}
    out = []
    for k in keys:
        ids.setdefault(k, len(ids))
        out.append(ids[k])
    return out, ids


_LAYER = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")


def _layer_key(path: str) -> tuple[str, int] | None:
    m = _LAYER.match(path or "")
    return (m["stack"], int(m["index"])) if m else None


def repeated_layers(groups: list[Group]) -> tuple[list[int], int] | None:
    """For each group its representative: the same group of the first layer when every layer of the
    model's main layer stack (``transformer.h.N``, ``model.layers.N``) has identical groups."""
    layer_of = [_layer_key(g.head.path if isinstance(g.head, Op) else g.head.name) for g in groups]
    stacks: dict[str, dict[int, list[int]]] = {}
    for i, key in enumerate(layer_of):
        if key is not None:
            stacks.setdefault(key[0], {}).setdefault(key[1], []).append(i)
    if not stacks:
        return None
    stack = max(stacks.values(), key=len)
    layers = [stack[k] for k in sorted(stack)]
    if len(layers) < 2:
        return None
    sig = [[_signature(groups[i]) for i in layer] for layer in layers]
    if any(s != sig[0] for s in sig[1:]):
        return None
    rep = list(range(len(groups)))
    for layer in layers[1:]:
        for i, first in zip(layer, layers[0]):
            rep[i] = first
    return rep, len(layers)


def _rename(src: Group, dst: Group) -> list[dict[str, Strategy]]:
    """dst's candidates as the pruned (priced) list of src, matching members by position."""
    names = {a: b for x, y in zip(src.ops, dst.ops) for a, b in zip(x.results, y.results)}
    names |= {x.name: y.name for x, y in zip(src.values, dst.values)}
    if isinstance(src.head, Value):
        names[src.head.name] = dst.head.name
    return [{names[k]: v for k, v in c.items()} for c in src.candidates]


def _signature(g: Group) -> tuple:
    """Everything a group's candidates and prices depend on, without value names: groups with equal
    signatures (the same group in every layer) have index-aligned candidates and equal costs."""
    if isinstance(g.head, Value):
        return ("value", g.head.kind, g.head.type, tuple(tuple(c.values()) for c in g.candidates))
    ops = tuple((op.target, op.types, _unnamed((op.args, op.kwargs))) for op in g.ops)
    return ("ops", ops, tuple(v.type for v in g.values), len(g.candidates))


def _unnamed(x):
    """Arguments with every value reference replaced by a placeholder."""
    return repr(map_refs(x, lambda r: "%"))


def shard(prog: Program, opts: ShardOptions | None = None) -> ShardResult:
    opts = opts or ShardOptions()
    b, groups, nodes, edges = build_problem(prog, opts)
    try:
        sol = _solve(nodes, edges, groups, opts)
    except InfeasibleError:
        if opts.budget_bytes is None:
            raise
        smallest = smallest_budget(prog, opts)
        raise InfeasibleError(
            f"no strategy fits a per-device budget of {opts.budget_bytes / 2**30:.2f} GiB; the smallest that "
            f"fits is {smallest / 2**30:.2f} GiB ({smallest:,.0f} bytes): raise --budget-gb, add devices, or "
            "shard optimizer states (ZeRO)",
            smallest_budget_bytes=smallest,
        ) from None
    return _apply(prog, b, groups, edges, sol)


def smallest_budget(prog: Program, opts: ShardOptions) -> float:
    """The least per-device memory any strategy needs (the ILP with memory as the objective)."""
    from dataclasses import replace

    # an infinite budget keeps every candidate not dominated in (cost, memory): the least memory too
    b, groups, nodes, edges = build_problem(prog, replace(opts, budget_bytes=float("inf")))
    for n in nodes:
        n.costs = list(n.memory)
    for e in edges:
        e.cost = {k: 0.0 for k in e.cost}
    sol = _solve(nodes, edges, groups, replace(opts, budget_bytes=None))
    return sum(g.memory[c] for g, c in zip(groups, sol.choice) if g.memory)


def _solve(nodes: list[Node], edges: list[Edge], groups: list[Group], opts: ShardOptions) -> Solution:
    args = dict(budget=opts.budget_bytes, time_limit=opts.time_limit, backend=opts.backend, eliminate=opts.eliminate)
    found = repeated_layers(groups) if opts.reuse_layers else None
    # (repeated layers whose costs differ after all are not identical: solved in full)
    if found is None or any(nodes[i].costs != nodes[r].costs for i, r in enumerate(found[0])):
        sol = solve(nodes, edges, **args)
        sol.layers = 0
        return sol
    rep, n_layers = found
    rnodes, redges, index = fold_repeated(nodes, edges, rep)
    sol = solve(rnodes, redges, **args)
    sol.choice = [sol.choice[index[i]] for i in range(len(nodes))]
    sol.layers = n_layers
    return sol


def _apply(prog: Program, b: _Builder, groups: list[Group], edges: list[Edge], sol: Solution) -> ShardResult:
    chosen: dict[str, Strategy] = {}
    totals = [0.0, 0.0, 0.0, 0.0]  # memory, redundancy, comm bytes, comm seconds
    for g, c in zip(groups, sol.choice):
        chosen.update(g.candidates[c])
        for k, arr in enumerate((g.memory, g.redundancy, g.comm_bytes, g.comm_seconds)):
            if arr:
                totals[k] += arr[c]
    for e in edges:  # resharding between groups
        name, u_keys, v_keys = e.keys
        a = u_keys[e.u_group[sol.choice[e.u]]]
        bb = v_keys[e.v_group[sol.choice[e.v]]]
        if name == "refund":  # a shared parameter's gradient synchronized once
            both = [min(p, q) if p[0] and q[0] else (0.0, 0.0) for p, q in zip(a, bb)]
            totals[2] -= sum(x[0] for x in both)
            totals[3] -= sum(x[1] for x in both)
        elif bb is not None and a != bb:
            vol, sec = b.cost.redistribute(b.types[name], a, bb, name in b.grad)
            totals[2] += vol
            totals[3] += sec
    inputs = tuple(
        Value(v.name, v.kind, v.type.with_placements(chosen[v.name].outputs[0]), dict(v.attrs)) for v in prog.inputs
    )
    ops = []
    for op in prog.ops:
        s = chosen[op.result]
        types = tuple(t.with_placements(p) for t, p in zip(op.types, s.outputs))
        ops.append(op.with_(types=types, attrs=dict(op.attrs, **{"in": [format_placements(p) for p in s.inputs]})))
    out = prog.with_(inputs=inputs, ops=tuple(ops))
    out = out.with_(attrs=dict(out.attrs, ilp_status=sol.status, ilp_objective=round(sol.objective, 3)))
    compute = sum(g.compute_seconds[c] for g, c in zip(groups, sol.choice) if g.compute_seconds)
    return ShardResult(out, sol, groups, sorted(b.unruled), *totals, compute_seconds=compute)


__all__ = [
    "OBJECTIVES",
    "ShardOptions",
    "ShardResult",
    "planning_options",
    "recomputable",
    "required_inputs",
    "shard",
    "smallest_budget",
]
