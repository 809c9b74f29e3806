"""The ``prune-outputs`` pass: keep the training loss, drop what only other outputs needed."""

from __future__ import annotations

from autopar.ir.core import Op, Program, TensorType, bound_args, iter_refs, resolve_target


def writes_in_place(op: Op) -> bool:
    """Whether ``op`` writes to one of its inputs (after functionalization: a buffer updated in place,
    ``passes/functionalize.py``); it is kept for that write even when nothing reads its result."""
    try:
        schema = resolve_target(op.target)._schema
    except (KeyError, AttributeError):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def updates_state(op: Op) -> bool:
    """Whether running ``op`` changes a buffer: an in-place write, or a norm in training mode that
    updates the running statistics it is given (``aten.batch_norm``, ``aten.instance_norm``)."""
    if writes_in_place(op):
        return True
    bound = bound_args(op) or {}
    return bound.get("running_mean") is not None and bool(bound.get("training", bound.get("use_input_stats")))


def first_output_type(prog: Program) -> TensorType | None:
    """The type of the program's first output (the training loss, when it is a scalar float), if it has one."""
    if not prog.outputs:
        return None
    return prog.types().get(getattr(prog.outputs[0], "name", ""))


def has_scalar_loss(prog: Program) -> bool:
    """Whether the first output is a scalar float: a training loss, which ``prune_outputs`` keeps."""
    t = first_output_type(prog)
    return t is not None and t.shape == () and t.is_float


def prune_outputs(prog: Program, keep: int = 1) -> Program:
    """Keep the first ``keep`` outputs (the training loss) and drop every op nothing then needs (an
    in-place write to a buffer is needed: its update outlives the step)."""
    outputs = tuple(prog.outputs[:keep])
    live = {r.name for r in iter_refs(outputs)}
    ops = []
    for op in reversed(prog.ops):
        if any(r in live for r in op.results) or writes_in_place(op):
            ops.append(op)
            live.update(r.name for r in op.input_refs())
    inputs = tuple(v for v in prog.inputs if v.name in live or v.kind == "input")
    return prog.with_(ops=tuple(reversed(ops)), outputs=outputs, inputs=inputs)
