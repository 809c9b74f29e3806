"""The ``prune-outputs`` pass: keep the training loss, drop what only other outputs needed."""

from __future__ import annotations

from autopar.ir.core import Program, iter_refs


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
