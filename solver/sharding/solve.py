"""Solve a program's sharding: build the strategy problem (solver/sharding/groups.py's groups as nodes, resharding
between them as edges), solve it (solver/sharding/ilp.py), and report the strategy chosen for every value and op
result with its predicted memory, communication and computation. The `shard` pass (passes/shard.py) writes
the chosen placements into the IR; the baselines (solver/sharding/baselines.py) solve under constraints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.errors import InfeasibleError, SolverError
from autopar.ir.core import Op, Placement, Program, R, Replicate, Shard, TensorType, Value
from autopar.solver.sharding.blocks import layer_key
from autopar.solver.sharding.cost import INF, TrainingSetup
from autopar.solver.sharding.eliminate import eliminate as reduce_problem
from autopar.solver.sharding.groups import Group, GroupBuilder, label
from autopar.solver.sharding.ilp import Solution, solve
from autopar.solver.sharding.options import ShardOptions
from autopar.solver.sharding.problem import Edge, Node, fold_repeated
from autopar.solver.sharding.strategies import Strategy, column_weight, partial_axes


@dataclass
class Sharding:
    """The solved strategy problem: the strategy of every value and op result, and what it is predicted to cost."""

    solution: Solution
    groups: list[Group]
    chosen: dict[str, Strategy]  # value / op result name -> strategy (outputs: its placements; inputs: required)
    unruled: list[str]  # targets without a sharding rule (replicated)
    memory_bytes: float  # predicted per-device memory (sum over the chosen candidates)
    redundancy_bytes: float
    comm_bytes: float
    comm_seconds: float
    compute_seconds: float = 0.0  # predicted forward + backward computation per device

    @property
    def step_seconds(self) -> float:
        """The predicted step time the ``time`` objective minimizes: computation plus communication."""
        return self.compute_seconds + self.comm_seconds

    def placements(self, name: str) -> tuple[Placement, ...]:
        """The chosen placements of value (or op result) ``name``."""
        return self.chosen[name].outputs[0]


def solve_sharding(prog: Program, opts: ShardOptions | None = None, layout: Layout | None = None) -> Sharding:
    """The strategy of every value of ``prog`` under ``opts``; with a memory budget nothing fits, an
    InfeasibleError naming the smallest budget that does. ``layout``: the problem's ``Layout``, built
    for ``prog`` under options that differ from ``opts`` at most in the cost model (``Layout.fits``)."""
    return solve_with_layout(prog, opts, layout)[0]


def solve_with_layout(
    prog: Program, opts: ShardOptions | None = None, layout: Layout | None = None
) -> tuple[Sharding, Layout]:
    """``solve_sharding``, and the problem's layout (``layout``, or the one it built) for the next problem alike."""
    opts = opts or ShardOptions()
    layout, b, groups, nodes, edges = _build(prog, opts, layout)
    try:
        sol = _solve_problem(nodes, edges, groups, opts)
    except InfeasibleError:
        if opts.budget_bytes is None:
            raise
        smallest = smallest_budget(prog, opts, layout)
        raise InfeasibleError(
            f"no strategy fits a per-device budget of {opts.budget_bytes / 2**30:.2f} GiB; the smallest that "
            f"fits is {smallest / 2**30:.2f} GiB ({smallest:,.0f} bytes): raise --budget-gb, add devices, or "
            "shard optimizer states (ZeRO)",
            smallest_budget_bytes=smallest,
        ) from None
    return _predict(b, groups, edges, sol), layout


def smallest_budget(prog: Program, opts: ShardOptions, layout: Layout | None = None) -> float:
    """The least per-device memory any strategy needs (the ILP with memory as the objective)."""
    # an infinite budget keeps every candidate not dominated in (cost, memory): the least memory too
    b, groups, nodes, edges = build_problem(prog, replace(opts, budget_bytes=float("inf")), layout)
    for n in nodes:
        n.costs = list(n.memory)
    for e in edges:
        e.cost = {k: 0.0 for k in e.cost}
    sol = _solve_problem(nodes, edges, groups, replace(opts, budget_bytes=None))
    return sum(g.memory[c] for g, c in zip(groups, sol.choice) if g.memory)


def _solve_problem(nodes: list[Node], edges: list[Edge], groups: list[Group], opts: ShardOptions) -> Solution:
    args = dict(budget=opts.budget_bytes, time_limit=opts.time_limit, backend=opts.backend, eliminate=opts.eliminate)
    found = repeated_layers(groups) if opts.reuse_layers else None
    if found is not None and opts.eliminate and opts.budget_bytes is None:
        reduced = reduce_problem(nodes, edges)
        if not reduced.edges:
            # elimination solves the whole problem exactly: folding would only restrict it to identical layers,
            # and joining each layer's end to its start (through a SharedReads node) can leave CBC a core
            sol = solve(nodes, edges, **args, reduced=reduced)
            sol.layers = 0
            return sol
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


def _predict(b: GroupBuilder, groups: list[Group], edges: list[Edge], sol: Solution) -> Sharding:
    """The chosen strategies and their totals: the groups' own costs plus the resharding between them."""
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
            vol, sec = _refund(a, bb)
            totals[2] -= vol
            totals[3] -= sec
        elif name == "same":  # a producer and its shared f's node: the placement as stored, nothing moved
            continue
        elif isinstance(name, tuple) and name[0] == "through":  # an f folded into gathers before its producer
            vol, sec = name[1].get((e.u_group[sol.choice[e.u]], e.v_group[sol.choice[e.v]]), (0.0, 0.0))
            totals[2] += vol
            totals[3] += sec
        elif isinstance(name, tuple) and name[0] == "folded":  # a resharding whose last gather takes the read's f
            t, (p, axes) = b.types[name[1]], bb
            if p is not None and a != p:
                vol, sec = b.cost.redistribute(t, a, p, True)
                sv, ss = b.cost.folded_f_saving(t, a, p, axes)
                totals[2] += vol - sv
                totals[3] += sec - ss
        elif isinstance(name, tuple):  # ("read", value, ...): a read through the value's SharedReads node
            _, value, wgrads, fused, wsums = name
            t, j = b.types[value], e.v_group[sol.choice[e.v]]
            vol, sec = _read_through(b, t, a, bb, grad=value in b.grad, fold=value in b.grad and not fused)
            totals[2] += vol
            totals[3] += sec - _hidden(b, t, a, bb, wgrads[j], fused, wsums[j])
        elif bb is not None and a != bb:
            vol, sec = b.cost.redistribute(b.types[name], a, bb, name in b.grad)
            totals[2] += vol
            totals[3] += sec
    compute = sum(g.compute_seconds[c] for g, c in zip(groups, sol.choice) if g.compute_seconds)
    return Sharding(sol, groups, chosen, sorted(b.unruled), *totals, compute_seconds=compute)


@dataclass
class Layout:
    """What ``build_problem`` builds before it prices anything: the groups with their candidates, which group
    holds each value, the values whose readers share a resharding (``_shared_reads``) and the targets without a
    sharding rule. Built from the options' constraints and the program alone, never the cost model: problems
    whose options differ only there (the dp, zero2 and zero3 baselines: the setup) start from one layout."""

    options: ShardOptions  # ``layout_options`` of the options it was built with
    groups: list[Group]
    where: dict[str, int]
    shared: dict[str, tuple[list, list[tuple]]]
    unruled: set[str]

    def fits(self, opts: ShardOptions) -> bool:
        """Whether this is the layout of a problem under ``opts``."""
        return layout_options(opts) == self.options

    def unpriced(self) -> list[Group]:
        """Fresh copies of the groups, as ``GroupBuilder.build_groups`` returns them (pricing fills a group's
        lists and replaces its candidate list; the candidates themselves are never changed, and are shared)."""
        return [Group(g.head, list(g.ops), list(g.values), list(g.candidates)) for g in self.groups]


def layout_options(opts: ShardOptions) -> ShardOptions:
    """``opts`` less what only prices the problem or solves it (a problem's ``Layout`` does not depend on it)."""
    return replace(
        opts, setup=TrainingSetup(), cluster=None, objective="time", alpha=1.0, budget_bytes=None, time_limit=None,
        backend="cbc", capacity_factor=None,
    )  # fmt: skip


def problem_layout(prog: Program, opts: ShardOptions) -> Layout:
    """The ``Layout`` of the strategy problem of ``prog`` under ``opts``."""
    return _layout(GroupBuilder(prog, opts))


def _layout(b: GroupBuilder) -> Layout:
    groups, where = b.build_groups()
    return Layout(layout_options(b.opts), groups, where, _shared_reads(b, groups, where), set(b.unruled))


def build_problem(
    prog: Program, opts: ShardOptions, layout: Layout | None = None
) -> tuple[GroupBuilder, list[Group], list[Node], list[Edge]]:
    """The program's strategy problem: one node per group (its candidates' objective and memory), an edge per
    value read across groups (the cost of moving it between each pair of placements), refund edges for
    parameters whose gradient two groups synchronize once, and an output sink that wants every output
    replicated. ``layout``: its ``Layout`` (``problem_layout``) where one was built already, for ``prog``
    under options that differ from ``opts`` at most in pricing (``Layout.fits``)."""
    return _build(prog, opts, layout)[1:]


def _build(
    prog: Program, opts: ShardOptions, layout: Layout | None
) -> tuple[Layout, GroupBuilder, list[Group], list[Node], list[Edge]]:
    """``build_problem``, and the layout it started from."""
    if layout is not None and not layout.fits(opts):
        raise SolverError("the layout was built under other constraints than these options'; build the problem anew")
    b = GroupBuilder(prog, opts)
    layout = layout or _layout(b)
    groups, where, shared = layout.unpriced(), layout.where, layout.shared
    b.unruled = set(layout.unruled)
    b.summed = {(op.result, pos) for reads, _ in shared.values() for _, op, pos in reads}
    priced: dict[tuple, Group] = {}
    for g in groups:
        # identical groups (the same group in every layer) have index-aligned candidates: price once
        sig = g.signature = b.signature(g)  # before pricing prunes impossible candidates
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
            label(g.head),
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
        members = g.results() | {v.name for v in g.values}
        for op in g.ops:
            for pos, ref in enumerate(b.refs(op)):
                if ref.name in members or (op.result, pos) in b.summed:
                    continue
                hi = where[ref.name]
                fold = None
                if b.folds(op, pos, ref.name):  # the read's f may fold into the resharding's last gather
                    fold = lambda c, op=op, pos=pos: partial_axes(c[op.result], c[op.result].inputs[pos])[:1]  # noqa: E731
                want = lambda c, op=op, pos=pos: c[op.result].inputs[pos]  # noqa: E731
                edges.append(_edge(b, groups, hi, gi, ref.name, want, fold))
    for name, (reads, keys) in shared.items():
        _add_shared_reads(b, groups, nodes, edges, where, name, reads, keys)
    for read in _fold_through_reads(b, groups, where):
        _add_fold_through(b, groups, nodes, edges, where, *read)
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
    return layout, b, groups, nodes, edges


def _sync_needs(b: GroupBuilder, g: Group, op: Op, pos: int, t: TensorType) -> list[tuple]:
    """Per candidate of g: for each mesh axis, the (bytes, seconds) of the gradient all-reduce that op's read of
    input ``pos`` needs there, bucketed after the backward and as an f of its own ((0, 0) twice where it needs
    none)."""
    out = []
    none = ((0.0, 0.0), (0.0, 0.0))
    for c in g.candidates:
        p = c[op.result].inputs[pos]
        partial = partial_axes(c[op.result], p)
        out.append(
            tuple(
                (b.cost.grad_reduce(t, p, a, True), b.cost.grad_reduce(t, p, a, False)) if a in partial else none
                for a in range(len(b.mesh.axes))
            )
        )
    return out


def _refund(a: tuple, c: tuple) -> tuple[float, float]:
    """(bytes, seconds) to take off two readers' syncs of one parameter (``_sync_needs`` of each): where both
    need an axis's, it is synchronized once, after the backward; where one alone does, `insert-collectives`
    cannot move its f to the parameter (the other read's gradient is whole), and it runs as an f of its own,
    with its latency (a negative refund)."""
    vol = sec = 0.0
    for (pb, pf), (qb, qf) in zip(a, c):
        if pb[0] and qb[0]:
            vol, sec = vol + min(pb[0], qb[0]), sec + min(pb[1], qb[1])
        elif pb[0] or qb[0]:
            bucketed, own = (pb, pf) if pb[0] else (qb, qf)
            vol, sec = vol - (own[0] - bucketed[0]), sec - (own[1] - bucketed[1])
    return vol, sec


def _shared_sync_edges(b: GroupBuilder, groups: list[Group], where: dict[str, int]) -> list[Edge]:
    """A parameter read by two ops in different groups (tied embeddings) whose gradients both need
    an axis's all-reduce gets it once, after backward (`insert-collectives` marks it grad_sync), but
    each read was priced with its own: an edge between the two readers refunds the smaller (``_refund``)."""
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
                vol, sec = _refund(a, c)
                cost[(x, y)] = b.objective(0.0, -vol, -sec, 0.0)
        e = Edge(g1, g2, ug, vg, cost)
        e.keys = ("refund", list(uids), list(vids))
        out.append(e)
    return out


MAX_SHARED_KEYS = 128  # candidates of a SharedReads node before its rarer shared gathers are left out


@dataclass
class SharedReads(Group):
    """What the readers of one value share: the value resharded once and Megatron's f once (LLaMA's q, k and v
    read one norm output, all-gathered once where it is sequence-sharded, with one f). One candidate per
    ``keys`` entry ``(stored placements, placements the sharing readers read, axes of the shared f)``."""

    keys: list[tuple] = field(default_factory=list)
    producer: int = -1  # the group of the value's producer


def _read_key(b: GroupBuilder, c: dict[str, Strategy], op: Op, pos: int, grad: bool = True) -> tuple:
    """(the placements a read of input ``pos`` wants, the axes where its gradient is a partial sum: the read is
    replicated there and the op's ranks compute different things; none without a ``grad``) of candidate ``c``."""
    p = c[op.result].inputs[pos]
    return p, partial_axes(c[op.result], p) if grad else ()


def _gathered(p: tuple, q: tuple) -> bool:
    """Whether ``q`` is ``p`` all-gathered over some axes (the resharding several readers typically share)."""
    return p != q and all(x == y or (isinstance(x, Shard) and isinstance(y, Replicate)) for x, y in zip(p, q))


def _shared_reads(b: GroupBuilder, groups: list[Group], where: dict[str, int]) -> dict[str, tuple[list, list[tuple]]]:
    """The values whose resharding or f two or more readers in other groups can share, each with its reads
    ``(group, op, input position)`` and the keys of its ``SharedReads`` node.

    ``insert-collectives`` reshards a value once per wanted placements and emits one f per those placements
    and axis, whichever ops read it; priced per reader, LLaMA's q/k/v would pay three all-reduces for the one
    the program runs, and an input all-gathered for three readers three all-gathers. A read shares when it
    wants the shared placements (with the same partial axes as the f, for the f); other reads pay their own
    resharding and f's, as before. The shared placements are the stored ones or an all-gather of them
    (``_gathered``), the gathers that more reads can want first, up to ``MAX_SHARED_KEYS`` candidates; other
    reshardings shared by several readers are priced per reader, an over-estimate. Parameters are left to
    ``_shared_sync_edges`` (their sync follows the backward); values each rank computes are never moved.
    """
    out = {}
    for name, users in b.users.items():
        if name in b.params or name in b.recomputable or name not in where:
            continue
        grad = name in b.grad  # else its readers share the resharding only: there is no f
        hi = where[name]
        reads = [
            (where[op.result], op, i)
            for op in users
            for i, r in enumerate(b.refs(op))
            if r.name == name and where[op.result] != hi
        ]
        if len(reads) < 2:
            continue
        stored = list(dict.fromkeys(b.placements_in(groups[hi], name)))
        wanted: dict[tuple, int] = {}  # placements -> how many reads can want them
        partial: dict[tuple, int] = {}  # (placements, partial axes) -> how many reads can want them so
        for gi, op, pos in reads:
            mine = {_read_key(b, c, op, pos, grad) for c in groups[gi].candidates}
            for q in {k[0] for k in mine if k[0] is not None}:
                wanted[q] = wanted.get(q, 0) + 1
            for k in mine:
                if k[1]:
                    partial[k] = partial.get(k, 0) + 1
        pinned = b.opts.pinned(name)
        # the gathers more reads can share first; past MAX_SHARED_KEYS the rest are priced per reader
        shared = sorted((q for q, n in wanted.items() if n >= 2 and not pinned), key=lambda q: -wanted[q])
        fs = {q: [(), *(k[1] for k, n in partial.items() if k[0] == q and n >= 2)] for q in [*stored, *shared]}
        keys = [(p, p, axes) for p in stored for axes in fs[p]]
        for q in shared:
            more = [(p, q, axes) for p in stored if _gathered(p, q) for axes in fs[q]]
            if len(keys) + len(more) > max(MAX_SHARED_KEYS, len(stored)):
                break
            keys += more
        if any(q != p or axes for p, q, axes in keys):
            out[name] = (reads, keys)
    return out


def _add_shared_reads(b, groups, nodes, edges, where, name: str, reads: list, keys: list[tuple]) -> None:
    """Value ``name``'s SharedReads node: its own cost is the shared resharding and f's all-reduces, an edge from the
    producer fixes its stored placements, and each read's edge prices what that read pays beyond them. The
    edges' costs are made once per value type, keys and reader candidates (the same in every layer)."""
    t = b.types[name]
    grad = name in b.grad
    producer = b.producers.get(name)
    path = producer.path if isinstance(producer, Op) and producer.path else ""
    head = Value(f"{path}:<shared by the readers of %{name}>", "input", t)
    g = SharedReads(head, keys=list(keys), producer=where[name])
    g.candidates = [{} for _ in keys]
    g.signature = ("shared", t, grad, tuple(keys), tuple(sorted(len(groups[gi].candidates) for gi, _, _ in reads)))
    fusable = [(op, pos) for _, op, pos in reads if column_weight(op, pos, b.types) is not None]
    for p, q, axes in keys:
        vol, sec = b.cost.redistribute(t, p, q, grad) if q != p else (0.0, 0.0)
        for a in axes:
            x, y = b.cost.grad_reduce(t, q, a)
            vol, sec = vol + x, sec + y
        if grad and not fusable:  # the shared f folds into the shared gather (no matmul fuses it)
            x, y = b.cost.folded_f_saving(t, p, q, axes)
            vol, sec = vol - x, sec - y
        g.memory.append(0.0)
        g.redundancy.append(0.0)
        g.comm_bytes.append(vol)
        g.comm_seconds.append(sec)
        g.compute_seconds.append(0.0)
    groups.append(g)
    fi = len(groups) - 1
    nodes.append(
        Node(label(g.head), [b.objective(0.0, v, x, 0.0) for v, x in zip(g.comm_bytes, g.comm_seconds)], g.memory)
    )
    hi = where[name]
    ug, uids = _group_ids(b.placements_in(groups[hi], name))
    vg, vids = _group_ids([p for p, _, _ in keys])
    e = Edge(hi, fi, ug, vg, {(i, j): 0.0 for i, p in enumerate(uids) for j, q in enumerate(vids) if p == q})
    e.keys = ("same", list(uids), list(vids))
    edges.append(e)
    pinned = b.opts.pinned(name)
    ug, uids = _group_ids(list(keys))
    alike = tuple(sorted((op.flops, op.bytes, column_weight(op, pos, b.types) in b.grad) for op, pos in fusable))
    for gi, op, pos in reads:
        vg, vids = _group_ids([_read_key(b, c, op, pos, grad) for c in groups[gi].candidates])
        weight = column_weight(op, pos, b.types)
        fused = weight is not None
        reader = (op.flops, op.bytes, weight in b.grad) if fused else None
        key = (t, tuple(uids), tuple(vids), pinned, grad, reader, alike)
        wgrads = [b.column_wgrad(op, pos, _split(rk)) if rk[0] is not None else 0.0 for rk in vids]
        # each read's share of f is its part of the fusable reads' weight gradients at its placements (the same
        # split for every read of the same f): alike or not (GQA's q against k/v), together they hide min(f, sum)
        wsums = [sum(b.column_wgrad(o, i, _split(rk)) for o, i in fusable) if rk[0] is not None else 0.0 for rk in vids]
        if key not in b.shared_edges:
            cost = {}
            for j, rk in enumerate(vids):
                for i, fk in enumerate(uids):
                    vol, sec = _read_through(b, t, fk, rk, pinned, grad, grad and not fused)
                    if vol != INF:
                        sec -= _hidden(b, t, fk, rk, wgrads[j], fused, wsums[j])
                        cost[(i, j)] = b.objective(0.0, vol, sec, 0.0)
            b.shared_edges[key] = cost
        e = Edge(fi, gi, ug, vg, dict(b.shared_edges[key]))
        e.keys = (("read", name, wgrads, fused, wsums), list(uids), list(vids))
        edges.append(e)


@dataclass
class FoldThrough(SharedReads):
    """Whether the f on one read (a ``cp`` one, on an activation no matmul reads there) folds into the all_gathers
    before the group producing the read value (``passes/collectives.reduce_scatter_gathered_grads``), where the
    all-gather form gathers the keys and values: before LLaMA's grouped-query repeat, whose group computes the
    read keys from them alike on every cp rank. Two candidates, not folded and folded; folded is allowed only with
    the read paying that f (edge to the reader, which takes its all-reduce back off), the producer's group
    computing alike on cp from reads the gathers give it (edge to it, which adds their reduce-scatters) and each
    value it gathers stored split on cp (edge to its producer); where folding saves no seconds (gloo runs a
    reduce-scatter as an all-reduce) the bytes it saves choose it, as the program folds whenever it can. Where it
    would cost more (gathered tensors over twice the read's bytes, or their latencies) the ILP keeps it apart and
    the program still folds: no attention path has such. A gather right before the read is priced on the read's
    edge (``CostModel.folded_f_saving``); gathers two groups up are not modelled (the rotary's: the ILP gathers
    after it, the same bytes for less computation)."""


def _fold_through_reads(b: GroupBuilder, groups: list[Group], where: dict[str, int]) -> list[tuple]:
    """The reads an f may fold through the producer's group (``FoldThrough``): ``(reader group, op, input
    position, producer group, boundary reads [(op, position, value)])`` where the value is an activation
    produced by another group and read by that op alone, by a plain edge, and its producer's group computes only
    from values made inside it, values without a gradient, and activations each read by one op of it alone
    (the boundary, at least one), none of its results read outside it but the read value."""
    cp = b._context_axes
    if not cp:
        return []
    out = []
    for gi, g in enumerate(groups):
        for op in g.ops:
            for pos, ref in enumerate(b.refs(op)):
                name = ref.name
                hi = where.get(name)
                if hi is None or hi == gi or (op.result, pos) in b.summed or not b.folds(op, pos, name):
                    continue
                if [u.result for u in b.users[name]] != [op.result] or name in b.outputs:
                    continue
                boundary = _through_boundary(b, groups[hi], name, where, gi)
                if boundary:
                    out.append((gi, op, pos, hi, boundary))
    return out


def _through_boundary(b: GroupBuilder, h: Group, read: str, where: dict[str, int], gi: int) -> list | None:
    """The boundary reads of group ``h`` for ``_fold_through_reads`` (None where ``h`` is not such a group)."""
    if not isinstance(h.head, Op) or isinstance(h, SharedReads) or any(v.name in b.grad for v in h.values):
        return None
    inside = h.results() | {v.name for v in h.values}
    ops = {o.result for o in h.ops}
    boundary = []
    for o in h.ops:
        for r in o.results:
            if r != read and (r in b.outputs or any(u.result not in ops for u in b.users[r])):
                return None
        for i, x in enumerate(b.refs(o)):
            if x.name in inside or x.name not in b.grad:
                continue
            producer = b.producers.get(x.name)
            if not isinstance(producer, Op) or x.name in b.outputs or (o.result, i) in b.summed:
                return None
            if [u.result for u in b.users[x.name]] != [o.result] or where[x.name] == gi:
                return None
            boundary.append((o, i, x.name))
    return boundary or None


def _add_fold_through(b, groups, nodes, edges, where, gi: int, op: Op, pos: int, hi: int, boundary: list) -> None:
    """The ``FoldThrough`` node of ``op``'s read of input ``pos`` and its three kinds of edges (each edge's
    ``(bytes, seconds)`` per pair of key ids in its keys, for ``_predict``)."""
    axis = b._context_axes[0]
    name = b.refs(op)[pos].name
    t, h = b.types[name], groups[hi]
    head = Value(f"{op.path}:<the f of %{name} folded into the gathers of its inputs>", "input", t)
    g = FoldThrough(head, keys=["apart", "folded"], producer=hi)
    g.candidates = [{}, {}]
    g.signature = ("through", t, pos, groups[gi].signature, h.signature)  # alike in every layer
    for arr in ("memory", "redundancy", "comm_bytes", "comm_seconds", "compute_seconds"):
        setattr(g, arr, [0.0, 0.0])
    groups.append(g)
    fi = len(groups) - 1
    nodes.append(Node(label(head), [0.0, 0.0], [0.0, 0.0]))

    def edge(v: int, keys: list, price) -> None:
        """An edge from the node to group ``v``, whose candidates have ``keys``: apart costs nothing, folded
        ``price(key)`` ((bytes, seconds), None: not allowed)."""
        vg, vids = _group_ids(keys)
        cost, terms = {}, {}
        for j, k in enumerate(vids):
            cost[(0, j)] = 0.0
            found = price(k)
            if found is not None:  # equal seconds (gloo runs a reduce-scatter as an all-reduce): fewer bytes win
                cost[(1, j)] = b.objective(0.0, *found, found[0])
                terms[(1, j)] = found
        e = Edge(fi, v, [0, 1], vg, cost)
        e.keys = (("through", terms), [0, 1], list(vids))
        edges.append(e)

    def f_back(k) -> tuple[float, float] | None:  # the read's f on cp, which folded takes back off its node
        if k is None or axis not in k[1]:
            return None
        vol, sec = b.cost.grad_reduce(t, k[0], axis)
        return -vol, -sec

    cands = groups[gi].candidates
    reads = [c[op.result].inputs[pos] for c in cands]
    edge(gi, [None if p is None else (p, partial_axes(c[op.result], p)) for c, p in zip(cands, reads)], f_back)

    def alike(c: dict) -> tuple | None:  # the reduce-scatters of the gathered reads, if h computes alike on cp
        for o in h.ops:
            s = c[o.result]
            if any(p is None or not isinstance(p[axis], Replicate) for p in (*s.inputs, *s.outputs)):
                return None
        vol = sec = 0.0
        for o, i, x in boundary:
            v, w = b.cost.gathered_grad(b.types[x], c[o.result].inputs[i], axis)
            vol, sec = vol + v, sec + w
        return vol, sec

    edge(hi, [alike(c) for c in h.candidates], lambda k: k)
    for u in dict.fromkeys(where[x] for _, _, x in boundary):
        xs = [x for _, _, x in boundary if where[x] == u]
        keys = [all(isinstance(b.placement_in(c, groups[u], x)[axis], Shard) for x in xs) for c in groups[u].candidates]
        edge(u, keys, lambda k: (0.0, 0.0) if k else None)


def _read_through(
    b: GroupBuilder,
    t: TensorType,
    fkey: tuple,
    rkey: tuple,
    pinned: bool = False,
    grad: bool = True,
    fold: bool = False,
) -> tuple[float, float]:
    """(bytes, seconds) a read of a value of type ``t`` pays beyond what its readers share, with the SharedReads node
    at ``fkey`` and the read at ``rkey`` (``_read_key``): nothing if it reads the shared placements with the
    shared f's partial axes, its own f's if it reads them with others, else its own resharding and its own
    f's (INF: a resharding ``pinned`` forbids), the first folded into a last gather when ``fold`` (no matmul's
    read, ``CostModel.folded_f_saving``)."""
    (p, q, shared), (want, axes) = fkey, rkey
    if want is None or (want == q and axes == shared):
        return 0.0, 0.0
    vol, sec = b.cost.redistribute(t, p, want, grad) if want != q else (0.0, 0.0)
    if pinned and vol:
        return INF, INF
    for a in axes:
        x, y = b.cost.grad_reduce(t, want, a)
        vol, sec = vol + x, sec + y
    if fold and want != q:
        x, y = b.cost.folded_f_saving(t, p, want, axes)
        vol, sec = vol - x, sec - y
    return vol, sec


def _split(rkey: tuple) -> list[bool]:
    """Whether a matmul reading at ``rkey`` (``_read_key``) divides its work over each axis: its read is sharded
    there, or replicated with an f (the weight sharded): ``is_divergent`` of its candidate."""
    want, axes = rkey
    return [not isinstance(p, Replicate) or a in axes for a, p in enumerate(want)]


def _hidden(b: GroupBuilder, t: TensorType, fkey: tuple, rkey: tuple, wgrad: float, fused: bool, wsum: float) -> float:
    """Seconds of the f a read shares or pays that weight gradients hide (``CostModel.f_hidden``), for a read
    that is (``fused``) or is not a matmul the runtime fuses with its f, ``wsum`` the weight gradients of all the
    value's fusable reads at the read's placements: the read's share ``wgrad / wsum`` of the f, up to its weight
    gradient ``wgrad``. Readers sharing it (LLaMA's q/k/v, alike or, with GQA, not) then hide ``min(f, wsum)``
    together, as the fused call does; fewer hide less than they would (an under-estimate of what is hidden). An
    f a read pays on its own is hidden in the same share: the program emits one f for every read of the same
    placements, which the ILP charges once per read (an over-estimate), and hiding each in full would make that
    over-count look as cheap as the shared f. A read the runtime cannot fuse, sharing the f, keeps the others
    from fusing: it is charged the whole f back (an over-estimate where they hid less). Of f's on two axes, the
    last one's: ``insert-collectives`` chains them in axis order, and the matmuls read (and are fused with) the
    last."""
    (_, q, shared), (want, axes) = fkey, rkey
    if not axes or not wsum:
        return 0.0
    f = b.cost.grad_reduce(t, want, axes[-1])[1]
    if fused:
        return b.cost.f_hidden(f * wgrad / wsum, wgrad)
    return -b.cost.f_hidden(f, f) if want == q and axes == shared else 0.0


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


def _edge(b: GroupBuilder, groups: list[Group], hi: int, gi: int, name: str, want, fold=None) -> Edge:
    """The resharding of value ``name`` from its producer's group ``hi`` to the reader's ``gi`` (which reads it at
    ``want(candidate)``). ``fold(candidate)``: the read's first f axis, if any, which ``insert-collectives`` folds
    into a last all_gather over it (``CostModel.folded_f_saving``, taken off the pair's cost; the f itself is on the
    reader's node)."""
    h, g = groups[hi], groups[gi]
    u_keys = b.placements_in(h, name)
    if fold is None:
        v_keys = [want(c) for c in g.candidates]
    else:
        v_keys = [(want(c), fold(c)) for c in g.candidates]
    ug, uids = _group_ids(u_keys)
    vg, vids = _group_ids(v_keys)
    if fold is None:
        e = Edge(hi, gi, ug, vg, b.edge_costs(b.types[name], list(uids), list(vids), name))
        e.keys = (name, list(uids), list(vids))  # for reporting the chosen pair's volume and time
        return e
    t, srcs, reads = b.types[name], list(uids), list(vids)
    places = list(dict.fromkeys(p for p, _ in reads))
    base = b.edge_costs(t, srcs, places, name)
    cost = {}
    for j, (p, axes) in enumerate(reads):
        col = places.index(p)
        for i, src in enumerate(srcs):
            if (i, col) in base:
                vol, sec = b.cost.folded_f_saving(t, src, p, axes)
                cost[(i, j)] = base[(i, col)] - b.objective(0.0, vol, sec, 0.0)
    e = Edge(hi, gi, ug, vg, cost)
    e.keys = (("folded", name), srcs, reads)
    return e


def _group_ids(keys):
    """Each key's index among the distinct keys (numbered in order of first appearance), and those keys."""
    ids: dict = {}
    seen: dict[int, int] = {}  # id(key) -> its index: candidates share their placement tuples, cheap to look up
    out = []
    for k in keys:
        i = seen.get(id(k))
        if i is None:
            i = seen[id(k)] = ids.setdefault(k, len(ids))
        out.append(i)
    return out, ids


def repeated_layers(groups: list[Group]) -> tuple[list[int], int] | None:
    """For each group its representative: the same group of the first layer alike (in every group) in the model's
    main layer stack (``transformer.h.N``, ``model.layers.N``), and how many layers share a representative layer
    with another; None when no two layers are alike. A stack of two kinds of layers (DeepSeek-V3's dense
    first layers and mixture-of-experts others, Qwen3-MoE's ``mlp_only_layers``) folds each kind onto its first.

    A SharedReads node goes with its producer: it stands for the node of its producer's representative when that
    has one with the same signature, else for itself. (The last layer's output may have one reader where the
    others have several, BERT's, and so no node: the layers are still alike.)"""
    layer_of = [
        None if isinstance(g, SharedReads) else layer_key(g.head.path if isinstance(g.head, Op) else g.head.name)
        for g in groups
    ]
    stacks: dict[str, dict[int, list[int]]] = {}
    for i, key in enumerate(layer_of):
        if key is not None:
            stacks.setdefault(key[0], {}).setdefault(key[1], []).append(i)
    if not stacks:
        return None
    stack = max(stacks.values(), key=len)
    layers = [stack[k] for k in sorted(stack)]
    kinds: dict[tuple, list[list[int]]] = {}  # the signatures of a layer's groups -> the layers with them
    for layer in layers:
        kinds.setdefault(tuple(groups[i].signature for i in layer), []).append(layer)
    folded = sum(len(alike) for alike in kinds.values() if len(alike) > 1)
    if not folded:
        return None
    rep = list(range(len(groups)))
    for alike in kinds.values():
        for layer in alike[1:]:
            for i, r in zip(layer, alike[0]):
                rep[i] = r
    shared = {(g.producer, g.signature): i for i, g in enumerate(groups) if isinstance(g, SharedReads)}
    for i, g in enumerate(groups):
        if isinstance(g, SharedReads):
            rep[i] = shared.get((rep[g.producer], g.signature), i)
    return rep, folded


def _rename(src: Group, dst: Group) -> list[dict[str, Strategy]]:
    """dst's candidates as the pruned (priced) list of src, matching members by position."""
    names = {a: b for x, y in zip(src.ops, dst.ops) for a, b in zip(x.results, y.results)}
    names |= {x.name: y.name for x, y in zip(src.values, dst.values)}
    if isinstance(src.head, Value):
        names[src.head.name] = dst.head.name
    return [{names[k]: v for k, v in c.items()} for c in src.candidates]
