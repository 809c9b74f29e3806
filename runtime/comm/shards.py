"""Local shard arithmetic: a rank's shard of a tensor under ``Shard(dim, chunks)``, the whole from every
rank's shard, and a call's inputs sliced to this rank."""

from __future__ import annotations

import torch

from autopar.errors import CaptureError
from autopar.ir.core import Shard
from autopar.runtime.comm.context import Comm


def shard_tensor(x: torch.Tensor, dim: int, chunks: int, n: int, coord: int) -> torch.Tensor:
    """Rank ``coord``'s shard of x for Shard(dim, chunks) over n ranks."""
    if chunks == 1:
        return x.tensor_split(n, dim)[coord]
    return torch.cat([piece.tensor_split(n, dim)[coord] for piece in x.chunk(chunks, dim)], dim)


def local_inputs(values, flat: list, comm: Comm, names: tuple[str, ...], device, what: str = "shape") -> list:
    """This rank's shard of each tensor in ``flat`` (the flattened call inputs), for the program inputs
    ``values`` in order: checked against the compiled shape, moved to ``device``, sliced as each
    input's placements over the mesh axes ``names`` say."""

    out = []
    for v, x in zip(values, (x for x in flat if isinstance(x, torch.Tensor))):
        if tuple(x.shape) != v.type.shape:
            raise CaptureError(
                f"input {v.name} has {what} {list(x.shape)} but the model was compiled for "
                f"{list(v.type.shape)}; compile again for the new shape"
            )
        local = x.to(device)
        for p, name in zip(v.type.placements, names):
            if isinstance(p, Shard):
                local = shard_tensor(local, p.dim, p.chunks, comm.sizes[name], comm.coords[name])
        out.append(local.contiguous())
    return out


def unshard_tensor(shards: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """Inverse of shard_tensor given every rank's shard in coordinate order."""
    if chunks == 1:
        return torch.cat(shards, dim)
    pieces = [s.chunk(chunks, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim) for j in range(chunks)], dim)


__all__ = ["local_inputs", "shard_tensor", "unshard_tensor"]
