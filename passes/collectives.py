"""The `insert-collectives` pass: make every consumer see the placements it asked for.

Two kinds of ops are inserted:
- redistributions where a producer's placement differs from what a consumer requires (the `in`
  attribute written by `shard`), one op per step of ir/layout.py's plan: all_reduce (P->R),
  reduce_scatter (P->S), all_gather (S->R), all_to_all (S(a)->S(b) on one axis), local_shard (R->S, no
  communication);
- grad_all_reduce (Megatron's f: identity forward, all-reduce of the gradient backward) where a
  replicated float value feeds a computation that differs across an axis, because each rank's
  gradient of it is then only a partial sum.

A parameter whose every use needs f on an axis gets no f at all: its gradient is all-reduced once
after backward instead (data-parallel gradient sync), recorded as the attribute ``grad_sync``.

An f on a context-parallel axis (``cp``) computed from all_gathers over it (the all-gather form's keys and
values, gathered and then roped or repeated for grouped-query heads alike on every rank) is folded into
those gathers as ``reduce_grad``: the ranks' partial gradients are reduce-scattered backward, the gather's
adjoint, where f would all-reduce them and the gather keep the local shard (half the bytes, and of the
smaller tensor before the heads are repeated). An f that matmuls read keeps its own all-reduce: the runtime
fuses it with their weight gradients (``runtime/comm/column_linear.py``); on other axes f's are left as
they are (the sharding ILP prices a gather right before the read as folded, and gathers before the group
computing the read value from them: ``solver/sharding/solve.FoldThrough``).

Last, expert-parallel gathers get their token dispatch and combine (``passes/experts.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from networkx.utils import UnionFind

from autopar.ir.axes import CONTEXT_AXIS
from autopar.ir.core import (
    COLLECTIVES,
    Op,
    Partial,
    Placement,
    Program,
    Ref,
    Replicate,
    TensorType,
    Value,
    iter_refs,
    map_refs,
)
from autopar.ir.layout import redistribute_steps
from autopar.passes.experts import insert_expert_dispatch
from autopar.passes.shard import required_inputs
from autopar.solver.sharding.strategies import Strategy, column_weight, partial_axes

_KW = {
    "all_reduce": lambda a, b: {"op": a.op},
    "reduce_scatter": lambda a, b: {"op": a.op, "dim": b.dim, "chunks": b.chunks},
    "all_gather": lambda a, b: {"dim": a.dim, "chunks": a.chunks},
    "local_shard": lambda a, b: {"dim": b.dim, "chunks": b.chunks},
    "all_to_all": lambda a, b: {"src_dim": a.dim, "src_chunks": a.chunks, "dim": b.dim, "chunks": b.chunks},
}


class _Builder:
    def __init__(self, prog: Program):
        self.prog = prog
        self.types = prog.types()
        self.ops: list[Op] = []
        self.cache: dict[tuple, str] = {}
        self.counter = 0

    def fresh(self) -> str:
        self.counter += 1
        return f"c{self.counter}"

    def emit(self, target: str, src: str, ty: TensorType, kwargs: dict, path: str) -> str:
        name = self.fresh()
        self.ops.append(Op((name,), (ty,), target, (Ref(src),), kwargs, path=path))
        self.types[name] = ty
        return name

    def redistribute(self, name: str, dst: tuple[Placement, ...], path: str) -> str:
        key = ("r", name, dst)
        if key in self.cache:
            return self.cache[key]
        cur_name, cur = name, self.types[name]
        for step in redistribute_steps(cur.placements, dst):
            a, b = step.before[step.axis], step.after[step.axis]
            kw = {"axis": self.prog.mesh.names[step.axis], **_KW[step.kind](a, b)}
            new_t = cur.with_placements(step.after)
            cur_name, cur = self.emit(step.kind, cur_name, new_t, kw, path), new_t
        self.cache[key] = cur_name
        return cur_name

    def grad_reduce(self, name: str, axis: int, path: str) -> str:
        key = ("f", name, axis)
        if key not in self.cache:
            t = self.types[name]
            self.cache[key] = self.emit("grad_all_reduce", name, t, {"axis": self.prog.mesh.names[axis]}, path)
        return self.cache[key]


def insert_collectives(prog: Program) -> Program:
    b = _Builder(prog)
    grad = prog.requires_grad()
    for op in prog.ops:
        refs = op.input_refs()
        reqs = required_inputs(op) if "in" in op.attrs else [None] * len(refs)
        new_names: list[str] = []
        for ref, req in zip(refs, reqs):
            new_names.append(ref.name if req is None else b.redistribute(ref.name, req, op.path))
        placements = tuple(None if req is None else req for req in reqs)
        strategy = Strategy(placements, tuple(t.placements for t in op.types))
        if op.target not in COLLECTIVES:
            for i, (ref, req) in enumerate(zip(refs, reqs)):
                if req is None or ref.name not in grad:
                    continue
                for axis in partial_axes(strategy, req):
                    new_names[i] = b.grad_reduce(new_names[i], axis, op.path)
        args = map_refs((op.args, op.kwargs), _renamer(iter(new_names)))
        attrs = {k: v for k, v in op.attrs.items() if k != "in"}
        b.ops.append(op.with_(args=args[0], kwargs=args[1], attrs=attrs))
    out_refs = []
    sink_req = tuple(Replicate() for _ in prog.mesh.axes)
    for x in prog.outputs:
        out_refs.append(Ref(b.redistribute(x.name, sink_req, "")) if isinstance(x, Ref) else x)
    result = prog.with_(ops=tuple(b.ops), outputs=tuple(out_refs))
    return insert_expert_dispatch(reduce_scatter_gathered_grads(_defer_param_grad_sync(result)))


def reduce_scatter_gathered_grads(prog: Program) -> Program:
    """Each f folded into the all_gathers over its axis that its input is computed from (the module docstring):
    its region, back from f's input, holds ops every rank of the axis computes alike (its values replicated
    there, or moved on another axis) up to those gathers, each value read inside the region only; so the sum
    over the axis commutes with the region's backward, and each gather's backward reduce-scatters what reaches
    it. An f that a matmul reads, or whose region reaches anything else with a gradient (a parameter, a value
    computed differently by rank, a value read outside it), is left as it is."""
    users, producers, types = prog.users(), prog.producers(), prog.types()
    grad = prog.requires_grad()
    returned = {r.name for r in iter_refs(prog.outputs)}
    drop: dict[str, str] = {}  # f's result -> its input
    gathers: set[str] = set()
    for op in prog.ops:
        if op.target != "grad_all_reduce" or op.result in returned or op.kwargs["axis"] != CONTEXT_AXIS:
            continue
        if any(column_weight(u, 0, types) is not None and u.args[0].name == op.result for u in users[op.result]):
            continue
        found = _gathered_region(op, users, producers, types, grad, returned, prog.mesh.index(op.kwargs["axis"]))
        if found is not None and not (found & gathers):
            drop[op.result] = op.args[0].name
            gathers |= found
    if not drop:
        return prog
    rename = lambda r: Ref(drop.get(r.name, r.name))  # noqa: E731
    ops = []
    for op in prog.ops:
        if op.result in drop:
            continue
        if op.result in gathers:
            op = op.with_(kwargs={**op.kwargs, "reduce_grad": True})
        ops.append(op.with_(args=map_refs(op.args, rename), kwargs=map_refs(op.kwargs, rename)))
    return prog.with_(ops=tuple(ops), outputs=tuple(map_refs(prog.outputs, rename)))


def _gathered_region(f: Op, users, producers, types, grad, returned, a: int) -> set[str] | None:
    """The all_gathers over axis ``a`` (their results) that f's region reaches (``reduce_scatter_gathered_grads``),
    or None where the region is not one f may fold into."""
    axis = f.kwargs["axis"]
    region: set[str] = {f.result}  # ops' results inside the region
    found: set[str] = set()
    stack = [f.args[0].name]
    seen: set[str] = set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        p = producers.get(x)
        if not isinstance(p, Op) or x in returned:
            return None
        if p.target == "all_gather" and p.kwargs["axis"] == axis:
            if _resharded_param(p, producers):
                return None
            found.add(x)
            region.add(x)
            continue
        if p.target in COLLECTIVES:
            if p.kwargs.get("axis") == axis:
                return None
        elif not all(
            isinstance(types[n].placements[a], Replicate) for n in [*(r.name for r in p.input_refs()), *p.results]
        ):
            return None
        region.update(p.results)
        stack.extend(r.name for r in p.input_refs() if r.name in grad)
    for x in seen:  # every read of a value in the region is the region's
        if any(u.result not in region for u in users[x]):
            return None
    return found or None


def _resharded_param(op: Op, producers: dict) -> bool:
    """Whether collective ``op`` reshards a parameter (through other collectives): its f is priced with the
    parameter's gradient sync, and left as it is."""
    while isinstance(op, Op) and op.target in COLLECTIVES:
        op = producers.get(op.args[0].name)
    return isinstance(op, Value) and op.kind == "param"


def _renamer(names):
    return lambda _ref: Ref(next(names))


def _defer_param_grad_sync(prog: Program) -> Program:
    """Move each f on an axis up to the parameters its value is computed from, and sync their
    gradients after backward instead (DDP's bucketed all-reduce, overlapped with the backward).

    A backward is linear in the gradient it receives, so a sum over an axis commutes with any op
    every rank of that axis computes alike: an f on the output of an embedding lookup by replicated
    position ids (GPT-2's ``wpe``) can be an all-reduce of the table's gradient. f's on an axis are
    removed together, as one region, when

    - every value the region's f's are computed from, back to the parameters, comes from an op whose
      inputs and outputs are all replicated on the axis (every rank computes it alike) or from a
      collective on another axis (a linear map), and
    - every use of each of those values leads to one of the region's f's on the axis (a use that
      does not would receive a whole gradient, not a partial one), and
    - the parameters' gradients are no larger than the f'd values (an embedding table much larger
      than its lookup keeps its f: fewer bytes, one collective latency).
    """
    remove: dict[str, str] = {}  # f op result -> its input
    sync: dict[str, list[str]] = {}
    facts = _Facts(
        prog.users(), prog.producers(), prog.requires_grad(), prog.types(), {r.name for r in iter_refs(prog.outputs)}
    )
    for axis in prog.mesh.names:
        for fs, params in _deferrable_regions(prog, axis, facts):
            for f in fs:
                remove[f.result] = f.args[0].name
            for n in params:
                sync.setdefault(n, []).append(axis)
    if not remove:
        return prog
    ops = []
    for op in prog.ops:
        if op.result in remove:
            continue
        ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(_follow(r.name, remove)))))
    inputs = tuple(
        Value(v.name, v.kind, v.type, dict(v.attrs, grad_sync=sync[v.name])) if v.name in sync else v
        for v in prog.inputs
    )
    outputs = tuple(map_refs(prog.outputs, lambda r: Ref(_follow(r.name, remove))))
    return prog.with_(ops=tuple(ops), inputs=inputs, outputs=outputs)


class _Facts(NamedTuple):
    """What ``_deferrable_regions`` reads of the program, once for every axis."""

    users: dict[str, list[Op]]
    producers: dict[str, Value | Op]
    grad: set[str]
    types: dict[str, TensorType]
    returned: set[str]  # the program's outputs


def _deferrable_regions(prog: Program, axis: str, facts: _Facts) -> list[tuple[list[Op], list[str]]]:
    """(the f's on ``axis``, the parameters whose gradient sync replaces them) of each region that
    ``_defer_param_grad_sync`` may move up."""
    users, producers, grad, types = facts.users, facts.producers, facts.grad, facts.types
    returned = facts.returned
    a = prog.mesh.index(axis)

    def linear(op: Op) -> bool:  # commutes with a sum over the axis: computed alike by its ranks, or moved on another
        if op.target in COLLECTIVES:
            return op.kwargs.get("axis") != axis
        names = [r.name for r in op.input_refs()] + list(op.results)
        return all(isinstance(types[n].placements[a], Replicate) for n in names)

    def is_f(op: Op) -> bool:
        return op.target == "grad_all_reduce" and op.kwargs["axis"] == axis

    deferrable: dict[str, bool] = {}  # every use of the value's gradient leads to an f on the axis
    for name in [r for op in reversed(prog.ops) for r in op.results] + [v.name for v in prog.params]:
        if name in grad and name not in returned and not isinstance(types[name].placements[a], Partial):
            deferrable[name] = bool(users[name]) and all(
                is_f(u)
                or (linear(u) and all(deferrable.get(r, r not in grad) for r in u.results))
                for u in users[name]
            )  # fmt: skip
    fs = [op for op in prog.ops if is_f(op)]
    joined = UnionFind(range(len(fs)))
    owner: dict[str, int] = {}  # value -> the first f whose ancestry holds it
    ok: list[bool] = []
    params: list[set[str]] = []
    for k, f in enumerate(fs):
        good, found, seen, stack = True, set(), set(), [f.args[0].name]
        while stack and good:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            joined.union(owner.setdefault(x, k), k)
            prod = producers[x]
            good = deferrable.get(x, False)
            if isinstance(prod, Value):
                good = good and prod.kind == "param"
                found.add(x)
            elif good and linear(prod):
                stack.extend(r.name for r in prod.input_refs() if r.name in grad)
            else:
                good = False
        ok.append(good)
        params.append(found)
    out = []
    for members in joined.to_sets():
        found = set().union(*(params[k] for k in members))
        p_bytes = sum(types[n].local_nbytes(prog.mesh) for n in found)
        f_bytes = sum(types[fs[k].result].local_nbytes(prog.mesh) for k in members)
        if all(ok[k] for k in members) and p_bytes <= f_bytes:
            out.append(([fs[k] for k in sorted(members)], sorted(found)))
    return out


def _follow(name: str, remove: dict[str, str]) -> str:
    while name in remove:
        name = remove[name]
    return name
