"""The batch checked on every rank before the step's first collective: token ids and labels in range.

A token id outside the vocabulary or a label outside the classes raises in eager PyTorch (``IndexError``)
but, once the table or the logits are split, reads a zero row on every rank and trains on (the lookup's
own check, ``runtime/comm/vocab_parallel.py:check_range``, catches it there). Checked here first, on the
call's inputs: ``index_bounds`` finds the program inputs that index a table (an ``aten.embedding``'s ids)
or classes (a cross-entropy's target), through view ops and padding, and ``problem`` says what is wrong
with a batch. With local batches each rank holds other rows, so the callers agree on the result
(``runtime/comm/agree.py``) and every rank raises the same error before any of them communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import AutoparError, InputRangeError
from autopar.ir.core import VIEW_OPS, Program, Ref

# ops whose result holds only entries of their first argument (shape aside; HF pads labels with the ignore
# index): copies, moves, views, and the collectives that gather or keep a shard of a value
_PASSES = VIEW_OPS | {
    "aten.contiguous", "aten.alias", "aten.pad", "aten.clone", "aten.to.dtype_layout", "aten.to.device",
    "all_gather", "local_shard", "recv",
}  # fmt: skip


@dataclass(frozen=True)
class Bound:
    """An input's entries must lie in [0, size) (or equal ``ignore``); ``what`` names them."""

    size: int
    what: str
    ignore: int | None = None


def index_bounds(program: Program) -> dict[str, Bound]:
    """The inputs of ``program`` that index a table or classes, each with its bound (the smallest when
    it indexes several)."""
    types = program.types()
    origin = {v.name: v.name for v in program.inputs if v.kind == "input"}
    out: dict[str, Bound] = {}
    for op in program.ops:
        first = op.args[0] if op.args else None
        if op.target in _PASSES and isinstance(first, Ref) and first.name in origin:
            for r in op.results:
                origin[r] = origin[first.name]
            continue
        found = None
        if op.target == "aten.embedding" and len(op.args) > 1 and isinstance(op.args[1], Ref):
            found = (op.args[1].name, Bound(types[op.args[0].name].shape[0], "token ids"))
        elif op.target == "aten.cross_entropy_loss" and len(op.args) > 1 and isinstance(op.args[1], Ref):
            ignore = op.args[4] if len(op.args) > 4 else op.kwargs.get("ignore_index", -100)
            logits = types[op.args[0].name]
            classes = logits.shape[1] if len(logits.shape) > 1 else logits.shape[0]
            found = (op.args[1].name, Bound(classes, "labels", ignore))
        if found is not None and found[0] in origin:
            name, bound = origin[found[0]], found[1]
            if name not in out or bound.size < out[name].size:
                out[name] = bound
    return out


def problem(label: str, x: torch.Tensor, bound: Bound) -> AutoparError | None:
    """What is wrong with input ``label``'s tensor ``x`` against ``bound``; None when nothing."""
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        return InputRangeError(
            f"input {label!r} holds {bound.what} but is {x.dtype}: they index rows, so pass integers (.long())"
        )
    bad = (x < 0) | (x >= bound.size)
    if bound.ignore is not None:
        bad &= x != bound.ignore
    if not bool(bad.any()):
        return None
    wrong = x[bad]
    allowed = f"[0, {bound.size})" + (f" or {bound.ignore} (ignored)" if bound.ignore is not None else "")
    return InputRangeError(
        f"input {label!r}: {int(bad.sum())} {bound.what} outside {allowed} (e.g. {int(wrong.min())} .. "
        f"{int(wrong.max())}); eager would raise IndexError: check that the tokenizer, the labels and the "
        "model's vocabulary agree"
    )


__all__ = ["Bound", "index_bounds", "problem"]
