"""Pipeline stages in the IR: send/recv ops at every stage boundary, then one Program per stage.

Input: a program after ``shard`` and ``insert-collectives`` on the mesh *without* its pipeline axis,
whose ops carry ``stage=s`` (``autopar.solver.stages.plan_pipeline``). Stages are contiguous runs
of ops in program order.

``insert_transfers`` makes the boundaries explicit. Every value defined in stage ``a`` and used in a
later stage ``b`` (or a program output) crosses each boundary ``a -> a+1 -> ... -> b``: stage ``t``
ends with ``send`` ops and stage ``t+1`` starts with the matching ``recv`` ops, in the same order::

    %45.send1 : f32[2,16,64] {S(0),R} = send(%45) {axis=pp, peer_stage=1, grad=True} <stage=0>
    %45.recv1 : f32[2,16,64] {S(0),R} = recv() {axis=pp, peer_stage=0, grad=True} <stage=1>

``grad=True`` means a gradient flows back over the boundary: the value is not a *common node* (a
value no gradient flows through, such as an attention mask or rotary table; those are sent forward
only, once per stage that needs them, and passed along through stages that do not) and is a float.
A value needed two stages later is received and sent on by the stage between.

With ``scatter_gather=True`` (Megatron's scatter/gather of stage boundaries, PTD-P section 4.1) a
float boundary tensor replicated over the tensor-parallel axis is sent as 1/t: the sender cuts it
with ``local_shard`` (no communication), the receiver ``all_gather``s it back over tp. Both are the
autograd-aware collectives of ``autopar.runtime.collectives``, so the gradient goes back the same
way (1/t on the wire, gathered by the sender).

``stage_program(prog, s)`` cuts stage ``s`` out as a self-contained Program: received values first
(``input`` values with ``recv``/``grad`` attributes), then the user inputs, parameters and buffers it
reads; its outputs are what it sends, and for the last stage the model's outputs.
``split_for_recompute`` cuts a stage program once more, after a prefix of its subgraphs, for
Merak's stage-aware recomputation: the executor runs the prefix without stashing activations and
re-runs it before the backward.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from autopar.errors import PipelineError
from autopar.ir.core import Op, Program, Ref, Replicate, Shard, TensorType, Value, iter_refs, map_refs
from autopar.passes.pipeline_split import common_nodes

PP_AXIS = "pp"


def _stage(op: Op) -> int:
    if "stage" not in op.attrs:
        raise PipelineError(f"%{op.result} = {op.target} has no stage annotation; run plan_pipeline first")
    return int(op.attrs["stage"])


def _scatter_dim(t: TensorType, prog: Program, tp_axis: str) -> int | None:
    """The dim a boundary tensor replicated over ``tp_axis`` is cut along (last one that divides)."""
    if tp_axis not in prog.mesh.names or not t.is_float:
        return None
    i = prog.mesh.index(tp_axis)
    n = prog.mesh.sizes[i]
    if n == 1 or not isinstance(t.placements[i], Replicate):
        return None
    for d in reversed(range(len(t.shape))):
        factor = math.prod(s for p, s in zip(t.placements, prog.mesh.sizes) if isinstance(p, Shard) and p.dim == d)
        chunks = max((p.chunks for p in t.placements if isinstance(p, Shard) and p.dim == d), default=1)
        if t.shape[d] % (factor * n * chunks) == 0:
            return d
    return None


def insert_transfers(prog: Program, axis: str = PP_AXIS, scatter_gather: bool = False, tp_axis: str = "tp") -> Program:
    """Add send/recv ops (and, with ``scatter_gather``, local_shard/all_gather) at stage boundaries."""
    if any(op.target in ("send", "recv") for op in prog.ops):
        raise PipelineError("the program already has send/recv ops")
    num_stages = int(prog.attrs.get("pipeline_stages", 0)) or max((_stage(op) for op in prog.ops), default=0) + 1
    stage_of: dict[str, int] = {}
    by_stage: dict[int, list[Op]] = defaultdict(list)
    prev = 0
    for op in prog.ops:
        s = _stage(op)
        if s < prev:
            raise PipelineError(f"%{op.result} is in stage {s} after an op of stage {prev}: stages must be contiguous")
        prev = s
        by_stage[s].append(op)
        stage_of.update(dict.fromkeys(op.results, s))
    last: dict[str, int] = {}
    for op in prog.ops:
        for ref in op.input_refs():
            if ref.name in stage_of:
                last[ref.name] = max(last.get(ref.name, 0), _stage(op))
    for ref in iter_refs(prog.outputs):
        if ref.name in stage_of:
            last[ref.name] = num_stages - 1
    crossing: list[list[str]] = [[] for _ in range(max(num_stages - 1, 0))]
    for op in prog.ops:
        for r in op.results:
            for b in range(stage_of[r], last.get(r, stage_of[r])):
                crossing[b].append(r)
    commons = common_nodes(prog)
    types = prog.types()

    def grad_of(x: str) -> bool:
        return x not in commons and types[x].is_float

    def sent_type(x: str) -> tuple[TensorType, int | None]:
        t = types[x]
        d = _scatter_dim(t, prog, tp_axis) if scatter_gather else None
        if d is None:
            return t, None
        ps = list(t.placements)
        ps[prog.mesh.index(tp_axis)] = Shard(d)
        return t.with_placements(tuple(ps)), d

    ops: list[Op] = []
    outputs = prog.outputs
    for t in range(num_stages):
        cur: dict[str, str] = {}

        def rename(ref: Ref, cur=cur) -> Ref:
            return Ref(cur.get(ref.name, ref.name))

        if t > 0:
            for x in crossing[t - 1]:
                ty, d = sent_type(x)
                kw = {"axis": axis, "peer_stage": t - 1, "grad": grad_of(x)}
                name = f"{x}.recv{t}"
                ops.append(Op((name,), (ty,), "recv", (), kw, {"stage": t}))
                if d is not None:
                    gathered = f"{x}.s{t}"
                    gkw = {"axis": tp_axis, "dim": d, "chunks": 1}
                    ops.append(Op((gathered,), (types[x],), "all_gather", (Ref(name),), gkw, {"stage": t}))
                    name = gathered
                cur[x] = name
        for op in by_stage.get(t, []):
            args, kwargs = map_refs((op.args, op.kwargs), rename)
            ops.append(op.with_(args=args, kwargs=kwargs))
        if t < num_stages - 1:
            for x in crossing[t]:
                ty, d = sent_type(x)
                src = cur.get(x, x)
                if d is not None:
                    part = f"{x}.part{t + 1}"
                    skw = {"axis": tp_axis, "dim": d, "chunks": 1}
                    ops.append(Op((part,), (ty,), "local_shard", (Ref(src),), skw, {"stage": t}))
                    src = part
                kw = {"axis": axis, "peer_stage": t + 1, "grad": grad_of(x)}
                ops.append(Op((f"{x}.send{t + 1}",), (ty,), "send", (Ref(src),), kw, {"stage": t}))
        else:
            outputs = map_refs(prog.outputs, rename)
    attrs = dict(prog.attrs, pipeline_stages=num_stages, pipeline_axis=axis)
    if scatter_gather:
        attrs["scatter_gather"] = tp_axis
    return prog.with_(ops=tuple(ops), outputs=tuple(outputs), attrs=attrs)


# ---------------------------------------------------------------------------------------------
# Stage programs


@dataclass(frozen=True)
class StageProgram:
    """One stage cut out of a program with transfers: what it receives, computes and sends."""

    index: int
    num_stages: int
    program: Program  # inputs: received values, user inputs, params, buffers; outputs: sent values
    recv: tuple[Value, ...]  # received values in message order (attrs: grad)
    send: tuple[Value, ...]  # sent values in message order, typed as sent (attrs: grad)
    subgraphs: tuple[int, ...]  # the subgraph index of each op of ``program`` (-1 for transfer ops)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def user_inputs(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.program.inputs if v.kind == "input" and "recv" not in v.attrs)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.program.inputs if v.kind == "param")


def _used(ops, outputs) -> dict[str, None]:
    out: dict[str, None] = {}
    for op in ops:
        out.update(dict.fromkeys(r.name for r in op.input_refs()))
    out.update(dict.fromkeys(r.name for r in iter_refs(outputs)))
    return out


def stage_program(prog: Program, index: int) -> StageProgram:
    """Stage ``index`` of a program with transfers (``insert_transfers``) as a self-contained Program."""
    num_stages = int(prog.attrs["pipeline_stages"])
    mine = [op for op in prog.ops if _stage(op) == index]
    recv = [
        Value(op.result, "input", op.type, {"recv": op.kwargs["peer_stage"], "grad": op.kwargs["grad"]})
        for op in mine
        if op.target == "recv"
    ]
    sends = [op for op in mine if op.target == "send"]
    body = [op for op in mine if op.target not in ("send", "recv")]
    if index == num_stages - 1:
        outputs = prog.outputs
    else:
        outputs = tuple(op.args[0] for op in sends)
    used = _used(body, outputs)
    graph_inputs = [v for v in prog.inputs if v.name in used]
    stage_attrs = {"pipeline_stages": num_stages, "stage": index}
    sub = Program(prog.mesh, (*recv, *graph_inputs), tuple(body), tuple(outputs), stage_attrs)
    send = tuple(Value(op.result, "input", op.type, {"grad": op.kwargs["grad"]}) for op in sends)
    subgraphs = tuple(int(op.attrs.get("subgraph", -1)) for op in body)
    return StageProgram(index, num_stages, sub, tuple(recv), send, subgraphs)


def grad_values(prog: Program) -> set[str]:
    """Values a gradient flows through: float parameters, inputs marked ``grad``, and what they feed."""
    out = {
        v.name
        for v in prog.inputs
        if v.type.is_float and (v.kind == "param" or (v.kind == "input" and v.attrs.get("grad")))
    }
    for op in prog.ops:
        if any(r.name in out for r in op.input_refs()):
            out.update(r for r, t in zip(op.results, op.types) if t.is_float)
    return out


def recompute_cut(sp: StageProgram, fraction: Fraction) -> int:
    """Where the recomputed prefix of a stage ends (an op index of ``sp.program``).

    The prefix is the first ``round(fraction * n)`` of the stage's ``n`` subgraphs (at least one when
    ``fraction > 0``): subgraphs are the graph's natural cut points (half a transformer layer each),
    so this is Merak's "recompute a fraction of the stage's layers". ``len(ops)``: recompute all.
    """
    if fraction <= 0:
        return 0
    ids = sorted({s for s in sp.subgraphs if s >= 0})
    n = len(ids)
    if fraction >= 1 or n <= 1:
        return len(sp.program.ops)
    k = min(n, max(1, round(fraction * n)))
    if k == n:
        return len(sp.program.ops)
    first_tail = ids[k]
    return next(i for i, s in enumerate(sp.subgraphs) if s >= first_tail)


def split_for_recompute(prog: Program, cut: int) -> tuple[Program, Program]:
    """``prog.ops[:cut]`` and ``prog.ops[cut:]`` as two programs: the head's outputs are the values
    the tail (or the outputs) use, and they lead the tail's inputs, marked ``grad`` where a gradient
    flows through them; graph inputs go to whichever part reads them."""
    head_ops, tail_ops = prog.ops[:cut], prog.ops[cut:]
    defined = {r for op in head_ops for r in op.results}
    tail_used = _used(tail_ops, prog.outputs)
    crossing = [r for op in head_ops for r in op.results if r in tail_used]
    types = prog.types()
    grads = grad_values(prog)
    head_used = _used(head_ops, ())
    head = Program(
        prog.mesh,
        tuple(v for v in prog.inputs if v.name in head_used),
        tuple(head_ops),
        tuple(Ref(x) for x in crossing),
        dict(prog.attrs),
    )
    received = tuple(Value(x, "input", types[x], {"grad": x in grads, "head": True}) for x in crossing)
    tail_inputs = tuple(v for v in prog.inputs if v.name in tail_used and v.name not in defined)
    tail = Program(prog.mesh, (*received, *tail_inputs), tuple(tail_ops), prog.outputs, dict(prog.attrs))
    return head, tail


def prune_outputs(prog: Program, keep: int = 1) -> Program:
    """Keep the first ``keep`` outputs (the training loss) and drop every op nothing then needs."""
    outputs = tuple(prog.outputs[:keep])
    live = {r.name for r in iter_refs(outputs)}
    ops = []
    for op in reversed(prog.ops):
        if any(r in live for r in op.results):
            ops.append(op)
            live.update(r.name for r in op.input_refs())
    inputs = tuple(v for v in prog.inputs if v.name in live or v.kind == "input")
    return prog.with_(ops=tuple(reversed(ops)), outputs=outputs, inputs=inputs)


def local_types(values: tuple[Value, ...], prog: Program) -> list[tuple[tuple[int, ...], TensorType]]:
    """(local shape, type) of each value on this rank's mesh: what a receive buffer must hold."""
    return [(v.type.local_shape(prog.mesh), v.type) for v in values]


__all__ = [
    "PP_AXIS",
    "StageProgram",
    "grad_values",
    "insert_transfers",
    "local_types",
    "prune_outputs",
    "recompute_cut",
    "split_for_recompute",
    "stage_program",
]
