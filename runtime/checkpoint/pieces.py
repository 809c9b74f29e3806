"""A rank's part of a whole tensor as boxes at global offsets: what DCP saves, reshards and loads.

A rank holds a tensor of the user's model as its local shard: along each dim, the global indices it
holds are runs of consecutive indices (one run for ``Shard(dim)``, ``chunks`` runs for a strided
``Shard(dim, chunks)``, nested shards of several mesh axes compose), listed by ``dim_runs``. ZeRO keeps
only a flat range of that local shard (a slice of a flattened, padded vector), and the flat range of a
row-major tensor is itself a few boxes (``flat_boxes``). ``boxes`` combines both: each box of the local
elements a buffer holds, with its global offsets and a view of the buffer holding it. ``Pieces`` hands
them to ``torch.distributed.checkpoint`` through its ``_Checkpointable`` protocol (the hooks DTensor
implements): DCP writes each box as a chunk of the tensor's global shape, and on load reads every
saved chunk that overlaps a box into the box's view, whatever mesh wrote it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.ir.core import Shard
from autopar.runtime.comm.shards import shard_tensor

Run = tuple[int, int, int]  # (first local index, first global index, length)


def dim_runs(shape: Sequence[int], placements, mesh_names: Sequence[str], sizes: Sequence[int], coords) -> list:
    """Per dim of a tensor of global ``shape`` placed by ``placements`` (one per mesh axis, outer
    first), the runs of global indices this rank's local shard holds, in local order."""
    runs = []
    for d, length in enumerate(shape):
        index = torch.arange(length)
        for p, name, n in zip(placements, mesh_names, sizes):
            if isinstance(p, Shard) and p.dim == d and n > 1:
                index = shard_tensor(index, 0, p.chunks, n, coords[name])
        runs.append(_runs(index.tolist()))
    return runs


def _runs(index: list[int]) -> list[Run]:
    out: list[Run] = []
    for i, g in enumerate(index):
        if out and out[-1][1] + out[-1][2] == g:
            start, first, n = out[-1]
            out[-1] = (start, first, n + 1)
        else:
            out.append((i, g, 1))
    return out


def whole_runs(shape: Sequence[int]) -> list[list[Run]]:
    """The runs of a tensor held whole."""
    return [[(0, 0, n)] if n else [] for n in shape]


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) whose elements are exactly the row-major flat range [start, stop) of a
    tensor of ``shape``, in flat order (at most 2 x ndim - 1 of them)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:  # whole rows along dim 0
        return [((first, *[0] * (len(shape) - 1)), (last - first + 1, *shape[1:]))]
    if first == last:  # within one row: recurse into it
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], start - first * inner, stop - first * inner)]
    lo = start if start % inner == 0 else (first + 1) * inner  # whole rows from here...
    hi = stop if stop % inner == 0 else last * inner  # ...to here; partial rows around them
    head = flat_boxes(shape, start, lo) if lo > start else []
    body = flat_boxes(shape, lo, hi) if hi > lo else []
    tail = flat_boxes(shape, hi, stop) if stop > hi else []
    return head + body + tail


@dataclass(frozen=True)
class Box:
    """Local elements a buffer holds: ``view`` of the buffer, at ``offsets`` of the global tensor."""

    view: torch.Tensor
    offsets: tuple[int, ...]


def boxes(
    buffer: torch.Tensor,
    local_shape: Sequence[int],
    runs: Sequence[Sequence[Run]],
    start: int = 0,
    stop: int | None = None,
) -> list[Box]:
    """The boxes of the local elements [start, stop) (row-major, of a local shard of ``local_shape``)
    that ``buffer`` (contiguous) holds from its first element on, each a view of ``buffer``."""
    if not buffer.is_contiguous():
        raise ValueError("a checkpointed buffer must be contiguous")
    local_shape = tuple(local_shape)
    stop = math.prod(local_shape) if stop is None else stop
    strides = [math.prod(local_shape[d + 1 :]) for d in range(len(local_shape))]
    out = []
    for lo, size in flat_boxes(local_shape, start, stop):
        per_dim = [_cut(runs[d], lo[d], size[d]) for d in range(len(local_shape))]
        for parts in itertools.product(*per_dim):
            local = [p[0] for p in parts]
            flat = sum(i * s for i, s in zip(local, strides)) - start
            view = buffer.as_strided([p[2] for p in parts], strides, buffer.storage_offset() + flat)
            out.append(Box(view, tuple(p[1] for p in parts)))
    return out


def _cut(runs: Sequence[Run], lo: int, n: int) -> list[Run]:
    """The parts of local range [lo, lo + n) in each run, as (local start, global start, length)."""
    out = []
    for start, first, length in runs:
        a, b = max(lo, start), min(lo + n, start + length)
        if a < b:
            out.append((a, first + a - start, b - a))
    return out


class Pieces(torch.Tensor):
    """A tensor of a global shape of which this rank holds ``boxes`` (DCP's ``_Checkpointable``); it
    supports no operation, only saving and loading."""

    _boxes: list[Box]

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, parts: list[Box]) -> Pieces:
        device = parts[0].view.device if parts else torch.device("cpu")
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        r._boxes = parts
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"Pieces only carries a rank's boxes to torch.distributed.checkpoint (not {func})")

    def _chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=b.view.shape) for b in self._boxes]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=c, properties=props, size=self.shape),
            )
            for c in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for b in self._boxes:
            if b.offsets == tuple(index.offset):
                return b.view
        raise ValueError(f"{index.fqn} has no box at {list(index.offset)} on this rank")

    def staged(self) -> Pieces:
        """The same pieces with each box copied to host memory (what an asynchronous save writes while
        training goes on)."""
        return Pieces(
            self.shape, self.dtype, [Box(b.view.detach().to("cpu", copy=True), b.offsets) for b in self._boxes]
        )

    def __repr__(self) -> str:  # the default one would run operations
        return f"Pieces({list(self.shape)}, {self.dtype}, {len(self._boxes)} boxes)"


__all__ = ["Box", "Pieces", "boxes", "dim_runs", "flat_boxes", "whole_runs"]
