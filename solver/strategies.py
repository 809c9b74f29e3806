"""Sharding candidates: for each IR op, every valid assignment of placements on an N-D mesh.

A rule gives the op's *one-axis* strategies: placements of each tensor input and each result on a
single mesh axis of size n. Strategies on the whole mesh are the product over axes, keeping those
that shard no tensor dim on two axes. An op without a rule is replicated (and listed by
``autopar plan --verbose``).

Conventions the codegen relies on (and the equivalence tests prove):
- an op is computed on local shards with the same ATen call; shape arguments are rewritten to the
  local shape of the result;
- ``Partial`` results come only from linear maps (matmul contractions, sums, means, linear
  pointwise ops of partial inputs);
- an input marked ``None`` is only read for its dtype/device (``new_ones``) and needs no placement.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from autopar.ir.core import MeshSpec, Op, Partial, Placement, Program, R, Replicate, Shard, TensorType
from autopar.ir.layout import valid

OneD = tuple[tuple[Placement | None, ...], tuple[Placement, ...]]  # (inputs, results) on one axis


@dataclass(frozen=True)
class Strategy:
    """Placements of every tensor input (None = any) and every result, one tuple per mesh axis each."""

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...], ...]

    def label(self) -> str:
        return ",".join("{" + ",".join(str(p) for p in o) + "}" for o in self.outputs)


@dataclass
class Ctx:
    op: Op
    ins: list[TensorType]  # types of the tensor inputs, in op.input_refs() order
    outs: list[TensorType]
    n: int  # size of the mesh axis
    chunk_counts: tuple[int, ...]


def _shards(size: int, n: int, chunk_counts: tuple[int, ...]) -> list[int]:
    """Chunk counts k for which Shard(dim, k) splits a dim of ``size`` evenly over n ranks."""
    return [k for k in chunk_counts if size % (k * n) == 0 and size >= k * n]


def _replicated(c: Ctx) -> OneD:
    return (tuple(R for _ in c.ins), tuple(R for _ in c.outs))


# ---------------------------------------------------------------------------------------------
# Pointwise ops (with broadcasting)

POINTWISE = {
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.add.Scalar",
    "aten.sub.Scalar",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.rsub.Scalar",
    "aten.pow.Tensor_Scalar",
    "aten.pow.Tensor_Tensor",
    "aten.neg",
    "aten.exp",
    "aten.log",
    "aten.tanh",
    "aten.sigmoid",
    "aten.silu",
    "aten.gelu",
    "aten.relu",
    "aten.sqrt",
    "aten.rsqrt",
    "aten.abs",
    "aten.sin",
    "aten.cos",
    "aten.erf",
    "aten.reciprocal",
    "aten.where.self",
    "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor",
    "aten.eq.Tensor",
    "aten.eq.Scalar",
    "aten.ne.Tensor",
    "aten.ne.Scalar",
    "aten.lt.Tensor",
    "aten.lt.Scalar",
    "aten.le.Tensor",
    "aten.le.Scalar",
    "aten.gt.Tensor",
    "aten.gt.Scalar",
    "aten.ge.Tensor",
    "aten.ge.Scalar",
    "aten.__and__.Tensor",
    "aten.__or__.Tensor",
    "aten.logical_not",
    "aten.logical_and",
    "aten.logical_or",
    "aten.bitwise_not",
    "aten.clamp",
    "aten.clamp_min",
    "aten.clamp_max",
    "aten.minimum",
    "aten.maximum",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy",
    "aten.alias",
    "aten.contiguous",
    "aten.clone",
    "aten.type_as",
    "aten.detach",
    "aten.lift_fresh_copy",
    "aten.zeros_like",
    "aten.ones_like",
    "aten.full_like",
    "aten.empty_like",
    "aten.dropout",
    "aten.tril",
    "aten.triu",
    "aten.square",
    "aten.broadcast_tensors",
    "aten.where.ScalarOther",
    "aten.where.ScalarSelf",
    "aten.min.other",
    "aten.max.other",
    "aten.copy",
    "aten.fill.Tensor",
    "aten.fill.Scalar",
}
# Pointwise ops that are linear in their (single) partial input: P stays P.
_LINEAR_UNARY = {
    "aten.neg",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy",
    "aten.alias",
    "aten.contiguous",
    "aten.clone",
    "aten.detach",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.type_as",
}
_LAST_TWO_FIXED = {"aten.tril", "aten.triu"}


def _pointwise(c: Ctx) -> list[OneD]:
    out = c.outs[0].shape
    rank = len(out)
    res: list[OneD] = [_replicated(c)]
    fixed = set(range(rank - 2, rank)) if c.op.target in _LAST_TWO_FIXED else set()
    for d in range(rank):
        if d in fixed:
            continue
        for k in _shards(out[d], c.n, c.chunk_counts):
            ins = []
            for t in c.ins:
                ad = d - (rank - len(t.shape))
                ins.append(Shard(ad, k) if ad >= 0 and t.shape[ad] == out[d] else R)
            res.append((tuple(ins), tuple(Shard(d, k) for _ in c.outs)))
    res += _linear_partials(c)
    return res


def _linear_partials(c: Ctx) -> list[OneD]:
    t = c.op.target
    nin = len(c.ins)
    p = Partial("sum")
    if t in _LINEAR_UNARY and nin == 1:
        return [((p,), (p,))]
    if t == "aten.dropout":  # identity, or x times a mask keyed by global index (runtime/rng.py): linear
        return [((p,), (p,))]
    if t in ("aten.add.Tensor", "aten.sub.Tensor") and nin == 2 and len(c.op.args) == 2:
        same = all(x.shape == c.outs[0].shape for x in c.ins)
        return [((p, p), (p,))] if same else []
    if t in ("aten.mul.Tensor", "aten.div.Tensor"):
        if nin == 1:
            return [((p,), (p,))]
        if nin == 2:
            opts = [((p, R), (p,))]
            if t == "aten.mul.Tensor":
                opts.append(((R, p), (p,)))
            return opts
    return []


# ---------------------------------------------------------------------------------------------
# Views


def _identity_dims(c: Ctx, mapping: Callable[[int], int | None], allow_partial: bool = True) -> list[OneD]:
    """Strategies of a one-input view whose input dim d becomes output dim mapping(d) (None: lost)."""
    src = c.ins[0]
    res: list[OneD] = [_replicated(c)]
    for d, size in enumerate(src.shape):
        od = mapping(d)
        if od is None:
            continue
        for k in _shards(size, c.n, c.chunk_counts):
            if c.outs[0].shape[od] != size:
                continue
            ins = (Shard(d, k),) + tuple(R for _ in c.ins[1:])
            res.append((ins, tuple(Shard(od, k) for _ in c.outs)))
    if allow_partial:
        res.append(((Partial("sum"),) + tuple(R for _ in c.ins[1:]), tuple(Partial("sum") for _ in c.outs)))
    return res


def _view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dims of shape a and shape b with equal products (dims of size 1 stand alone)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            return None
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def _reshape(c: Ctx) -> list[OneD]:
    src, dst = c.ins[0].shape, c.outs[0].shape
    groups = _view_groups(src, dst)
    res: list[OneD] = [_replicated(c), ((Partial("sum"),), (Partial("sum"),))]
    if groups is None:
        return res
    for gi, gj in groups:
        if not gi or not gj:
            continue
        # only the outermost dim of a group carries a shard through a merge or a split
        for k in _shards(src[gi[0]], c.n, c.chunk_counts):
            if dst[gj[0]] % (k * c.n) == 0:
                res.append(((Shard(gi[0], k),), (Shard(gj[0], k),)))
    return res


def _transpose(c: Ctx) -> list[OneD]:
    a, b = (x % len(c.ins[0].shape) for x in c.op.args[1:3])
    return _identity_dims(c, lambda d: b if d == a else a if d == b else d)


def _permute(c: Ctx) -> list[OneD]:
    dims = [x % len(c.ins[0].shape) for x in c.op.args[1]]
    return _identity_dims(c, lambda d: dims.index(d))


def _t(c: Ctx) -> list[OneD]:
    return _identity_dims(c, lambda d: len(c.ins[0].shape) - 1 - d)


def _unsqueeze(c: Ctx) -> list[OneD]:
    at = c.op.args[1] % len(c.outs[0].shape)
    return _identity_dims(c, lambda d: d if d < at else d + 1)


def _squeeze(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    if len(c.op.args) < 2:
        # squeeze() without dims also drops a sharded dim whose local size is 1 (the rank simulator's
        # rule test found it): sharding stays off until codegen names the dims (aten.squeeze.dims)
        return _identity_dims(c, lambda d: None)
    dims = c.op.args[1]
    dims = {x % len(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])}
    dims = {d for d in dims if src[d] == 1}
    return _identity_dims(c, lambda d: None if d in dims else d - sum(1 for x in dims if x < d))


def _expand(c: Ctx) -> list[OneD]:
    src, dst = c.ins[0].shape, c.outs[0].shape
    off = len(dst) - len(src)
    return _identity_dims(c, lambda d: d + off if src[d] == dst[d + off] else None)


def _slice(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    dim = c.op.args[1] % len(src) if len(c.op.args) > 1 else 0
    full = c.outs[0].shape[dim] == src[dim]
    return _identity_dims(c, lambda d: d if d != dim or full else None)


def _select(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return _identity_dims(c, lambda d: None if d == dim else d if d < dim else d - 1)


def _split(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    dim = (c.op.args[2] if len(c.op.args) > 2 else 0) % len(src)
    res = _identity_dims(c, lambda d: None if d == dim else d)
    pieces = len(c.outs)
    equal = all(o.shape[dim] == c.outs[0].shape[dim] for o in c.outs)
    if equal and pieces > 1 and pieces in c.chunk_counts and (src[dim] // pieces) % c.n == 0:
        res.append(((Shard(dim, pieces),), tuple(Shard(dim) for _ in c.outs)))
    return res


def _scatter(c: Ctx) -> list[OneD]:
    """slice_scatter(base, src, dim, ...) and select_scatter(base, src, dim, index) (writes through a
    view, functionalized): src fills a slice of base along dim; any other dim splits base, src and the
    result alike (select's src lacks dim)."""
    out = c.outs[0].shape
    dim = (c.op.args[2] if len(c.op.args) > 2 else c.op.kwargs.get("dim", 0)) % len(out)
    same_rank = len(c.ins) == 2 and len(c.ins[1].shape) == len(out)
    res: list[OneD] = [_replicated(c)]
    if len(c.ins) != 2:
        return res
    for d in range(len(out)):
        if d == dim:
            continue
        for k in _shards(out[d], c.n, c.chunk_counts):
            res.append(((Shard(d, k), Shard(d if same_rank or d < dim else d - 1, k)), (Shard(d, k),)))
    return res


def _cat(c: Ctx) -> list[OneD]:
    rank = len(c.outs[0].shape)
    dim = (c.op.args[1] if len(c.op.args) > 1 else 0) % rank
    res: list[OneD] = [_replicated(c)]
    for d in range(rank):
        if d == dim:
            continue
        for k in _shards(c.outs[0].shape[d], c.n, c.chunk_counts):
            res.append((tuple(Shard(d, k) for _ in c.ins), (Shard(d, k),)))
    return res


# ---------------------------------------------------------------------------------------------
# Contractions


def _mm(c: Ctx) -> list[OneD]:
    (m, k), (_, nn) = c.ins[0].shape, c.ins[1].shape
    res: list[OneD] = [_replicated(c)]
    for ck in _shards(m, c.n, c.chunk_counts):
        res.append(((Shard(0, ck), R), (Shard(0, ck),)))
    for ck in _shards(nn, c.n, c.chunk_counts):
        res.append(((R, Shard(1, ck)), (Shard(1, ck),)))
    if k % c.n == 0:
        res.append(((Shard(1), Shard(0)), (Partial("sum"),)))
    res += [((Partial("sum"), R), (Partial("sum"),)), ((R, Partial("sum")), (Partial("sum"),))]
    return res


def _bmm(c: Ctx) -> list[OneD]:
    (b, m, k), (_, _, nn) = c.ins[0].shape, c.ins[1].shape
    res: list[OneD] = [_replicated(c)]
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
        return [_replicated(c)]
    ro = len(c.outs[0].shape)
    res: list[OneD] = [_replicated(c)]
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
    res: list[OneD] = [_replicated(c)]
    for d in range(rank - 1):
        for ck in _shards(x[d], c.n, c.chunk_counts):
            res.append(((Shard(d, ck), R), (Shard(d, ck),)))
    for ck in _shards(w[0], c.n, c.chunk_counts):
        res.append(((R, Shard(0, ck)), (Shard(rank - 1, ck),)))
    if w[1] % c.n == 0:
        res.append(((Shard(rank - 1), Shard(1)), (Partial("sum"),)))
    res.append(((Partial("sum"), R), (Partial("sum"),)))
    return res


def _conv(c: Ctx) -> list[OneD]:
    """conv2d/convolution(x[N,C,H,W], w[O,C/g,kh,kw], bias?): batch-split, output channels split
    (bias split with them), or input channels split into a partial sum (groups == 1, no bias)."""
    x, w = c.ins[0].shape, c.ins[1].shape
    has_bias = len(c.ins) > 2
    args = c.op.args
    groups = args[-1] if c.op.target == "aten.conv2d" and len(args) >= 7 else (args[8] if len(args) > 8 else 1)
    rest = tuple(R for _ in c.ins[2:])
    res: list[OneD] = [_replicated(c)]
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
    res: list[OneD] = [_replicated(c)]
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


# ---------------------------------------------------------------------------------------------
# Normalization, attention, reductions, losses


def _layer_norm(c: Ctx) -> list[OneD]:
    x = c.ins[0].shape
    normed = len(c.op.args[1])
    res: list[OneD] = [_replicated(c)]
    for d in range(len(x) - normed):
        if x[d] % c.n == 0:
            res.append(((Shard(d),) + tuple(R for _ in c.ins[1:]), tuple(Shard(d) for _ in c.outs)))
    return res


def _softmax(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return _identity_dims(c, lambda d: None if d == dim else d, allow_partial=False)


def _sdpa(c: Ctx) -> list[OneD]:
    q = c.ins[0].shape
    res: list[OneD] = [_replicated(c)]
    for d in range(len(q) - 2):  # batch and head dims
        if q[d] % c.n:
            continue
        ins = []
        for t in c.ins:
            ad = d - (len(q) - len(t.shape))
            ins.append(Shard(ad) if ad >= 0 and t.shape[ad] == q[d] else R)
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
    res: list[OneD] = [_replicated(c), ((Partial("sum"),), (Partial("sum"),))] if op == "sum" else [_replicated(c)]
    for d in range(rank):
        for k in _shards(src[d], c.n, c.chunk_counts):
            if d in dims:
                if k == 1:
                    res.append(((Shard(d),), (Partial(op),)))
            else:
                od = d if keep else d - sum(1 for x in dims if x < d)
                res.append(((Shard(d, k),), (Shard(od, k),)))
    return res


def _cumsum(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return _identity_dims(c, lambda d: None if d == dim else d, allow_partial=False)


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
    res: list[OneD] = [_replicated(c)]
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
    res: list[OneD] = [_replicated(c)]
    if reduction not in (1, 2) or len(c.ins) != 2 or c.ins[0].shape != c.ins[1].shape:
        return res
    for d, size in enumerate(c.ins[0].shape):
        if size % c.n == 0:
            res.append(((Shard(d), Shard(d)), (Partial("avg" if reduction == 1 else "sum"),)))
    return res


def _source(c: Ctx) -> list[OneD]:
    return [(tuple(None for _ in c.ins), tuple(R for _ in c.outs))]


def _pad(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    pads = c.op.args[1]
    padded = {len(src) - 1 - i // 2 for i, p in enumerate(pads) if p}
    return _identity_dims(c, lambda d: None if d in padded else d, allow_partial=False)


RULES: dict[str, Callable[[Ctx], list[OneD]]] = {
    **{t: _pointwise for t in POINTWISE},
    "aten.view": _reshape,
    "aten.reshape": _reshape,
    "aten._unsafe_view": _reshape,
    "aten.flatten.using_ints": _reshape,
    "aten.transpose.int": _transpose,
    "aten.permute": _permute,
    "aten.t": _t,
    "aten.unsqueeze": _unsqueeze,
    "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze,
    "aten.squeeze": _squeeze,
    "aten.expand": _expand,
    "aten.slice.Tensor": _slice,
    "aten.select.int": _select,
    "aten.split.Tensor": _split,
    "aten.split_with_sizes": _split,
    "aten.slice_scatter": _scatter,
    "aten.select_scatter": _scatter,
    "aten.cat": _cat,
    "aten.mm": _mm,
    "aten.bmm": _bmm,
    "aten.matmul": _matmul,
    "aten.linear": _linear,
    "aten.embedding": _embedding,
    "aten.conv2d": _conv,
    "aten.convolution": _conv,
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
    "aten.pad": _pad,
    "aten.constant_pad_nd": _pad,
    "aten.arange": _source,
    "aten.arange.start": _source,
    "aten.arange.start_step": _source,
    "aten.full": _source,
    "aten.zeros": _source,
    "aten.ones": _source,
    "aten.empty.memory_format": _source,
    "aten.scalar_tensor": _source,
    "aten.new_ones": _source,
    "aten.new_zeros": _source,
    "aten.new_full": _source,
    "aten.new_empty": _source,
}


# Ops whose placement is fixed by their input's (pointwise and view ops): in the ILP they follow their
# producer instead of making a decision of their own.
FOLLOWER_RULES = {
    _pointwise,
    _reshape,
    _transpose,
    _permute,
    _t,
    _unsqueeze,
    _squeeze,
    _expand,
    _slice,
    _select,
    _split,
}


def is_follower(target: str) -> bool:
    return RULES.get(target) in FOLLOWER_RULES


def chunk_counts(prog: Program) -> tuple[int, ...]:
    """Interleaved-shard chunk counts worth trying: the piece counts of equal splits in the graph."""
    counts = {1}
    for op in prog.ops:
        if op.target in ("aten.split.Tensor", "aten.split_with_sizes") and len(op.types) > 1:
            counts.add(len(op.types))
    return tuple(sorted(counts))


def _combine(per_axis: list[list[OneD]], nin: int, in_types, out_types, sizes) -> list[Strategy]:
    """Products of one-axis strategies whose every tensor divides evenly over the axes sharding it
    (a dim may be sharded over several axes: nested, the earlier axis outer)."""
    out: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        ins = tuple(None if any(c[0][i] is None for c in combo) else tuple(c[0][i] for c in combo) for i in range(nin))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(len(out_types)))
        ok_in = all(p is None or valid(p, t.shape, sizes) for p, t in zip(ins, in_types))
        if ok_in and all(valid(p, t.shape, sizes) for p, t in zip(outs, out_types)):
            out.append(Strategy(ins, outs))
    return out


def op_strategies(
    op: Op, types: dict[str, TensorType], mesh: MeshSpec, counts: tuple[int, ...]
) -> tuple[list[Strategy], bool]:
    """All strategies of ``op`` on ``mesh``, and whether a rule (not the fallback) produced them."""
    ins = [types[r.name] for r in op.input_refs()]
    rule = RULES.get(op.target)
    per_axis = []
    for _, n in mesh.axes:
        c = Ctx(op, ins, list(op.types), n, counts)
        per_axis.append(rule(c) if rule else [_replicated(c)])
    return _combine(per_axis, len(ins), ins, op.types, mesh.sizes), rule is not None


def value_strategies(t: TensorType, mesh: MeshSpec, counts: tuple[int, ...], shardable: bool = True) -> list[Strategy]:
    """Storage placements of a parameter, buffer or input: replicated, or sharded on any dim."""
    per_axis = []
    for _, n in mesh.axes:
        opts: list[OneD] = [((), (R,))]
        if shardable:
            for d, size in enumerate(t.shape):
                for k in _shards(size, n, counts):
                    opts.append(((), (Shard(d, k),)))
        per_axis.append(opts)
    return _combine(per_axis, 0, [], [t], mesh.sizes)


def is_divergent(strategy: Strategy, axis: int) -> bool:
    """Whether ranks of ``axis`` compute different things (some input is not replicated there)."""
    return any(p is not None and not isinstance(p[axis], Replicate) for p in strategy.inputs)
