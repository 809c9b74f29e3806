"""Sharding rules of ops that reduce over dims: normalization, softmax, attention, sums and means, losses.

A reduced dim split over ranks gives a partial result (``P(sum)``, ``P(avg)``); any other dim splits
the input and the result alike.
"""

from __future__ import annotations

from autopar.ir.core import Partial, R, Shard
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, identity_dims, replicated, shards


def _layer_norm(c: Ctx) -> list[OneD]:
    x = c.ins[0].shape
    normed = len(c.op.args[1])
    res: list[OneD] = [replicated(c)]
    for d in range(len(x) - normed):
        if x[d] % c.n == 0:
            res.append(((Shard(d),) + tuple(R for _ in c.ins[1:]), tuple(Shard(d) for _ in c.outs)))
    return res


def _softmax(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return identity_dims(c, lambda d: None if d == dim else d, allow_partial=False)


def _sdpa(c: Ctx) -> list[OneD]:
    """Split on a batch or head dim of the queries; an input with that dim splits alike, one broadcasting it reads
    it whole. With ``enable_gqa`` the keys' and values' fewer heads split too: query head ``j`` reads key head
    ``j // groups``, so the queries' and keys' head blocks match only when both split, in as many blocks."""
    q = c.ins[0].shape
    heads = len(q) - 3
    gqa = bool(c.op.args[7] if len(c.op.args) > 7 else c.op.kwargs.get("enable_gqa", False))
    res: list[OneD] = [replicated(c)]
    for d in range(len(q) - 2):  # batch and head dims
        if q[d] % c.n:
            continue
        ins = []
        for i, t in enumerate(c.ins):
            ad = d - (len(q) - len(t.shape))
            grouped = gqa and d == heads and i in (1, 2) and ad >= 0 and t.shape[ad] != q[d]
            if grouped and t.shape[ad] % c.n:
                break  # fewer key heads than blocks: no such split
            ins.append(Shard(ad) if ad >= 0 and (t.shape[ad] == q[d] or grouped) else R)
        else:
            res.append((tuple(ins), (Shard(d),)))
    return res


def _reduction(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    rank = len(src)
    args = c.op.args
    full = c.op.target in ("aten.sum", "aten.mean") or len(args) < 2 or args[1] is None
    dims = set(range(rank)) if full else {x % rank for x in args[1]}
    keep = bool(args[2]) if len(args) > 2 and not full else c.op.kwargs.get("keepdim", False)
    op = "avg" if "mean" in c.op.target else "sum"
    res: list[OneD] = [replicated(c), ((Partial("sum"),), (Partial("sum"),))] if op == "sum" else [replicated(c)]
    for d in range(rank):
        for k in shards(src[d], c.n, c.chunk_counts):
            if d in dims:
                if k == 1:
                    res.append(((Shard(d),), (Partial(op),)))
            else:
                od = d if keep else d - sum(1 for x in dims if x < d)
                res.append(((Shard(d, k),), (Shard(od, k),)))
    return res


def _cumsum(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return identity_dims(c, lambda d: None if d == dim else d, allow_partial=False)


def _cross_entropy(c: Ctx) -> list[OneD]:
    """cross_entropy_loss(logits[N, C], target[N], weight=None, reduction, ignore_index, smoothing):
    rows split (a partial sum), or classes split (Megatron's vocab-parallel loss: a whole loss on
    every rank, three row-wise all-reduces inside; codegen emits it). A mean over split rows is not
    a partial average: ranks may ignore different numbers of targets (lowering makes it sum / count)."""
    logits = c.ins[0].shape
    args = c.op.args
    reduction = args[3] if len(args) > 3 else c.op.kwargs.get("reduction", 1)
    weighted = len(args) > 2 and args[2] is not None
    smoothing = args[5] if len(args) > 5 else c.op.kwargs.get("label_smoothing", 0.0)
    res: list[OneD] = [replicated(c)]
    if len(logits) != 2 or len(c.ins) != 2 or weighted or smoothing:
        return res
    if logits[0] % c.n == 0 and reduction == 2:
        res.append(((Shard(0), Shard(0)), (Partial("sum"),)))
    if logits[1] % c.n == 0:
        res.append(((Shard(1), R), (R,)))
    return res


def _mse_loss(c: Ctx) -> list[OneD]:
    """mse_loss(input, target, reduction): shard any dim of both; mean -> P(avg), sum -> P(sum)."""
    args = c.op.args
    reduction = args[2] if len(args) > 2 else c.op.kwargs.get("reduction", 1)
    res: list[OneD] = [replicated(c)]
    if reduction not in (1, 2) or len(c.ins) != 2 or c.ins[0].shape != c.ins[1].shape:
        return res
    for d, size in enumerate(c.ins[0].shape):
        if size % c.n == 0:
            res.append(((Shard(d), Shard(d)), (Partial("avg" if reduction == 1 else "sum"),)))
    return res


RULES: dict[str, Rule] = {
    "aten.layer_norm": _layer_norm,
    "aten._softmax": _softmax,
    "aten.softmax.int": _softmax,
    "aten._log_softmax": _softmax,
    "aten.log_softmax.int": _softmax,
    "aten.scaled_dot_product_attention": _sdpa,
    "aten.sum.dim_IntList": _reduction,
    "aten.mean.dim": _reduction,
    "aten.sum": _reduction,
    "aten.mean": _reduction,
    "aten.cumsum": _cumsum,
    "aten.cross_entropy_loss": _cross_entropy,
    "aten.mse_loss": _mse_loss,
}
