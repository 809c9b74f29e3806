"""What calling a compiled module returns on a pipeline: each piece's outputs (and weights) broadcast from
the last stage's rank to every pipeline rank; which outputs carry the batch on dim 0."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.ir.core import Program, Ref
from autopar.runtime.comm.watch import guarded


def broadcast_outputs(program: Program, outputs: list[list[tuple]], src: int, group, device) -> list[list[Any]]:
    """Each piece's outputs of ``program``, from ``group``'s member ``src`` (it holds them in ``outputs``;
    the others receive into buffers of the outputs' local shapes) to every rank of ``group``."""
    mesh, types = program.mesh, program.types()
    out = []
    for got in outputs:
        values = list(got[0]) if got else [None] * len(program.outputs)
        for i, r in enumerate(program.outputs):
            if not isinstance(r, Ref):
                values[i] = r
                continue
            t = types[r.name]
            x = values[i] if values[i] is not None else torch.empty(t.local_shape(mesh), dtype=t.torch_dtype)
            x = x.detach().to(device).contiguous()
            wire = x.view(torch.uint8) if x.dtype == torch.bool else x
            guarded(group, "pp", "broadcast (outputs)", dist.broadcast, wire, group=group, group_src=src)
            values[i] = x
        out.append(values)
    return out


def broadcast_weights(weights: list[float] | None, n: int, src: int, group, device) -> list[float]:
    """The ``n`` pieces' loss weights, from ``group``'s member ``src`` (which computed them) to every rank of it."""
    w = torch.tensor(weights or [0.0] * n, dtype=torch.float64, device=device)
    guarded(group, "pp", "broadcast (loss weights)", dist.broadcast, w, group=group, group_src=src)
    return w.tolist()


def batch_outputs(program: Program, piece_rows: int) -> list[bool]:
    """Per output of ``program``: whether it carries the batch on dim 0 (as inputs do: ``piece_rows`` rows)."""
    types = program.types()
    return [
        isinstance(r, Ref) and bool(types[r.name].shape) and types[r.name].shape[0] == piece_rows
        for r in program.outputs
    ]


__all__ = ["batch_outputs", "broadcast_outputs", "broadcast_weights"]
