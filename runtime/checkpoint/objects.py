"""The caller's checkpoint ``objects`` (``save(..., objects={"data": loader})``): anything with
``state_dict``/``load_state_dict`` (``autopar.data.BatchSampler``, torchdata's ``StatefulDataLoader``), or a torch
``DataLoader`` whose sampler keeps a position (``num_workers=0``: its sampler is drawn exactly as batches are
consumed), whose position is its sampler's. Anything else is refused saying what to use."""

from __future__ import annotations

from typing import Any

import torch

from autopar.errors import CheckpointError


class _LoaderPosition:
    """A torch ``DataLoader``'s position as a checkpoint object: its stateful sampler's."""

    def __init__(self, sampler):
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def checkpointable(obj: Any, name: str = "object") -> Any:
    """``obj`` as a checkpoint object (``state_dict``/``load_state_dict``): itself when it has them (a
    ``BatchSampler``, torchdata's ``StatefulDataLoader``), a torch ``DataLoader``'s stateful sampler's position,
    else a ``CheckpointError`` saying what to use."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    if isinstance(obj, torch.utils.data.DataLoader):
        if obj.num_workers > 0:
            raise CheckpointError(
                f"objects[{name!r}]: a DataLoader with num_workers={obj.num_workers} draws batches ahead of the "
                "loop, so its sampler's position is not the consumed one: use torchdata's StatefulDataLoader "
                "(pip install 'autopar[torchdata]') or num_workers=0"
            )
        for sampler in (obj.batch_sampler, obj.sampler):
            if callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None)):
                return _LoaderPosition(sampler)
        raise CheckpointError(
            f"objects[{name!r}]: this DataLoader's sampler ({type(obj.batch_sampler or obj.sampler).__name__}) keeps "
            "no position: give it batch_sampler=autopar.data.BatchSampler(...), or use torchdata's "
            "StatefulDataLoader"
        )
    raise CheckpointError(
        f"objects[{name!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(): a checkpoint "
        "object must have both (autopar.data.BatchSampler, a DataLoader over one, torchdata's StatefulDataLoader)"
    )


__all__ = ["checkpointable"]
