"""Key the program's dropouts: number each one and find the dim of its value that carries the batch.

Every dropout that draws a mask (training, p > 0) gets ``attrs = {rng: k, batch_dim: d}``: ``k`` is
its number among the program's dropouts in program order (the same on every mesh and schedule, and
in every pipeline stage that holds it), ``d`` the dim of its value along which a pipeline's
microbatches lie (``-1``: the value holds no batch rows, e.g. a dropout of a parameter; ``None``: not
found, which only matters when the program runs as several microbatches). Codegen turns each keyed
dropout into ``autopar.runtime.build.rng.keyed_dropout``.

The batch dim is found with the sharding rules (``solver/sharding/rules/``): a pipeline cuts dim 0 of
every user input into microbatches, which is the placement ``S(0)`` of each input on a virtual mesh
axis of microbatches. The rules propagate it: for each op, the one-axis strategy whose inputs are
the placements arriving (``S(d)`` for a batch-carrying input, ``R`` for the rest) gives the result's
placement, evaluated on whole-batch shapes (batch dims doubled), so a microbatch of one sample whose
batch dim a view drops (``[1, T, C] -> [T, C]``) is still followed (``[2T, C]``, rows ``S(0)``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.ir.core import Op, Partial, Program, R, Shard, TensorType
from autopar.solver.sharding.one_axis import Ctx
from autopar.solver.sharding.strategies import RULES

_VIRTUAL = 2  # microbatches on the virtual axis: any count works, the shapes only need to divide


def is_keyed(target: str, args: tuple) -> bool:
    """Whether an IR op is a dropout that draws a mask (training, p > 0)."""
    if target != "aten.dropout":
        return False
    p = args[1] if len(args) > 1 else 0.5
    train = args[2] if len(args) > 2 else True
    return bool(train) and not math.isclose(float(p), 0.0)


def has_keyed(ops) -> bool:
    """Whether any of the IR ``ops`` is a keyed dropout (numbered by :func:`key_dropouts`)."""
    return any("rng" in op.attrs for op in ops)


def key_dropouts(prog: Program) -> Program:
    """The program with every mask-drawing dropout numbered and its batch dim found."""
    keyed = [i for i, op in enumerate(prog.ops) if is_keyed(op.target, op.args)]
    if not keyed:
        return prog
    dims = batch_dims(prog)
    ops = list(prog.ops)
    for k, i in enumerate(keyed):
        op = ops[i]
        d = dims.get(op.args[0].name, "?")
        ops[i] = op.with_(attrs={**op.attrs, "rng": k, "batch_dim": None if d == "?" else d})
    return prog.with_(ops=tuple(ops))


def batch_dims(prog: Program) -> dict[str, int | str]:
    """Value name -> the dim holding the batch rows (-1: none; "?": unknown)."""
    dims: dict[str, int | str] = {}
    types = prog.types()
    for v in prog.inputs:
        dims[v.name] = 0 if v.kind == "input" and v.type.shape else -1
    for op in prog.ops:
        ins = op.input_refs()
        got = [dims.get(r.name, -1) for r in ins]
        if "?" in got:
            found: list[int | str] = ["?"] * len(op.results)
        elif all(d == -1 for d in got):
            found = [-1] * len(op.results)
        else:
            found = _propagate(op, [types[r.name] for r in ins], got)
        dims.update(zip(op.results, found))
    return dims


def _whole(t: TensorType, d: int) -> TensorType:
    if d < 0:
        return t
    shape = list(t.shape)
    shape[d] *= _VIRTUAL
    return replace(t, shape=tuple(shape), placements=(R,))


def _propagate(op: Op, in_types: list[TensorType], got: list) -> list[int | str]:
    """The batch dims of ``op``'s results from its inputs' (a rule's strategy that matches them)."""
    rule = RULES.get(op.target)
    if rule is None:
        return ["?"] * len(op.results)
    ins = [_whole(t, d) for t, d in zip(in_types, got)]
    want = tuple(Shard(d) if d >= 0 else R for d in got)
    candidates: list[int] = [-1] + list(range(len(op.types[0].shape)))
    for d in candidates:
        outs = [_whole(t, d) if d < len(t.shape) else t for t in op.types]
        try:
            strategies = rule(Ctx(op, ins, outs, _VIRTUAL, (1,)))
        except (IndexError, ValueError, ZeroDivisionError):  # a guessed batch dim the op's shapes refute
            continue
        for s_in, s_out in strategies:
            if not all(a is None or a == b for a, b in zip(s_in, want)):
                continue
            first = s_out[0]
            if d >= 0 and first == Shard(d):
                return [p.dim if isinstance(p, Shard) else "?" for p in s_out]
            if d < 0 and isinstance(first, Partial):
                return [-1] * len(op.results)  # the batch was reduced away (a sum or mean over it)
    return ["?"] * len(op.results)
