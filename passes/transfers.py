"""The ``insert-transfers`` pass: send/recv ops at every stage boundary of a staged program.

Input: a program after ``shard``, ``insert-collectives`` and ``assign-stages`` on the mesh *without* its pipeline
axis, whose ops carry ``stage=s``. Stages are contiguous runs of ops in program order.

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
autograd-aware collectives of ``autopar.runtime.comm.collectives``, so the gradient goes back the same
way (1/t on the wire, gathered by the sender).
"""

from __future__ import annotations

import math
from collections import defaultdict

from autopar.errors import PipelineError
from autopar.ir.axes import PIPELINE_AXIS, tensor_axes
from autopar.ir.core import Op, Program, Ref, Replicate, Shard, TensorType, iter_refs, map_refs
from autopar.passes.experts import require_whole_dispatch_regions
from autopar.passes.pipeline_split import common_nodes


def stage_of_op(op: Op) -> int:
    if "stage" not in op.attrs:
        raise PipelineError(f"%{op.result} = {op.target} has no stage annotation; run the assign-stages pass first")
    return int(op.attrs["stage"])


def _scatter_dim(t: TensorType, prog: Program, tp_axis: str | None) -> int | None:
    """The dim a boundary tensor replicated over ``tp_axis`` is cut along (last one that divides)."""
    if tp_axis is None or not t.is_float:
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


def insert_transfers(prog: Program, scatter_gather: bool = False) -> Program:
    """Add send/recv ops over the pipeline axis at stage boundaries, and with ``scatter_gather``
    local_shard/all_gather over the first tensor-parallel axis (``tp*``, ``ir/axes.py``) around them."""
    if any(op.target in ("send", "recv") for op in prog.ops):
        raise PipelineError("the program already has send/recv ops")
    require_whole_dispatch_regions(prog)
    num_stages = int(prog.attrs.get("pipeline_stages", 0)) or max((stage_of_op(op) for op in prog.ops), default=0) + 1
    stage_of: dict[str, int] = {}
    by_stage: dict[int, list[Op]] = defaultdict(list)
    prev = 0
    for op in prog.ops:
        s = stage_of_op(op)
        if s < prev:
            raise PipelineError(f"%{op.result} is in stage {s} after an op of stage {prev}: stages must be contiguous")
        prev = s
        by_stage[s].append(op)
        stage_of.update(dict.fromkeys(op.results, s))
    last: dict[str, int] = {}
    for op in prog.ops:
        for ref in op.input_refs():
            if ref.name in stage_of:
                last[ref.name] = max(last.get(ref.name, 0), stage_of_op(op))
    for ref in iter_refs(prog.outputs):
        if ref.name in stage_of:
            last[ref.name] = num_stages - 1
    crossing: list[list[str]] = [[] for _ in range(max(num_stages - 1, 0))]
    for op in prog.ops:
        for r in op.results:
            for b in range(stage_of[r], last.get(r, stage_of[r])):
                crossing[b].append(r)
    commons = common_nodes(prog)
    tp_axis = next(iter(tensor_axes(prog.mesh.names)), None)
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
                kw = {"axis": PIPELINE_AXIS, "peer_stage": t - 1, "grad": grad_of(x)}
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
                kw = {"axis": PIPELINE_AXIS, "peer_stage": t + 1, "grad": grad_of(x)}
                ops.append(Op((f"{x}.send{t + 1}",), (ty,), "send", (Ref(src),), kw, {"stage": t}))
        else:
            outputs = map_refs(prog.outputs, rename)
    attrs = dict(prog.attrs, pipeline_stages=num_stages, pipeline_axis=PIPELINE_AXIS)
    if scatter_gather and tp_axis is not None:
        attrs["scatter_gather"] = tp_axis
    return prog.with_(ops=tuple(ops), outputs=tuple(outputs), attrs=attrs)
