"""What a sharding rule sees and returns on one mesh axis, and the helpers every rule shares.

A rule (``solver/sharding/rules/``) gives an op's *one-axis* strategies: placements of each tensor input and
each result on a single mesh axis of size n (``OneD``), from the op and its types (``Ctx``).
``solver/sharding/strategies.py`` combines them over the axes of a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.ir.core import Op, Partial, Placement, R, Shard, TensorType

OneD = tuple[tuple[Placement | None, ...], tuple[Placement, ...]]  # (inputs, results) on one axis


@dataclass
class Ctx:
    """An op as a rule sees it on one mesh axis."""

    op: Op
    ins: list[TensorType]  # types of the tensor inputs, in op.input_refs() order
    outs: list[TensorType]
    n: int  # size of the mesh axis
    chunk_counts: tuple[int, ...]


Rule = Callable[[Ctx], list[OneD]]


def shards(size: int, n: int, chunk_counts: tuple[int, ...]) -> list[int]:
    """Chunk counts k for which Shard(dim, k) splits a dim of ``size`` evenly over n ranks."""
    return [k for k in chunk_counts if size % (k * n) == 0 and size >= k * n]


def replicated(c: Ctx) -> OneD:
    """Every input and result replicated (the strategy every op has)."""
    return (tuple(R for _ in c.ins), tuple(R for _ in c.outs))


def identity_dims(c: Ctx, mapping: Callable[[int], int | None], allow_partial: bool = True) -> list[OneD]:
    """Strategies of a one-input view whose input dim d becomes output dim mapping(d) (None: lost)."""
    src = c.ins[0]
    res: list[OneD] = [replicated(c)]
    for d, size in enumerate(src.shape):
        od = mapping(d)
        if od is None:
            continue
        for k in shards(size, c.n, c.chunk_counts):
            if c.outs[0].shape[od] != size:
                continue
            ins = (Shard(d, k),) + tuple(R for _ in c.ins[1:])
            res.append((ins, tuple(Shard(od, k) for _ in c.outs)))
    if allow_partial:
        res.append(((Partial("sum"),) + tuple(R for _ in c.ins[1:]), tuple(Partial("sum") for _ in c.outs)))
    return res
