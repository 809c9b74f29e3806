"""Placement arithmetic: replication factors and the collectives that turn one placement into another.

A tensor dim may be sharded over several mesh axes ("nested"): the earlier axis is the outer one,
so rank (i, j) of axes (a, b) both sharding dim d holds block i * n_b + j. Nesting fixes the order
of redistribution steps: a shard is removed innermost first and added outermost first, and a
change of an outer axis on a dim first removes every inner shard of that dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.ir.core import Partial, Placement, R, Replicate, Shard


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis: ``kind`` turns ``before`` into ``after`` (whole placements)."""

    kind: str  # all_reduce | reduce_scatter | all_gather | all_to_all | local_shard
    axis: int
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]


class Unreachable(ValueError):
    """No sequence of collectives produces the target placement (e.g. making a partial sum)."""


def _set(p: tuple[Placement, ...], i: int, value: Placement) -> tuple[Placement, ...]:
    out = list(p)
    out[i] = value
    return tuple(out)


def _inner_shards(p: tuple[Placement, ...], i: int, dim: int) -> bool:
    return any(isinstance(q, Shard) and q.dim == dim for q in p[i + 1 :])


def redistribute_steps(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> list[Step]:
    """The collectives, in order, that turn placements ``src`` into ``dst``."""
    if src == dst:
        return []
    n = len(src)
    steps: list[Step] = []
    cur = tuple(src)
    # phase A, innermost axis first: remove shards and reduce partials
    for i in reversed(range(n)):
        a, b = cur[i], dst[i]
        if isinstance(b, Partial) and a != b:
            raise Unreachable(f"cannot make {b} from {a}")
        if _all_to_all(cur, dst, i):
            nxt = _set(cur, i, b)
            steps.append(Step("all_to_all", i, cur, nxt))
            cur = nxt
        elif isinstance(a, Shard) and (a != b or _outer_change(src, dst, i, a.dim)):
            nxt = _set(cur, i, R)
            steps.append(Step("all_gather", i, cur, nxt))
            cur = nxt
        elif isinstance(a, Partial) and a != b:
            if isinstance(b, Shard) and not _inner_shards(cur, i, b.dim) and not _outer_change(src, dst, i, b.dim):
                nxt = _set(cur, i, b)
                steps.append(Step("reduce_scatter", i, cur, nxt))
            else:
                nxt = _set(cur, i, R)
                steps.append(Step("all_reduce", i, cur, nxt))
            cur = nxt
    # phase B, outermost axis first: add shards
    for i in range(n):
        if cur[i] != dst[i]:
            if not isinstance(cur[i], Replicate) or not isinstance(dst[i], Shard):
                raise Unreachable(f"cannot turn {cur[i]} into {dst[i]} on axis {i}")
            nxt = _set(cur, i, dst[i])
            steps.append(Step("local_shard", i, cur, nxt))
            cur = nxt
    assert cur == tuple(dst), (src, dst, cur)
    return steps


def _all_to_all(cur: tuple[Placement, ...], dst: tuple[Placement, ...], i: int) -> bool:
    """Whether axis ``i`` moves its shard from one dim to another in one all-to-all (Ulysses' sequence-to-heads
    step): both plain shards of different dims that no other axis shards, before or after."""
    a, b = cur[i], dst[i]
    if not (isinstance(a, Shard) and isinstance(b, Shard)) or a.dim == b.dim or a.chunks != 1 or b.chunks != 1:
        return False
    return not any(_touches(cur[j], dst[j], d) for j in range(len(cur)) if j != i for d in (a.dim, b.dim))


def _touches(a: Placement, b: Placement, dim: int) -> bool:
    return any(isinstance(q, Shard) and q.dim == dim for q in (a, b))


def _outer_change(src, dst, i: int, dim: int) -> bool:
    return any(src[j] != dst[j] and _touches(src[j], dst[j], dim) for j in range(i))


def replication(placements: tuple[Placement, ...], sizes: tuple[int, ...], skip: frozenset[int] = frozenset()) -> int:
    """How many ranks hold the same local piece: the product of the sizes of R and P axes."""
    return math.prod(n for i, (p, n) in enumerate(zip(placements, sizes)) if not isinstance(p, Shard) and i not in skip)


def valid(placements: tuple[Placement, ...], shape: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Every sharded dim divides evenly; interleaved (chunked) shards are not nested."""
    per_dim: dict[int, int] = {}
    chunks: dict[int, int] = {}
    for p, n in zip(placements, sizes):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            per_dim[p.dim] = per_dim.get(p.dim, 1) * n
            if p.dim in chunks and (p.chunks > 1 or chunks[p.dim] > 1):
                return False
            chunks[p.dim] = p.chunks
    return all(shape[d] % (k * chunks[d]) == 0 for d, k in per_dim.items())


def deals_rows(placements: tuple[Placement, ...], on: tuple[int, ...]) -> bool:
    """Whether ``placements`` split dim 0 over the mesh axes at the indices ``on`` as a local batch deals
    its rows (``runtime/call/batch.DataLayout``: each of those axes in mesh order, the first outermost):
    ``S(0)`` on each, and no other axis splitting dim 0 outside the last of them."""
    if any(placements[i] != Shard(0) for i in on):
        return False
    last = max(on, default=-1)
    return not any(isinstance(p, Shard) and p.dim == 0 and i < last and i not in on for i, p in enumerate(placements))
