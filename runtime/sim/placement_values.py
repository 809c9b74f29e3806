"""Whole tensors to per-rank local values by their placements, and back (for checking sharded programs).

``distribute`` gives each rank its local value of a whole tensor: its shard on ``S`` axes, the whole
tensor on ``R`` axes, and on ``P`` axes a random piece such that the pieces of an axis sum
(``P(sum)``) or average (``P(avg)``) to the whole. ``assemble`` is the inverse: it rebuilds the whole
tensor from every rank's local value, innermost axis first (nested shards, the earlier axis outer,
as ``ir/layout.py`` defines), and measures how far replicas that should be equal differ. Axes
named in ``summed`` treat ``R`` as partial sums: a replicated value's gradient is a partial sum on
every axis where the op that read it computes different things on different ranks (Megatron's f
sums it), so gradients of such inputs are summed there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.ir.core import MeshSpec, Partial, Placement, Replicate, Shard
from autopar.runtime.comm.shards import shard_tensor, unshard_tensor


def distribute(
    x: torch.Tensor, placements: Sequence[Placement], mesh: MeshSpec, coords: Sequence[int], seed: int = 0
) -> torch.Tensor:
    """Rank ``coords``'s local value of the whole tensor ``x`` under ``placements`` (one per axis)."""
    local = x
    for i, (p, n) in enumerate(zip(placements, mesh.sizes)):
        c = coords[i]
        if isinstance(p, Shard):
            local = shard_tensor(local, p.dim, p.chunks, n, c)
        elif isinstance(p, Partial):
            # the same noise for every rank of this axis group (the outer coordinates are fixed)
            g = torch.Generator().manual_seed(hash((seed, i, tuple(coords[:i]))) % 2**62)
            noise = torch.randn((n, *local.shape), generator=g, dtype=torch.float64).to(local.dtype)
            noise = noise - noise.mean(0, keepdim=True)
            local = (local / n if p.op == "sum" else local) + noise[c]
    return local.contiguous()


def assemble(
    locals_: Sequence[torch.Tensor],
    placements: Sequence[Placement],
    mesh: MeshSpec,
    summed: frozenset[int] = frozenset(),
) -> tuple[torch.Tensor, float]:
    """The whole tensor from every rank's local value (ranks in row-major mesh order), and the
    largest difference between replicas that should be equal (R axes not in ``summed``)."""
    sizes = mesh.sizes
    coords = [_coords(r, sizes) for r in range(len(locals_))]
    cur: dict[tuple[int, ...], torch.Tensor] = {tuple(c): t for c, t in zip(coords, locals_)}
    spread = 0.0
    for i in reversed(range(len(sizes))):
        p = placements[i]
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for key in sorted(cur):
            groups.setdefault(key[:i], []).append(cur[key])
        nxt = {}
        for key, parts in groups.items():
            if isinstance(p, Shard):
                nxt[key] = unshard_tensor(parts, p.dim, p.chunks)
            elif isinstance(p, Partial) or (isinstance(p, Replicate) and i in summed):
                whole = torch.stack([t.to(torch.float64) for t in parts]).sum(0)
                if isinstance(p, Partial) and p.op == "avg":
                    whole = whole / len(parts)
                nxt[key] = whole.to(parts[0].dtype) if not parts[0].is_floating_point() else whole
            else:
                for t in parts[1:]:
                    spread = max(spread, _diff(t, parts[0]))
                nxt[key] = parts[0]
        cur = nxt
    return cur[()], spread


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float("inf") if torch.isnan(d).any() else float(d.max())


def _coords(rank: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(sizes):
        out.append(rank % n)
        rank //= n
    return out[::-1]


def distribute_grad(g: torch.Tensor, placements: Sequence[Placement], mesh: MeshSpec, coords: Sequence[int]):
    """Rank ``coords``'s gradient of a value with ``placements`` whose whole gradient is ``g``
    (autopar's convention, runtime/comm/collectives.py): its shard on S axes, whole on R and P(sum) axes,
    whole / n on P(avg) axes (the all-reduce that averages divides the gradient by n)."""
    local = g
    for i, (p, n) in enumerate(zip(placements, mesh.sizes)):
        if isinstance(p, Shard):
            local = shard_tensor(local, p.dim, p.chunks, n, coords[i])
        elif isinstance(p, Partial) and p.op == "avg":
            local = local / n
    return local.contiguous()


def assemble_grad(
    grads: Sequence[torch.Tensor], placements: Sequence[Placement], mesh: MeshSpec, divergent: frozenset[int]
) -> tuple[torch.Tensor, float]:
    """The whole gradient from every rank's (inverse of ``distribute_grad``), where an R value's
    gradient is a partial sum on the ``divergent`` axes, and how far should-be-equal replicas differ."""
    as_placed = [p if isinstance(p, Shard) else Replicate() for p in placements]
    summed = frozenset(i for i in divergent if isinstance(placements[i], Replicate))
    whole, spread = assemble(grads, as_placed, mesh, summed)
    scale = 1
    for p, n in zip(placements, mesh.sizes):
        if isinstance(p, Partial) and p.op == "avg":
            scale *= n
    return (whole * scale if scale != 1 else whole), spread
