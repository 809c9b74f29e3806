"""The whole model from the shards: every key of the user's state dict, gathered on every rank.

``whole_values`` gathers each value this rank's stages hold whole over the mesh axes without the
pipeline (ZeRO-3 slices first, then each ``Shard`` placement, innermost axis first): a collective
over those axes, whose groups hold the same stages, so every member walks the same names in the same
order. ``share_over_pipeline`` then broadcasts each value from the first pipeline rank holding it to
the others, so every rank ends with every value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from autopar.ir.core import Program, Shard
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.comm.pending import gather


@torch.no_grad()
def whole_values(program: Program, local: Callable[[str], torch.Tensor | None], comm: Comm) -> dict[str, torch.Tensor]:
    """Each value of ``program`` for which ``local(name)`` gives this rank's piece (whole over the ZeRO
    axes), gathered whole over the program's mesh axes: new tensors, never views of ``local``'s."""
    out = {}
    with use_comm(comm):
        for v in program.inputs:
            if v.kind == "input":
                continue
            held = local(v.name)
            if held is None:
                continue
            x = held
            for p, name in reversed(list(zip(v.type.placements, program.mesh.names))):
                if isinstance(p, Shard):
                    x = gather(comm, x, name, p.dim, p.chunks)
            # nothing to gather (one process, a replicated value): a copy, never the module's live tensor
            out[v.name] = x.clone() if x.untyped_storage().data_ptr() == held.untyped_storage().data_ptr() else x
    return out


@torch.no_grad()
def share_over_pipeline(values: dict[str, torch.Tensor], group, device: torch.device) -> dict[str, torch.Tensor]:
    """Every pipeline rank's ``values`` on every pipeline rank of ``group`` (a collective over it); a
    value held by several (a tied parameter) comes from the first."""
    n = dist.get_world_size(group)
    if n == 1:
        return dict(values)
    metas: list = [None] * n
    dist.all_gather_object(metas, [(k, tuple(t.shape), t.dtype) for k, t in values.items()], group=group)
    out: dict[str, torch.Tensor] = {}
    for src, meta in enumerate(metas):
        for name, shape, dtype in meta:
            if name in out:
                continue
            t = values[name].contiguous() if name in values else torch.empty(shape, dtype=dtype, device=device)
            wire = t.view(torch.uint8) if t.dtype == torch.bool else t
            dist.broadcast(wire, group=group, group_src=src)
            out[name] = t
    return out


__all__ = ["share_over_pipeline", "whole_values"]
