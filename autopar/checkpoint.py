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

from autopar.runtime.checkpoint.export import save_pretrained
from autopar.runtime.checkpoint.safetensors_io import load_safetensors, load_weights, save_safetensors
from autopar.runtime.checkpoint.save_load import PendingSave, Stateful, latest, load, save

__all__ = [
    "PendingSave",
    "Stateful",
    "latest",
    "load",
    "load_safetensors",
    "load_weights",
    "save",
    "save_pretrained",
    "save_safetensors",
]
