"""Sharding rules of contractions: mm, bmm, matmul, linear, grouped matmul, convolution, embedding lookups and
gathers of rows.

Each offers the batch split, the split of either operand's free dim (column/row parallel) and the
split of the contracted dim into a partial sum.
"""

from __future__ import annotations

from autopar.ir.core import Partial, R, Shard, bound_args
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, replicated, shards


def _mm(c: Ctx) -> list[OneD]:
    (m, k), (_, nn) = c.ins[0].shape, c.ins[1].shape
    res: list[OneD] = [replicated(c)]
    for ck in shards(m, c.n, c.chunk_counts):
        res.append(((Shard(0, ck), R), (Shard(0, ck),)))
    for ck in shards(nn, c.n, c.chunk_counts):
        res.append(((R, Shard(1, ck)), (Shard(1, ck),)))
    if k % c.n == 0:
        res.append(((Shard(1), Shard(0)), (Partial("sum"),)))
    res += [((Partial("sum"), R), (Partial("sum"),)), ((R, Partial("sum")), (Partial("sum"),))]
    return res


def _bmm(c: Ctx) -> list[OneD]:
    (b, m, k), (_, _, nn) = c.ins[0].shape, c.ins[1].shape
    res: list[OneD] = [replicated(c)]
    if b % c.n == 0:
        res.append(((Shard(0), Shard(0)), (Shard(0),)))
    if m % c.n == 0:
        res.append(((Shard(1), R), (Shard(1),)))
    if nn % c.n == 0:
        res.append(((R, Shard(2)), (Shard(2),)))
    if k % c.n == 0:
        res.append(((Shard(2), Shard(1)), (Partial("sum"),)))
    return res


def _matmul(c: Ctx) -> list[OneD]:
    """torch.matmul of a[..., M, K] and b[..., K, N] (batch dims broadcast); 1-D operands replicate."""
    a, b = c.ins[0].shape, c.ins[1].shape
    if len(a) < 2 or len(b) < 2:
        return [replicated(c)]
    ro = len(c.outs[0].shape)
    res: list[OneD] = [replicated(c)]
    for d in range(ro - 2):
        da, db = d - (ro - len(a)), d - (ro - len(b))
        size = c.outs[0].shape[d]
        if size % c.n:
            continue
        pa = Shard(da) if da >= 0 and a[da] == size else R
        pb = Shard(db) if db >= 0 and b[db] == size else R
        res.append(((pa, pb), (Shard(d),)))
    if a[-2] % c.n == 0:
        res.append(((Shard(len(a) - 2), R), (Shard(ro - 2),)))
    if b[-1] % c.n == 0:
        res.append(((R, Shard(len(b) - 1)), (Shard(ro - 1),)))
    if a[-1] % c.n == 0:
        res.append(((Shard(len(a) - 1), Shard(len(b) - 2)), (Partial("sum"),)))
    return res


def _linear(c: Ctx) -> list[OneD]:
    x, w = c.ins[0].shape, c.ins[1].shape  # x[..., K], w[N, K]; no bias (lowering split it off)
    rank = len(x)
    res: list[OneD] = [replicated(c)]
    for d in range(rank - 1):
        for ck in shards(x[d], c.n, c.chunk_counts):
            res.append(((Shard(d, ck), R), (Shard(d, ck),)))
    for ck in shards(w[0], c.n, c.chunk_counts):
        res.append(((R, Shard(0, ck)), (Shard(rank - 1, ck),)))
    if w[1] % c.n == 0:
        res.append(((Shard(rank - 1), Shard(1)), (Partial("sum"),)))
    res.append(((Partial("sum"), R), (Partial("sum"),)))
    return res


def _grouped_mm(c: Ctx) -> list[OneD]:
    """A grouped matmul of rows by expert, ``x[S, K]`` and ``w[E, K, N]`` with ``offs[E]`` the groups' cumulative
    row ends (rows sorted by expert): transformers' default MoE kernel, captured as ``torch._grouped_mm`` (half
    types) or as transformers' ``grouped_mm_fallback`` custom op (float32, float64). Each expert's matmul splits
    like a linear's: its output columns (w and the result by N, Megatron's column parallel), or the contracted
    dim into a partial sum (row parallel); a partial x gives a partial result. The rows split in contiguous
    blocks too: ``offs`` stay whole (they index the global rows) and each rank's module shifts them to its
    block (``runtime/build/codegen.py``). The experts are not split (that is expert parallelism: tokens move
    to the experts' ranks). Other forms of ``torch._grouped_mm`` (3-D x, 2-D w, a bias) replicate."""
    res: list[OneD] = [replicated(c)]
    if len(c.ins) != 3 or len(c.ins[0].shape) != 2 or len(c.ins[1].shape) != 3 or len(c.ins[2].shape) != 1:
        return res
    if c.op.target == "aten._grouped_mm" and (bound_args(c.op) or {}).get("bias") is not None:
        return res
    rows, k, nn = c.ins[0].shape[0], c.ins[1].shape[1], c.ins[1].shape[2]
    if rows % c.n == 0:  # each rank its block of rows, its offsets shifted to them by codegen (grouped_rows)
        res.append(((Shard(0), R, R), (Shard(0),)))
    for ck in shards(nn, c.n, c.chunk_counts):
        res.append(((R, Shard(2, ck), R), (Shard(1, ck),)))
    if k % c.n == 0:
        res.append(((Shard(1), Shard(1), R), (Partial("sum"),)))
    res.append(((Partial("sum"), R, R), (Partial("sum"),)))
    return res


def _conv(c: Ctx) -> list[OneD]:
    """conv2d/convolution(x[N,C,H,W], w[O,C/g,kh,kw], bias?): batch-split, output channels split
    (bias split with them), or input channels split into a partial sum (groups == 1, no bias)."""
    x, w = c.ins[0].shape, c.ins[1].shape
    has_bias = len(c.ins) > 2
    args = c.op.args
    groups = args[-1] if c.op.target == "aten.conv2d" and len(args) >= 7 else (args[8] if len(args) > 8 else 1)
    rest = tuple(R for _ in c.ins[2:])
    res: list[OneD] = [replicated(c)]
    if x[0] % c.n == 0:
        res.append(((Shard(0), R) + rest, (Shard(0),)))
    if w[0] % c.n == 0 and groups == 1:
        res.append(((R, Shard(0)) + tuple(Shard(0) for _ in c.ins[2:]), (Shard(1),)))
    if x[1] % c.n == 0 and groups == 1 and not has_bias:
        res.append(((Shard(1), Shard(1)), (Partial("sum"),)))
    return res


def _embedding(c: Ctx) -> list[OneD]:
    """embedding(W[V, E], ids): ids split (batch), W split by hidden (hidden-parallel), or W split by
    vocabulary (Megatron's vocab-parallel: each rank looks up the ids in its rows, others read as
    zero, so the output is a partial sum; codegen emits the masked lookup). With
    ``scale_grad_by_freq`` a row's gradient is divided by its count in the whole batch and every
    rank must see every id: only the hidden split keeps them all."""
    w, idx = c.ins[0].shape, c.ins[1].shape
    res: list[OneD] = [replicated(c)]
    args = c.op.args
    if (args[3] if len(args) > 3 else c.op.kwargs.get("scale_grad_by_freq", False)) is True:
        return res + ([((Shard(1), R), (Shard(len(idx)),))] if w[1] % c.n == 0 else [])
    for d in range(len(idx)):
        if idx[d] % c.n == 0:
            res.append(((R, Shard(d)), (Shard(d),)))
    if w[1] % c.n == 0:
        res.append(((Shard(1), R), (Shard(len(idx)),)))
    if w[0] % c.n == 0:
        res.append(((Shard(0), R), (Partial("sum"),)))
    return res


RULES: dict[str, Rule] = {
    "aten.mm": _mm,
    "aten.bmm": _bmm,
    "aten.matmul": _matmul,
    "aten.linear": _linear,
    "aten._grouped_mm": _grouped_mm,
    "transformers.grouped_mm_fallback": _grouped_mm,
    "aten.embedding": _embedding,
    "aten.conv2d": _conv,
    "aten.convolution": _conv,
}
