"""Sharding rules of a mixture-of-experts block's own ops: the router's top-k, the rows repeated per slot,
the gather of expert tables by the router's indices (expert parallelism), the chunk of a fused gate/up.

``aten.index.Tensor(table, [idx])`` with one index tensor gathers rows of ``table`` (dim 0). Besides the
splits any gather has (the indices by rows with the table whole; the table on a trailing dim with the
indices whole) it offers the *expert-parallel* split: the table on its expert dim and the indices by rows,
the result by rows. Computed as it reads that is no local op (a rank's rows need other ranks' experts);
``passes/experts.py`` makes it one by sending each row to the rank owning its expert and back, and
``solver/sharding/experts.py`` prices those all-to-alls in the op's own communication.
"""

from __future__ import annotations

from autopar.ir.core import Partial, R, Ref, Shard
from autopar.solver.sharding.experts import EXPERT_GROUPED_MM
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, replicated, shards
from autopar.solver.sharding.rules.contractions import RULES as CONTRACTIONS


def _index(c: Ctx) -> list[OneD]:
    """index.Tensor(table, [idx]): one index tensor on dim 0."""
    res: list[OneD] = [replicated(c)]
    indices = c.op.args[1] if len(c.op.args) > 1 else None
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], Ref):
        return res
    table, idx, out = c.ins[0].shape, c.ins[1].shape, c.outs[0].shape
    for d, size in enumerate(idx):  # rows of a whole table, by split indices
        for k in shards(size, c.n, c.chunk_counts):
            res.append(((R, Shard(d, k)), (Shard(d, k),)))
    for d in range(1, len(table)):  # a trailing dim of the table, whole indices
        for k in shards(table[d], c.n, c.chunk_counts):
            res.append(((Shard(d, k), R), (Shard(len(idx) + d - 1, k),)))
    res.append(((Partial("sum"), R), (Partial("sum"),)))  # linear in the table
    if len(idx) == 1 and len(table) >= 2 and table[0] % c.n == 0 and idx[0] % c.n == 0 and out[0] == idx[0]:
        res.append(((Shard(0), Shard(0)), (Shard(0),)))  # expert parallel: experts and rows split
    return res


def _topk(c: Ctx) -> list[OneD]:
    """topk(x, k, dim=-1, ...) -> (values, indices): any dim but the one searched splits all three alike."""
    src = c.ins[0].shape
    dim = (c.op.args[2] if len(c.op.args) > 2 else c.op.kwargs.get("dim", -1)) % len(src)
    res: list[OneD] = [replicated(c)]
    for d, size in enumerate(src):
        if d != dim:
            for k in shards(size, c.n, c.chunk_counts):
                res.append(((Shard(d, k),), (Shard(d, k), Shard(d, k))))
    return res


def _repeat_interleave(c: Ctx) -> list[OneD]:
    """repeat_interleave(x, repeats: int, dim): each row of dim repeated in place, so a split of dim stays
    the split of the result (rank i's rows repeated are the result's i-th slice); other dims pass."""
    src = c.ins[0].shape
    dim = c.op.args[2] if len(c.op.args) > 2 else c.op.kwargs.get("dim")
    res: list[OneD] = [replicated(c)]
    if dim is None or not isinstance(c.op.args[1], int):
        return res
    dim %= len(src)
    for d, size in enumerate(src):
        for k in shards(size, c.n, c.chunk_counts):
            if d != dim or k == 1:
                res.append(((Shard(d, k),), (Shard(d, k),)))
    return res


def _chunk(c: Ctx) -> list[OneD]:
    """chunk(x, pieces, dim): any other dim splits the input and every piece alike."""
    src = c.ins[0].shape
    dim = (c.op.args[2] if len(c.op.args) > 2 else 0) % len(src)
    res: list[OneD] = [replicated(c)]
    for d, size in enumerate(src):
        if d != dim:
            for k in shards(size, c.n, c.chunk_counts):
                res.append(((Shard(d, k),), tuple(Shard(d, k) for _ in c.outs)))
    return res


def _grouped_mm(c: Ctx) -> list[OneD]:
    """A grouped matmul's splits (``rules/contractions.py``) and the expert-parallel one: ``w[E, K, N]`` split on
    its experts, ``x[S, K]`` by rows, the offsets whole, the result by rows (the op sends its rows to their
    experts' ranks and back, ``runtime/comm/all_to_all.py``; priced in ``solver/sharding/experts.py``)."""
    res = CONTRACTIONS[c.op.target](c)
    plain = any(len(s[0]) == 3 and s[0][0] == Shard(0) for s in res)  # the same form that splits rows
    if plain and c.ins[1].shape[0] % c.n == 0:
        res.append(((Shard(0), Shard(0), R), (Shard(0),)))
    return res


RULES: dict[str, Rule] = {
    **{t: _grouped_mm for t in EXPERT_GROUPED_MM},
    "aten.index.Tensor": _index,
    "aten.topk": _topk,
    "aten.repeat_interleave.self_int": _repeat_interleave,
    "aten.chunk": _chunk,
}
