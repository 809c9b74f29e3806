"""The loss's own weighting, read from the program: a piece's weight is the divisor of its mean.

A model's loss is often a mean over items the batch holds unequally: a cross-entropy over the targets
that are not ``ignore_index`` (the IR lowers it as ``sum / count``, passes/lower.py). Averaging the
microbatches' means then weighs a target of a short microbatch more than one of a long one; one
device computes one mean over the whole batch. When the program's loss is such a ratio, ``a / c``
with the divisor ``c`` computed from the user's inputs alone (no parameter, buffer or value received
from another stage reaches it), each piece weighs its ``c`` (``loss_scales``), and the step's loss
and gradient are the whole batch's mean, with no option to set.

The divisor is computed by the program's own ops: the ops ``c`` depends on, with the collectives the
plan put among them (a count over rows split across data-parallel ranks is all-reduced before the
division), are generated as one more GraphModule of the rank (``ProgramWeight``) and run on each
piece's inputs as the stages get them, before the step: a 1F1B schedule back-propagates the first
microbatch before the last one's forward, so every weight is needed up front.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from autopar.errors import BatchError
from autopar.ir.core import Op, Partial, Program, Ref, bound_args
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.execute.stage_runner import Part

DIVISION = "aten.div.Tensor"
# ops between the division and the output that leave its (global) value as it is: copies, and the collectives
# that only place it (a partial ratio, the numerator summed over a tensor-parallel vocabulary, is reduced after)
SAME_VALUE = frozenset(
    {"aten.clone", "aten.alias", "aten.detach", "aten._to_copy", "aten.view", "aten.reshape"}
    | {"all_reduce", "all_gather", "local_shard", "all_to_all"}
)
TRANSFERS = frozenset({"send", "recv"})


def divisor_program(program: Program) -> Program | None:
    """The ops computing the divisor of ``program``'s loss (its first output, a float scalar) from the
    user's inputs, as a program whose inputs are those inputs and whose output is the divisor; ``None``
    when the loss is no such ratio (any other loss, a divisor reached by a parameter, a buffer or a
    transfer, a constant divisor: the pieces then weigh the same)."""
    if not program.outputs or not isinstance(program.outputs[0], Ref):
        return None
    types = program.types()
    loss = program.outputs[0].name
    if types[loss].shape != () or not types[loss].is_float:
        return None
    producers = program.producers()
    op = producers.get(loss)
    while isinstance(op, Op) and op.target in SAME_VALUE and len(op.input_refs()) == 1:
        op = producers.get(op.input_refs()[0].name)
    if not isinstance(op, Op) or op.target != DIVISION or len(op.args) < 2 or not isinstance(op.args[1], Ref):
        return None
    divisor = op.args[1].name
    if any(isinstance(p, Partial) for p in types[divisor].placements):
        return None
    needed: set[str] = set()
    inputs: set[str] = set()
    stack = [divisor]
    while stack:
        name = stack.pop()
        x = producers[name]
        if not isinstance(x, Op):
            if x.kind != "input":
                return None  # a parameter or buffer: the weight would not come from the data alone
            inputs.add(name)
            continue
        if x.target in TRANSFERS:
            return None
        if x.result not in needed:
            needed.add(x.result)
            stack.extend(r.name for r in x.input_refs())
    if not inputs:
        return None  # a constant divisor: equal pieces weigh the same
    return program.with_(
        inputs=tuple(v for v in program.inputs if v.name in inputs),
        ops=tuple(o for o in program.ops if o.result in needed),
        outputs=(Ref(divisor),),
    )


class ProgramWeight:
    """A piece's loss weight: the divisor of its loss, computed by this rank's GraphModule of
    ``divisor_program`` from the piece's inputs as the stages get them (its collectives over ``comm``;
    every rank holding the loss's stage computes it for every piece)."""

    def __init__(self, part: Part, comm: Comm):
        self.part, self.comm = part, comm

    @property
    def inputs(self) -> tuple[str, ...]:
        """The program inputs it reads."""
        return self.part.inputs

    @torch.no_grad()
    def __call__(self, env: Mapping[str, torch.Tensor]) -> float:
        with use_comm(self.comm):
            (count,) = self.part(dict(env))
        return float(count)


SUM_REDUCTION = 2  # torch's Reduction enum: None 0, Mean 1, Sum 2


def summed_loss(program: Program) -> Op | None:
    """The op that makes ``program``'s loss (its first output) a sum over its inputs' items, when it is
    one: a loss op given ``reduction="sum"`` (``F.mse_loss(..., reduction="sum")``), through copies."""
    if not program.outputs or not isinstance(program.outputs[0], Ref):
        return None
    producers = program.producers()
    op = producers.get(program.outputs[0].name)
    while isinstance(op, Op) and op.target in SAME_VALUE and len(op.input_refs()) == 1:
        op = producers.get(op.input_refs()[0].name)
    bound = bound_args(op) if isinstance(op, Op) else None
    return op if bound is not None and bound.get("reduction") == SUM_REDUCTION else None


def program_weight(
    program: Program, build: Callable[[Program, str], Part], comm: Comm, pieces: int
) -> ProgramWeight | None:
    """``loss_weight="auto"``: the divisor of ``program``'s loss as each piece's weight, its GraphModule made
    by ``build`` (``StageBuilder.part``); ``None`` (equal pieces) for a loss that is no such ratio, or when
    the step has one piece (its weight is moot: no collective is spent on it)."""
    summed = summed_loss(program) if pieces > 1 else None
    if summed is not None:
        raise BatchError(
            f"the loss is a sum over the batch (%{summed.result} = {summed.target}, reduction='sum'), and the step "
            f"combines its {pieces} pieces (microbatches) by averaging their losses, which would divide the loss "
            "and its gradients by the count: use reduction='mean' (and scale the learning rate), or one microbatch"
        )
    divisor = divisor_program(program) if pieces > 1 else None
    return ProgramWeight(build(divisor, "loss_weight"), comm) if divisor is not None else None


__all__ = ["ProgramWeight", "divisor_program", "program_weight"]
