"""Feeding a compiled model: which rows of each global batch this rank takes, a sampler for them, a corpus.

With ``autopar.compile(..., batch="local")`` each data-parallel rank passes only its shard of the
batch, the ``DistributedSampler`` convention; the plan's layout decides which rows that is
(``layout(model)``: the ``dp*`` axes, MiCS's partition and replica axes alike, and the microbatches,
each of which every data-parallel rank takes an equal contiguous share of). Ranks that differ only on
tensor- or pipeline-parallel axes take the same rows, and a pipeline rank whose stages read no input
(``layout(model).inputs`` is empty: the middle stages) needs no data at all::

    model = autopar.compile(model, mesh, kwargs=example_global_batch, microbatches=4, batch="local")
    sampler = autopar.data.BatchSampler(len(dataset), 32, model, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:                  # this rank's rows of each global batch of 32
            loss = model.train_step(**batch)

Every rank draws the same global batches (one seed), so the rows of all ranks together are the
global batch a single process would draw, and the run computes the same numbers.

The data position is checkpointed with the model: ``checkpoint.save(path, model, objects={"data": loader})``
takes the ``BatchSampler`` (its ``state_dict``: the epoch and the global batches drawn in it), a torch
``DataLoader`` over one (``num_workers=0``, whose sampler is drawn exactly as batches are consumed), or
anything with ``state_dict``/``load_state_dict`` such as torchdata's ``StatefulDataLoader``. The position
is counted in global batches, so a run resumed on another mesh (another dp size) continues with the next
global batch, each rank taking its new rows of it: every sample of the epoch is seen once::

    checkpoint.load(path, model, objects={"data": loader})     # model compiled on the new mesh
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                               # the resumed epoch continues where it stopped
        for batch in loader: ...
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Sampler

from autopar.errors import BatchError
from autopar.runtime.call.batch import DataLayout, take_rows, token_count
from autopar.runtime.checkpoint.objects import checkpointable
from autopar.runtime.module import ParallelModule


def layout(model: ParallelModule) -> DataLayout:
    """Which rows of each global batch ``model``'s rank computes on, and which inputs its stages read."""
    return model.data_layout


def local_rows(model: ParallelModule) -> list[int]:
    """The positions in the global batch of this rank's rows, in the order its local batch holds them."""
    return model.data_layout.data_rows()


def local_batch(model: ParallelModule, batch: Any) -> Any:
    """This rank's shard of a global ``batch`` (any nest of tensors with the batch on dim 0)."""
    return take_rows(batch, local_rows(model))


class BatchSampler(Sampler[list[int]]):
    """A batch sampler over a dataset of ``size`` items: each step's global batch of ``batch_size``
    indices (a permutation drawn from ``seed`` and the epoch when ``shuffle``, else in order; the last
    incomplete batch is dropped, as a plan runs one batch size), of which it yields the ones ``model``
    is called with: this rank's rows when it was compiled with ``batch="local"``, else all of them
    (also without a model: a single-process reference)."""

    def __init__(
        self, size: int, batch_size: int, model: ParallelModule | None = None, *, shuffle: bool = True, seed: int = 0
    ):
        if batch_size < 1 or size < batch_size:
            raise BatchError(f"a dataset of {size} items has no batch of {batch_size}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.start = 0, 0
        self.position = 0  # global batches of this epoch drawn so far (the checkpointed position)
        self._resume: tuple[int, int] | None = None  # (epoch, position) loaded, until set_epoch takes it
        self.rows: list[int] | None = None
        if model is not None:
            lay = model.data_layout
            if batch_size != lay.global_batch:
                raise BatchError(
                    f"the model was compiled for a global batch of {lay.global_batch}, not {batch_size}: "
                    "give the sampler the global batch size (every rank the same)"
                )
            if model.options.batch == "local":
                self.rows = lay.data_rows()

    def set_epoch(self, epoch: int, start: int | None = None) -> None:
        """Draw epoch ``epoch``'s order (call on every rank alike); skip its first ``start`` batches
        (resuming mid-epoch; default: where a loaded checkpoint stopped in this epoch, else 0)."""
        if start is None:
            start = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None
        self.epoch, self.start, self.position = epoch, start, start

    def state_dict(self) -> dict[str, Any]:
        """The data position: the epoch and the global batches drawn in it (and what checks a resume draws the
        same batches: the dataset size, global batch size, shuffle and seed)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position: the next iteration (and ``set_epoch`` of the saved epoch) starts at
        the next global batch. Refuses a position of other batches (another dataset size, batch size, order)."""
        mine = self.state_dict()
        differ = [k for k in ("size", "batch_size", "shuffle", "seed") if state.get(k) != mine[k]]
        if differ:
            saved = ", ".join(f"{k} {state.get(k)!r} (here {mine[k]!r})" for k in differ)
            raise BatchError(f"the saved data position is for other batches: {saved}; build the sampler as saved")
        self._resume = (state["epoch"], state["position"])
        self.epoch, self.start, self.position = state["epoch"], state["position"], state["position"]

    def __len__(self) -> int:
        return self.size // self.batch_size - self.start

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        for b in range(self.start, self.size // self.batch_size):
            batch = order[b * self.batch_size : (b + 1) * self.batch_size]
            self.position = b + 1
            yield (batch[self.rows] if self.rows is not None else batch).tolist()


def text_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Text on every machine with Python, nothing downloaded: the bytes (token ids 0-255) of the
    standard library's ``.py`` files, in a fixed order, at most ``max_bytes`` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


__all__ = [
    "BatchSampler",
    "DataLayout",
    "checkpointable",
    "layout",
    "local_batch",
    "local_rows",
    "text_corpus",
    "token_count",
]
