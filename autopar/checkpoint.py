"""Checkpoints of a compiled model, from the facade: save on one mesh, load on any other (resharded), export.

    autopar.checkpoint.save("ckpt/step-100", model, opt, step=100)   # collective, every rank; DCP underneath
    autopar.checkpoint.load(autopar.checkpoint.latest("ckpt"), model, opt)  # on the same or another mesh
    autopar.checkpoint.save_safetensors(model, "model.safetensors")  # the whole model, the user's own names
    model.full_state_dict()                                          # the same, as a state dict on every rank

Resharding is loading: a checkpoint keeps every rank's pieces of the user's tensors at their global offsets,
so a model compiled for another mesh (another dp, tp, pp, ZeRO stage) reads the pieces it holds
(``runtime/checkpoint/``).
"""

from __future__ import annotations

import functools

from autopar.data import checkpointable
from autopar.runtime.checkpoint import save_load
from autopar.runtime.checkpoint.safetensors_io import load_safetensors, load_weights, save_safetensors
from autopar.runtime.checkpoint.save_load import PendingSave, Stateful, latest


def _objects(options: dict) -> dict:
    """``options`` with each of ``objects`` made a checkpoint object (``autopar.data.checkpointable``: a torch
    DataLoader's position is its sampler's)."""
    objects = options.get("objects")
    if objects:
        options = dict(options, objects={k: checkpointable(v, k) for k, v in objects.items()})
    return options


@functools.wraps(save_load.save)
def save(*args, **options):
    return save_load.save(*args, **_objects(options))


@functools.wraps(save_load.load)
def load(*args, **options):
    return save_load.load(*args, **_objects(options))

__all__ = ["PendingSave", "Stateful", "latest", "load", "load_safetensors", "load_weights", "save", "save_safetensors"]
