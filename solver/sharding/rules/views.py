"""Sharding rules of views (reshape, transpose, slice, split, ...), of writes through a view, cat and pad.

A view moves a dim's shard to where the dim goes and drops it where the dim is lost. Views follow their
input: in the ILP they join their producer's decision (``FOLLOWERS``).
"""

from __future__ import annotations

from autopar.ir.core import Partial, R, Shard
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, identity_dims, replicated, shards


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
    res: list[OneD] = [replicated(c), ((Partial("sum"),), (Partial("sum"),))]
    if groups is None:
        return res
    for gi, gj in groups:
        if not gi or not gj:
            continue
        # only the outermost dim of a group carries a shard through a merge or a split
        for k in shards(src[gi[0]], c.n, c.chunk_counts):
            if dst[gj[0]] % (k * c.n) == 0:
                res.append(((Shard(gi[0], k),), (Shard(gj[0], k),)))
    return res


def _transpose(c: Ctx) -> list[OneD]:
    a, b = (x % len(c.ins[0].shape) for x in c.op.args[1:3])
    return identity_dims(c, lambda d: b if d == a else a if d == b else d)


def _permute(c: Ctx) -> list[OneD]:
    dims = [x % len(c.ins[0].shape) for x in c.op.args[1]]
    return identity_dims(c, lambda d: dims.index(d))


def _t(c: Ctx) -> list[OneD]:
    return identity_dims(c, lambda d: len(c.ins[0].shape) - 1 - d)


def _unsqueeze(c: Ctx) -> list[OneD]:
    at = c.op.args[1] % len(c.outs[0].shape)
    return identity_dims(c, lambda d: d if d < at else d + 1)


def _squeeze(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    if len(c.op.args) < 2:
        # squeeze() without dims also drops a sharded dim whose local size is 1 (the rank simulator's
        # rule test found it): sharding stays off until codegen names the dims (aten.squeeze.dims)
        return identity_dims(c, lambda d: None)
    dims = c.op.args[1]
    dims = {x % len(src) for x in (dims if isinstance(dims, (list, tuple)) else [dims])}
    dims = {d for d in dims if src[d] == 1}
    return identity_dims(c, lambda d: None if d in dims else d - sum(1 for x in dims if x < d))


def _expand(c: Ctx) -> list[OneD]:
    src, dst = c.ins[0].shape, c.outs[0].shape
    off = len(dst) - len(src)
    return identity_dims(c, lambda d: d + off if src[d] == dst[d + off] else None)


def _slice(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    dim = c.op.args[1] % len(src) if len(c.op.args) > 1 else 0
    full = c.outs[0].shape[dim] == src[dim]
    return identity_dims(c, lambda d: d if d != dim or full else None)


def _select(c: Ctx) -> list[OneD]:
    dim = c.op.args[1] % len(c.ins[0].shape)
    return identity_dims(c, lambda d: None if d == dim else d if d < dim else d - 1)


def _split(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    dim = (c.op.args[2] if len(c.op.args) > 2 else 0) % len(src)
    res = identity_dims(c, lambda d: None if d == dim else d)
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
    res: list[OneD] = [replicated(c)]
    if len(c.ins) != 2:
        return res
    for d in range(len(out)):
        if d == dim:
            continue
        for k in shards(out[d], c.n, c.chunk_counts):
            res.append(((Shard(d, k), Shard(d if same_rank or d < dim else d - 1, k)), (Shard(d, k),)))
    return res


def _index_scatter(c: Ctx) -> list[OneD]:
    """scatter(self, dim, index, value | src) and gather(self, dim, index): each element of ``index`` names where
    along ``dim`` its row of self takes the value, or is read (DeepSeek-V3's router marks its chosen groups so,
    ``zeros_like(...).scatter_(1, idx, 1)``, and gathers its chosen experts' weights): any other dim where index
    (and src) are as long as self and the result splits them all alike."""
    out = c.outs[0].shape
    dim = c.op.args[1] % len(out) if len(c.op.args) > 1 and isinstance(c.op.args[1], int) else None
    res: list[OneD] = [replicated(c)]
    if dim is None or any(len(t.shape) != len(out) for t in c.ins):
        return res
    # scatter's result is its self (the batch-coupling analysis gives a data-free self, zeros_like(x), its own
    # shape): the index and src line up with it; gather's with its self too
    aligned = c.ins[1:] if c.op.target.startswith("aten.scatter") else c.ins
    for d in range(len(out)):
        if d == dim or any(t.shape[d] != out[d] for t in aligned):
            continue
        for k in shards(out[d], c.n, c.chunk_counts):
            res.append((tuple(Shard(d, k) for _ in c.ins), (Shard(d, k),)))
    return res


def _cat(c: Ctx) -> list[OneD]:
    """Every input split like the result on a dim other than the concatenated one; an input ``torch.cat`` skips (a
    1-D empty tensor beside higher-rank ones: transformers' empty key/value cache, concatenated with each layer's
    keys along the sequence) replicated, and with one other input the cat is that input, split on any dim (the
    sequence too: context parallelism's keys need no gather there)."""
    rank = len(c.outs[0].shape)
    dim = (c.op.args[1] if len(c.op.args) > 1 else 0) % rank
    skipped = [rank > 1 and t.shape == (0,) for t in c.ins]
    res: list[OneD] = [replicated(c)]
    for d in range(rank):
        if d == dim and skipped.count(False) != 1:
            continue
        for k in shards(c.outs[0].shape[d], c.n, c.chunk_counts):
            res.append((tuple(R if skip else Shard(d, k) for skip in skipped), (Shard(d, k),)))
    return res


def _pad(c: Ctx) -> list[OneD]:
    src = c.ins[0].shape
    pads = c.op.args[1]
    padded = {len(src) - 1 - i // 2 for i, p in enumerate(pads) if p}
    return identity_dims(c, lambda d: None if d in padded else d, allow_partial=False)


RULES: dict[str, Rule] = {
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
    "aten.scatter.value": _index_scatter,
    "aten.scatter.src": _index_scatter,
    "aten.gather": _index_scatter,
    "aten.cat": _cat,
    "aten.pad": _pad,
    "aten.constant_pad_nd": _pad,
}
FOLLOWERS = frozenset(
    t
    for t, rule in RULES.items()
    if rule in {_reshape, _transpose, _permute, _t, _unsqueeze, _squeeze, _expand, _slice, _select, _split}
)
