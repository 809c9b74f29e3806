"""Gradients and optimizer state: data-parallel sync in buckets, ZeRO-1/2/3 and MiCS, the optimizer,
global-norm clipping."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.runtime.grads module, deprecated
