"""Megatron's f fused with the column-parallel matmuls that read it: the input gradient's all-reduce overlaps the
weight gradients.

Megatron's f (``grad_all_reduce``) is the identity in the forward and all-reduces its gradient in the backward.
Run as separate autograd nodes, each matmul reading f's output computes its input *and* weight gradient in one
node, and only then does f's node start the all-reduce, with nothing left to compute while it travels. Fused
(Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``), the backward computes the input gradient of
every matmul reading f, starts its all-reduce, computes the weight (and bias) gradients while it is in flight,
and waits last.

A fused call stands for one f and *all* its readers (LLaMA's q/k/v projections read one f, its gate and up
projections another), because f's gradient is the sum of theirs: each reader is a ``mm`` (``x @ w``, GPT-2's
Conv1D, with an optional bias: ``addmm``) or a ``linear`` (``x @ w.T + b``). The forward runs each reader as
codegen would run it alone, so the outputs are the same bits; the backward's gradients are the same sums, the
input gradients accumulated in the order autograd would add them (the last reader's first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.core import Op, Program, Ref
from autopar.runtime.comm import pending as inflight  # by module: tests replace its functions
from autopar.runtime.comm.context import current_comm
from autopar.solver.sharding.strategies import column_weight

MM, LINEAR = "mm", "linear"


class _ColumnLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, kinds, *operands):
        n = len(kinds)
        weights, biases = operands[:n], operands[n:]
        ctx.comm, ctx.axis, ctx.kinds = current_comm(), axis, kinds
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        # a reader whose output the loss does not use gets None, as its own node would never run: its weight keeps
        # no gradient (an optimizer skips it) and adds nothing to f's
        ctx.set_materialize_grads(False)
        return tuple(_apply(kind, x, w, b) for kind, w, b in zip(kinds, weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        n = len(ctx.kinds)
        need = ctx.needs_input_grad
        live = [(i, kind, w, g) for i, (kind, w, g) in enumerate(zip(ctx.kinds, weights, grads)) if g is not None]
        pending = None
        if need[0] and live:
            gx = None
            for _, kind, w, g in reversed(live):
                part = g @ (w.t() if kind == MM else w)
                gx = part if gx is None else gx + part
            pending = inflight.bwd_grad_all_reduce(ctx.comm, gx, ctx.axis)  # in flight from here
        x2 = x.reshape(-1, x.shape[-1])
        gws: list[torch.Tensor | None] = [None] * n
        gbs: list[torch.Tensor | None] = [None] * n
        for i, kind, _, g in live:
            g2 = g.reshape(-1, g.shape[-1])
            if need[3 + i]:
                gws[i] = x2.t() @ g2 if kind == MM else g2.t() @ x2
            if ctx.has_bias[i] and need[3 + n + i]:
                gbs[i] = g2.sum(0)
        gx = pending.wait() if pending is not None else None
        return (gx, None, None, *gws, *gbs)


def _apply(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """One reader's forward, the call codegen makes for it alone."""
    if kind == MM:
        return torch.ops.aten.mm.default(x, w) if b is None else torch.ops.aten.addmm.default(b, x, w)
    return torch.ops.aten.linear.default(x, w, b)


def column_linears(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...],
    kinds: tuple[str, ...],
    axis: str,
) -> tuple[torch.Tensor, ...]:
    """``grad_all_reduce(x, axis)`` read by one matmul per entry of ``kinds`` (``"mm"``: ``x @ w (+ b)``;
    ``"linear"``: ``x @ w.T (+ b)``): their outputs, in order."""
    return _ColumnLinears.apply(x, axis, tuple(kinds), *weights, *biases)


@dataclass(frozen=True)
class Reader:
    """A matmul reading f's output: its op, its kind, its weight and bias values, and the value codegen binds
    to its output (the bias add's result where the add was fused into the matmul)."""

    op: Op
    kind: str
    weight: str
    bias: str | None
    result: str
    skipped: tuple[str, ...]  # the op results the fused call computes (the matmul, its bias add)


@dataclass(frozen=True)
class ColumnGroup:
    f: Op
    readers: tuple[Reader, ...]


def column_groups(
    prog: Program, types: dict, users: dict[str, list[Op]], bias_adds: dict[str, tuple[Op, str]]
) -> dict[str, ColumnGroup]:
    """f's result -> its fused group, for each ``grad_all_reduce`` that only matmuls read (as their input, with a
    2-D weight that is not f itself) and that the program does not return. ``bias_adds`` is codegen's add result
    -> (matmul, bias) of the adds it fuses into their matmul."""
    returned = {r.name for r in prog.outputs if isinstance(r, Ref)}
    add_of = {mm.result: (add, bias) for add, (mm, bias) in bias_adds.items()}
    out: dict[str, ColumnGroup] = {}
    for op in prog.ops:
        if op.target != "grad_all_reduce" or op.result in returned or not users[op.result]:
            continue
        readers = [_reader(u, op.result, add_of, types) for u in users[op.result]]
        if all(r is not None for r in readers):
            out[op.result] = ColumnGroup(op, tuple(readers))  # type: ignore[arg-type]
    return out


def _reader(u: Op, f: str, add_of: dict[str, tuple[str, str]], types: dict) -> Reader | None:
    """``u`` as a reader of f's output ``f``, or None where the fused call cannot stand for it: the form is the
    one the cost model hides f behind (``solver.sharding.strategies.column_weight``), so the two cannot drift apart."""
    weight = column_weight(u, 0, types)
    if weight is None or u.args[0].name != f:
        return None
    kind = MM if u.target == "aten.mm" else LINEAR
    bias = u.args[2].name if len(u.args) == 3 else None
    if u.result in add_of:  # the bias add codegen fuses into this matmul
        add, b = add_of[u.result]
        return Reader(u, kind, weight, b, add, (u.result, add))
    return Reader(u, kind, weight, bias, u.result, (u.result,))
