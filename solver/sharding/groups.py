"""The decisions of the strategy problem: groups of ops and values, their candidate strategies and prices.

Decisions are made per *group*, not per op (DESIGN "Scale"):
- an op whose main (first tensor) input comes from a single-use op joins that op's group, so a chain
  linear -> add(bias) -> view -> gelu is one decision; its candidates are the head's strategies
  extended along the chain (branching only where a follower cannot take what arrives, in which
  case the group pays the resharding inside it);
- a parameter, buffer or input read by one op is folded into that op's group: it is stored the way
  its reader wants it.

Each candidate is priced by the cost model (solver/sharding/cost.py): memory, redundant memory, communication
bytes and seconds inside the group, computation seconds. Values every rank can compute for itself
(``recomputable``: inputs' integer tensors, buffers, ``arange`` and the cheap ops of those, nothing
that needs a gradient) are never moved: every placement change of one that would communicate is
priced as impossible, so position ids and masks are computed (replicated) where they are needed and
sliced locally, never gathered. A partial sum of such values (the count of non-ignored targets over
rows split across ranks) is reduced.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import InfeasibleError
from autopar.ir.axes import CONTEXT_AXIS, is_data_axis
from autopar.ir.core import VIEW_OPS, Op, Partial, Placement, Program, R, TensorType, Value, map_refs
from autopar.solver.sharding.blocks import layer_key
from autopar.solver.sharding.cost import INF, CostModel
from autopar.solver.sharding.experts import EP_BLOCK
from autopar.solver.sharding.options import ShardOptions
from autopar.solver.sharding.rules.context import attention_form
from autopar.solver.sharding.saved import SavedValues, extra_bytes, saved_values
from autopar.solver.sharding.strategies import (
    ATTENTION,
    Strategy,
    chunk_counts,
    column_weight,
    is_divergent,
    is_follower,
    op_strategies,
    partial_axes,
    value_strategies,
)

MAX_GROUP_CANDIDATES = 2048
CHEAP_FLOPS_PER_ELEMENT = 16  # an op doing at most this many FLOPs per output element is cheap to recompute


def recomputable(prog: Program, global_batch: bool = True) -> set[str]:
    """Values each rank can compute for itself at least as cheaply as it could receive them: non-float
    inputs (every rank holds the global batch; not with ``global_batch=False``, where each data-parallel
    rank is given its rows only), buffers, and the results of views and cheap ops (at most
    ``CHEAP_FLOPS_PER_ELEMENT`` per output element, e.g. ``arange``, comparisons, cumsum) whose tensor
    inputs are all recomputable; never a value whose gradient backward needs."""
    grad = prog.requires_grad()
    out = {
        v.name
        for v in prog.inputs
        if v.kind == "buffer" or (v.kind == "input" and not v.type.is_float and global_batch)
    }
    for op in prog.ops:
        if any(r in grad for r in op.results) or any(r.name not in out for r in op.input_refs()):
            continue
        numel = sum(t.nbytes / max(t.itemsize, 1) for t in op.types)
        if op.target in VIEW_OPS or op.flops <= CHEAP_FLOPS_PER_ELEMENT * max(numel, 1):
            out.update(op.results)
    return out


_LAST_SAVED: tuple | None = None  # (a weak reference to the program last built, its saved_values)


def _saved_values(prog: Program) -> SavedValues:
    """``saved_values(prog)``, once for the builders of one program (the plan's solve and its baselines build
    several problems of it; the IR is never changed in place)."""
    global _LAST_SAVED
    last = _LAST_SAVED
    if last is not None and last[0]() is prog:
        return last[1]
    saved = saved_values(prog)
    _LAST_SAVED = (weakref.ref(prog), saved)
    return saved


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
    signature: tuple = ()  # what its candidates and prices depend on (GroupBuilder.signature); () unset

    def results(self) -> set[str]:
        """Names of the results of the group's ops."""
        return {r for op in self.ops for r in op.results}


class GroupBuilder:
    """The program's decisions: groups of ops and folded values, each with its candidate strategies and
    their prices under the options' cost model and objective."""

    def __init__(self, prog: Program, opts: ShardOptions):
        self.prog, self.opts = prog, opts
        self.mesh = prog.mesh
        self.types = prog.types()
        self.cost = CostModel(prog.mesh, opts.setup, opts.cluster)
        self.cost.price_program(prog)  # a compiled plan's ops priced as their fused kernels (setup.compiled)
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
        # a local batch's integer inputs are where their rows were dealt over the dp* axes: moving them is
        # communication (without a dp* axis a local batch is the global one)
        local = opts.batch == "local" and any(is_data_axis(n) and s > 1 for n, s in prog.mesh.axes)
        self.recomputable = recomputable(prog, global_batch=False) if local else recomputable(prog)
        self.params = {v.name for v in prog.params}
        self.saved = _saved_values(prog)  # activations: what autograd keeps for backward, not every output
        self.summed: set[tuple[str, int]] = set()  # (op result, input position): reads a SharedReads node prices
        self._context_axes = [a for a, (n, size) in enumerate(self.mesh.axes) if n == CONTEXT_AXIS and size > 1]
        self.shared_edges: dict[tuple, dict] = {}  # SharedReads edges' costs by value type, keys and reader candidates

    # -- strategies -----------------------------------------------------------------------------
    def op_strats(self, op: Op) -> list[Strategy]:
        # strategies depend on the target, the types and the non-tensor arguments only: ops repeated
        # in every layer share one enumeration
        key = (op.target, tuple(self.types[r.name] for r in self.refs(op)), op.types, unnamed((op.args, op.kwargs)))
        if key not in self._strat_cache:
            self._strat_cache[key] = op_strategies(op, self.types, self.mesh, self.counts)
        strats, ruled = self._strat_cache[key]
        if not ruled:
            self.unruled.add(op.target)
        form, cp = self.opts.context_attention, self._context_axes
        if form != "auto" and cp and op.target == ATTENTION:  # that form on every cp axis
            ins = [self.types[r.name] for r in self.refs(op)]
            strats = [s for s in strats if all(attention_form(ins, s.inputs, a) == form for a in cp)]
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
        return f"{label(g.head)} has no sharding candidate on mesh {self.mesh}; a bug in autopar, please report it"

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
        if layer_key(producer.path) != layer_key(op.path):
            return None  # chains stop at layer boundaries, so repeated layers stay identical
        return where[main]

    def _extend(self, g: Group, op: Op, strats: list[Strategy]) -> list[dict] | None:
        main = self.refs(op)[0].name
        by_input: dict = {}
        for s in strats:
            by_input.setdefault(s.inputs[0], []).append(s)
        anything = by_input.get(None, [])
        out = []
        key, k = self.output_of(g, main)
        for cand in g.candidates:
            incoming = cand[key].outputs[k]
            fitting = by_input.get(incoming, []) + anything
            for s in fitting or strats:
                out.append({**cand, op.result: s})
            if len(out) > MAX_GROUP_CANDIDATES:
                return None
        return out

    def placement_in(self, cand: dict[str, Strategy], g: Group, name: str) -> tuple[Placement, ...]:
        key, k = self.output_of(g, name)
        return cand[key].outputs[k]

    def placements_in(self, g: Group, name: str) -> list[tuple[Placement, ...]]:
        """``placement_in`` of every candidate of g, in order."""
        key, k = self.output_of(g, name)
        return [c[key].outputs[k] for c in g.candidates]

    @staticmethod
    def output_of(g: Group, name: str) -> tuple[str, int]:
        """Where a candidate of g keeps member ``name``'s placements: (the strategy's key, which output)."""
        for op in g.ops:
            if name in op.results:
                return op.result, op.results.index(name)
        return name, 0

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
    def signature(self, g: Group) -> tuple:
        """Everything ``price`` reads of a group, without value names: groups with equal signatures (the same
        group in every layer) have index-aligned candidates and equal prices, and are priced once.

        Types and arguments alone are not enough: a linear reading the user's input and one reading an
        activation (BERT's first q projection and its attention output dense, alike in shape) differ in the
        gradient all-reduce they need, and a weight that is not folded into its reader leaves down_proj and
        o_proj with one output type."""
        if isinstance(g.head, Value):
            frozen = bool(g.head.attrs.get("frozen"))
            return ("value", g.head.kind, g.head.type, frozen, tuple(tuple(c.values()) for c in g.candidates))
        index = {r: k for k, op in enumerate(g.ops) for r in op.results}
        ops = []
        for op in g.ops:
            reads = tuple(
                (
                    self.types[r.name],
                    index.get(r.name, -1),  # produced inside the group: by which op
                    r.name in self.grad,
                    len(self.users[r.name]) if r.name in self.params else 0,
                    r.name in self.recomputable,
                    (op.result, i) in self.summed,
                )
                for i, r in enumerate(self.refs(op))
            )
            saved = tuple(self.saved.activation(r) for r in op.results), self.saved.extra.get(op.result)
            block = op.attrs.get(EP_BLOCK)  # an expert block's grouped matmul is priced by its place in it
            share = self.cost.compiled_share(op)  # a compiled plan: its share of its fused kernel (None: eager)
            ops.append(
                (op.target, reads, op.types, op.flops, op.bytes, unnamed((op.args, op.kwargs)), saved, block, share)
            )
        values = tuple((v.kind, v.type, self.saved.activation(v.name), bool(v.attrs.get("frozen"))) for v in g.values)
        return ("ops", tuple(ops), values, len(g.candidates))

    def price(self, g: Group) -> None:
        # an op's terms depend on its strategy (and, after the group's first op, on the placement it reads from the
        # op before it) only, which many candidates share: each is computed once, then added in the order the
        # candidate's total sums them (so every total is the one summed term by term)
        memo: dict[tuple, list[tuple[int, float]]] = {}
        results = g.results()
        # the ops after the first that read their main input from inside the group: where that input is held
        mains = [self.refs(op)[0].name if k and self.refs(op) else None for k, op in enumerate(g.ops)]
        inner = [self.output_of(g, name) if name in results else None for name in mains]
        for cand in g.candidates:
            mem = red = vol = sec = flop_sec = 0.0
            for v in g.values + ([g.head] if isinstance(g.head, Value) else []):
                p = cand[v.name].outputs[0]
                m, r = (
                    self.cost.param_memory(v.type, p, bool(v.attrs.get("frozen")))
                    if v.kind == "param"
                    else self.cost.activation_memory(v.type, p)
                )
                mem, red = mem + m, red + r
            total = [mem, red, vol, sec, flop_sec]
            for k, op in enumerate(g.ops):
                s = cand[op.result]
                src = cand[inner[k][0]].outputs[inner[k][1]] if inner[k] is not None else None
                key = (k, id(s), id(src))
                terms = memo.get(key)
                if terms is None:
                    terms = memo[key] = self._op_terms(op, s, src)
                for j, x in terms:
                    total[j] += x
            mem, red, vol, sec, flop_sec = total
            g.memory.append(mem)
            g.redundancy.append(red)
            g.comm_bytes.append(vol)
            g.comm_seconds.append(sec)
            g.compute_seconds.append(flop_sec)
        keep = [i for i, v in enumerate(g.comm_bytes) if v != INF]  # impossible reshards inside the group
        if not keep:
            raise InfeasibleError(f"every strategy of {label(g.head)} needs an impossible redistribution")
        for name in ("candidates", "memory", "redundancy", "comm_bytes", "comm_seconds", "compute_seconds"):
            arr = getattr(g, name)
            setattr(g, name, [arr[i] for i in keep])

    def _op_terms(self, op: Op, s: Strategy, src: tuple[Placement, ...] | None) -> list[tuple[int, float]]:
        """What op with strategy ``s`` adds to its candidate's (memory, redundancy, comm bytes, comm seconds, compute
        seconds), in order, as (which, amount); ``src``: where its main input is held, when the op before it in
        the group computes it (the group pays the resharding between them)."""
        MEM, RED, VOL, SEC, FLOP = range(5)
        out: list[tuple[int, float]] = []
        b, x = self.cost.inherent(op.target, [self.types[r.name] for r in self.refs(op)], s.inputs, op)
        out += [(VOL, b), (SEC, x)]
        split = [is_divergent(s, a) for a in range(len(self.mesh.axes))]
        out.append((FLOP, self.cost.op_seconds(op, self.types, split, s.inputs)))
        for name, t, p in zip(op.results, op.types, s.outputs):
            if self.saved.activation(name):
                m, r = self.cost.activation_memory(t, p)
                out += [(MEM, m), (RED, r)]
        extra = self.saved.extra.get(op.result)
        if extra:
            m = extra_bytes(op, extra, self.types, self.mesh.sizes, [*s.inputs, *s.outputs])
            out += [(MEM, m), (RED, m * (self.cost.replication(s.outputs[0]) - 1))]
        for i, (ref, p) in enumerate(zip(self.refs(op), s.inputs)):
            if p is None:
                continue
            t = self.types[ref.name]
            came = src if i == 0 else None
            if came is not None:
                b, x = self.cost.redistribute(t, came, p, ref.name in self.grad)
                if b and ref.name in self.recomputable and not has_partial(came):
                    b = x = INF  # computed where it is needed, never moved (a partial sum is reduced)
                out += [(VOL, b), (SEC, x)]
            if ref.name in self.grad and (op.result, i) not in self.summed:
                # a parameter read by two ops whose gradients both need the sync is all-reduced
                # once (grad_sync): `_shared_sync_edges` refunds one; by k > 2, each pays 1/k;
                # an activation's f that readers share is priced on its SharedReads node (solve.py)
                readers = len(self.users[ref.name]) if ref.name in self.params else 1
                share = 1.0 if readers <= 2 else 1 / readers
                axes = partial_axes(s, p)
                for a in axes:
                    b, x = self.cost.grad_reduce(t, p, a, ref.name in self.params)
                    out += [(VOL, share * b), (SEC, share * x)]
                if self.folds(op, i, ref.name):  # its first f folded into the gather: a reduce-scatter
                    b, x = self.cost.folded_f_saving(t, came, p, axes)
                    out += [(VOL, -b), (SEC, -x)]
                if axes and ref.name not in self.params:  # the last f, which op reads: fused with it
                    split = [is_divergent(s, a) for a in range(len(self.mesh.axes))]
                    out.append((SEC, -self.cost.f_hidden(x, self.column_wgrad(op, i, split))))
        return out

    def folds(self, op: Op, pos: int, name: str) -> bool:
        """Whether an f on ``op``'s read of input ``pos`` (value ``name``) folds into an all_gather before it
        (``passes/collectives.reduce_scatter_gathered_grads``): an activation with a gradient that no matmul reads
        there (a matmul's f the runtime fuses with its weight gradient instead)."""
        return name in self.grad and name not in self.params and column_weight(op, pos, self.types) is None

    def column_wgrad(self, op: Op, pos: int, split: list[bool]) -> float:
        """``CostModel.column_wgrad`` of ``op``'s read of input ``pos`` in this program."""
        return self.cost.column_wgrad(op, pos, self.types, self.grad, split)

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
        if name and self.opts.pinned(name):
            possible &= vol == 0  # used where it is stored
        if name in self.recomputable:  # never moved; but a partial sum (a count over split rows) is reduced
            reduced = np.array([has_partial(s) for s in srcs], dtype=bool)[:, None]
            possible &= (vol == 0) | reduced
        rows, cols = np.nonzero(possible)
        return dict(zip(zip(rows.tolist(), cols.tolist()), cost[rows, cols].tolist()))


def has_partial(placements) -> bool:
    return placements is not None and any(isinstance(p, Partial) for p in placements)


def label(x: Op | Value) -> str:
    return f"%{x.result} = {x.target}" if isinstance(x, Op) else f"{x.kind} %{x.name}"


def unnamed(x):
    """Arguments with every value reference replaced by a placeholder."""
    return repr(map_refs(x, lambda r: "%"))
