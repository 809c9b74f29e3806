"""Checkpoints: save on one mesh and resume on any other (DCP), the files on disk, pieces of tensors, the
whole model exported (state dict, safetensors)."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.runtime.checkpoint module, deprecated
