"""A ParallelModule's and its optimizer's tensors as pieces of the user's tensors, keyed by the user's names.

Every key is a name of the user's ``model.state_dict()`` (a tied parameter under its first name):
``model/<key>`` the parameter or buffer, ``optim/<key>/<state>`` its optimizer state (``exp_avg``,
``momentum_buffer``, ...) in the parameter's own shape, however this rank holds it:

- a local shard of the plan's placements (``Shard(dim)``, strided ``Shard(dim, chunks)`` as its
  pieces, nested over several axes);
- a ZeRO-3 slice: a flat range of that shard (``Zero3Params``);
- ZeRO-1/2: the optimizer states of ``ZeroOptimizer``'s flat vector, cut back into each parameter's
  range of it.

A scalar state (Adam's ``step``) is saved whole under each parameter's key. So a checkpoint holds no
trace of the mesh it was saved on, and loads on any other (``Pieces``, ``runtime/checkpoint/pieces.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.errors import CheckpointError
from autopar.runtime.checkpoint.pieces import Box, Pieces, boxes, dim_runs
from autopar.runtime.grads.zero import ZeroOptimizer


@dataclass(frozen=True)
class Held:
    """One tensor of this rank: its user key, global shape, the runs of its local shard, and the flat
    range [start, stop) of that shard it keeps (all of it unless ZeRO sliced it)."""

    key: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    runs: list
    start: int
    stop: int

    def boxes(self, buffer: torch.Tensor, at: int = 0) -> list[Box]:
        """The boxes of ``buffer`` (contiguous; its flat element ``at`` holds this tensor's kept element
        ``start``, the next ones follow), each a view of it at its global offsets."""
        return boxes(buffer.reshape(-1)[at:], self.local_shape, self.runs, self.start, self.stop)

    def pieces(self, buffer: torch.Tensor, at: int = 0) -> Pieces:
        """``buffer`` (as for ``boxes``) as pieces of the global tensor."""
        return Pieces(self.shape, buffer.dtype, self.boxes(buffer, at))


def tied_keys(keys: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(program value -> its first user key, every other user key of a value -> that first key) from
    ``ParallelModule.state_keys()``'s key -> value map: a tied tensor is stored once, under its first name."""
    first: dict[str, str] = {}
    aliases = {}
    for key, name in keys.items():
        if name in first:
            aliases[key] = first[name]
        else:
            first[name] = key
    return first, aliases


def held_tensors(pipe) -> dict[str, Held]:
    """Program name -> how this rank holds that value of the user's model (those with a user key)."""
    first, _ = tied_keys(pipe.state_keys()[0])
    values = {v.name: v for v in pipe.program.inputs}
    mesh, coords = pipe.program.mesh, pipe.comm.coords
    out = {}
    for name, t in pipe.local_tensors().items():
        if name not in first:
            continue  # a constant of the program, not in the user's state dict
        v = values[name]
        local_shape = tuple(v.type.local_shape(mesh))
        runs = dim_runs(v.type.shape, v.type.placements, mesh.names, mesh.sizes, coords)
        numel = math.prod(local_shape)
        start, stop = 0, numel
        if pipe.zero3 is not None and pipe.zero3.manages(name):
            start, _ = slice_range(-(-numel // pipe.zero3.parts) * pipe.zero3.parts, pipe.comm, pipe.zero3.zero_axes)
            stop = min(start + t.numel(), numel)
            start = min(start, numel)
        out[name] = Held(first[name], tuple(v.type.shape), local_shape, runs, start, stop)
    return out


def slice_range(padded: int, comm, zero_axes: tuple[str, ...]) -> tuple[int, int]:
    """[start, stop) of this rank's slice of a flat vector of ``padded`` elements cut over the ZeRO axes
    one after the other (``zero.local_slice``)."""
    start, length = 0, padded
    for a in zero_axes:
        length //= comm.sizes[a]
        start += comm.coords[a] * length
    return start, start + length


def model_pieces(pipe, held: dict[str, Held]) -> dict[str, Pieces]:
    """``model/<key>`` -> this rank's pieces of that parameter or buffer (views of the module's own
    tensors: loading writes into them)."""
    local = pipe.local_tensors()
    return {f"model/{h.key}": h.pieces(local[name].detach()) for name, h in held.items() if h.start < h.stop}


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer


def optimizer_params(pipe, optimizer, held: dict[str, Held]) -> list[tuple[torch.Tensor, list[tuple[Held, int]]]]:
    """Each parameter of ``optimizer`` in its param_groups order, with the user tensors whose elements it
    holds: (held, index of that tensor's first kept element in it); ZeRO-2's flat slice holds several."""
    by_id = {id(t): name for name, t in pipe.local_tensors().items()}
    flats = {id(f.master): f for f in optimizer.flats if f.params} if isinstance(optimizer, ZeroOptimizer) else {}
    out = []
    for group in inner_optimizer(optimizer).param_groups:
        for p in group["params"]:
            if id(p) in flats:
                out.append((p, _flat_parts(optimizer, flats[id(p)], held, by_id)))
            elif id(p) in by_id and by_id[id(p)] in held:
                out.append((p, [(held[by_id[id(p)]], 0)]))
            else:
                raise CheckpointError(
                    "the optimizer holds a tensor that is not a parameter of this module: build it over "
                    "pipe.parameters() or with pipe.make_optimizer"
                )
    return out


def _flat_parts(opt: ZeroOptimizer, flat, held: dict[str, Held], by_id: dict[int, str]) -> list[tuple[Held, int]]:
    """The parameters in one group's ZeRO-2 flat slice: each one's kept range and where it starts in the slice.
    A slice that is all padding (a group smaller than its ranks) keeps an empty range of the group's first
    parameter: its optimizer states are still named (the saved ones say which, and their scalars), and are
    zeros, as the padding's are."""
    start, stop = slice_range(flat.padded, opt.comm, opt.zero_axes)
    parts, offset = [], 0
    for p in flat.params:
        a, b = max(start, offset), min(stop, offset + p.numel())
        if a < b:
            h = held[by_id[id(p)]]
            parts.append((Held(h.key, h.shape, h.local_shape, h.runs, a - offset, b - offset), a - start))
        offset += p.numel()
    if not parts:
        h = held[by_id[id(flat.params[0])]]
        parts.append((Held(h.key, h.shape, h.local_shape, h.runs, 0, 0), 0))
    return parts


def state_pieces(parts: list[tuple[Held, int]], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``optim/<key>/<name>`` -> pieces of each tensor state of one optimizer parameter (a scalar
    state whole, under every key)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue  # kept with the hyper-parameters (runtime/checkpoint/save_load.py)
        for h, at in parts:
            if value.dim() == 0:
                out[f"optim/{h.key}/{name}"] = value
            elif h.start < h.stop:  # an empty range (a slice of padding) holds no piece
                out[f"optim/{h.key}/{name}"] = h.pieces(value, at)
    return out


__all__ = [
    "Held",
    "held_tensors",
    "inner_optimizer",
    "model_pieces",
    "optimizer_params",
    "slice_range",
    "state_pieces",
    "tied_keys",
]
