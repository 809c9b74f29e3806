"""Sharding rules of pointwise ops (with broadcasting) and of factories (arange, full, new_ones, ...).

Pointwise ops follow their input: in the ILP they join their producer's decision (``FOLLOWERS``).
"""

from __future__ import annotations

from autopar.ir.core import Partial, R, Shard
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, replicated, shards

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
    res: list[OneD] = [replicated(c)]
    fixed = set(range(rank - 2, rank)) if c.op.target in _LAST_TWO_FIXED else set()
    for d in range(rank):
        if d in fixed:
            continue
        for k in shards(out[d], c.n, c.chunk_counts):
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
    if t == "aten.dropout":  # identity, or x times a mask keyed by global index (runtime/build/rng.py): linear
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


def _source(c: Ctx) -> list[OneD]:
    return [(tuple(None for _ in c.ins), tuple(R for _ in c.outs))]


RULES: dict[str, Rule] = {
    **{t: _pointwise for t in POINTWISE},
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
# ops making a fresh tensor of the shape in their arguments (``q.new_empty(...)``): computed whole on every rank
SOURCES = frozenset(t for t, rule in RULES.items() if rule is _source)
# every pointwise op's placement is fixed by its input's
FOLLOWERS = frozenset(POINTWISE)
