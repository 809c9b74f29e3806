"""Megatron's vocab-parallel embedding and cross-entropy: a table or logits split over the vocabulary on
tensor-parallel axes, computed without gathering them (the generated per-rank modules call these)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.errors import InputRangeError
from autopar.runtime.comm.context import current_comm
from autopar.runtime.comm.watch import guarded


def check_range(index: torch.Tensor, size: int, what: str, ignore: int | None = None) -> None:
    """Every entry of ``index`` is in [0, size) (or ``ignore``), as eager's lookup or loss requires: a split
    table would read an id outside as a zero row (each rank's ids outside its rows are) and train on, silently.
    Every rank of the split holds the same ids, so each raises. One reduction; on an accelerator an
    asynchronous device assert (no host sync), on the CPU an ``InputRangeError``."""
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise InputRangeError(f"the {what} are {index.dtype}: they index rows, so they must be integers (e.g. .long())")
    bad = (index < 0) | (index >= size)
    if ignore is not None:
        bad &= index != ignore
    if index.device.type != "cpu":
        torch._assert_async(~bad.any(), f"a {what[:-1]} outside [0, {size}) (autopar's vocabulary-parallel check)")
        return
    if bool(bad.any()):
        wrong = index[bad]
        raise InputRangeError(
            f"{int(bad.sum())} {what} are outside [0, {size}) (e.g. {int(wrong.min())} .. {int(wrong.max())}): eager "
            f"would raise IndexError; check that the tokenizer and the model's vocabulary agree"
        )


def vocab_parallel_embedding(
    weight: torch.Tensor, ids: torch.Tensor, axes: list[str], padding_idx: int = -1, vocab: int | None = None
) -> torch.Tensor:
    """Megatron's vocab-parallel lookup: this rank holds rows [start, start + V_local) of the table
    (its block over ``axes``, outer axis first); ids outside read as zero, so summing over the axes
    gives the whole lookup. ``padding_idx`` (a global row whose gradient stays zero) is passed on as
    the local row on the rank that holds it. ``vocab``: the whole table's rows (default: the local rows
    times the ranks), which every id must be below (``check_range``). Plain ATen ops, so autograd needs
    nothing special."""
    c = current_comm()
    total = vocab if vocab is not None else weight.shape[0] * math.prod(c.sizes[a] for a in axes)
    check_range(ids, total, "token ids")
    block = 0
    for a in axes:
        block = block * c.sizes[a] + c.coords[a]
    start = block * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local_pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + weight.shape[0] else -1
    out = torch.ops.aten.embedding(weight, (ids - start).masked_fill(outside, 0), local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits whose class dim is split over ``axes`` (Megatron's vocab-parallel
    loss): the max, the softmax denominator and the target's logit are all-reduced (three reductions
    of one number per row) instead of gathering the logits."""

    @staticmethod
    def forward(ctx, logits, target, axes, reduction, ignore_index, classes):
        c = current_comm()
        start = 0
        for a in axes:
            start = start * c.sizes[a] + c.coords[a]
        local = logits.shape[1]
        start *= local
        check_range(target, classes if classes is not None else local * math.prod(c.sizes[a] for a in axes),
                    "labels", ignore_index)  # fmt: skip
        groups = [(a, c.groups[a]) for a in axes]
        # half types are upcast for the exponentials and sums; float32 and float64 keep their precision
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        row_max = logits.max(dim=1).values
        for a, g in groups:
            guarded(g, a, "all_reduce (loss max)", dist.all_reduce, row_max, op=dist.ReduceOp.MAX, group=g)
        shifted = logits - row_max.unsqueeze(1)
        exp = shifted.exp()
        denom = exp.sum(dim=1)
        ignored = target == ignore_index
        outside = (target < start) | (target >= start + local) | ignored
        idx = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
        for a, g in groups:
            guarded(g, a, "all_reduce (loss sum)", dist.all_reduce, denom, op=dist.ReduceOp.SUM, group=g)
            guarded(g, a, "all_reduce (loss target)", dist.all_reduce, picked, op=dist.ReduceOp.SUM, group=g)
        loss = (denom.log() - picked).masked_fill(ignored, 0.0)
        count = (~ignored).sum()
        ctx.save_for_backward(exp / denom.unsqueeze(1), idx, outside, ignored, count)
        ctx.reduction = reduction
        if reduction == 1:  # mean over the rows that are not ignored
            return loss.sum() / count
        return loss.sum() if reduction == 2 else loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, outside, ignored, count = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0])
        g[rows, idx] -= (~outside).to(g.dtype)
        g = g.masked_fill(ignored.unsqueeze(1), 0.0)
        if ctx.reduction == 1:
            g = g * (grad / count)
        elif ctx.reduction == 2:
            g = g * grad
        else:
            g = g * grad.unsqueeze(1)
        return g, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    axes: list[str],
    reduction: int = 1,
    ignore_index: int = -100,
    classes: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits split by class over ``axes``; ``classes``: the whole class dim, which every
    label (but ``ignore_index``) must be below, as eager's loss requires (``check_range``)."""
    return _VocabParallelCrossEntropy.apply(logits, target, axes, reduction, ignore_index, classes)


__all__ = ["check_range", "vocab_parallel_cross_entropy", "vocab_parallel_embedding"]
