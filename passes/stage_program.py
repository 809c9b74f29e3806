"""One stage of a program with transfers as a self-contained Program (what the runtime builds a rank's
stage module from), and the recompute cut inside a stage.

``stage_program(prog, s)`` cuts stage ``s`` out as a self-contained Program: received values first
(``input`` values with ``recv``/``grad`` attributes), then the user inputs, parameters and buffers it
reads; its outputs are what it sends, and for the last stage the model's outputs.
``split_for_recompute`` cuts a stage program once more, after a prefix of its subgraphs, for
Merak's stage-aware recomputation: the executor runs the prefix without stashing activations and
re-runs it before the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from autopar.ir.core import Program, Ref, Value, iter_refs
from autopar.passes.transfers import stage_of_op


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
    mine = [op for op in prog.ops if stage_of_op(op) == index]
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
