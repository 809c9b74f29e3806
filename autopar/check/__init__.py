"""Checking plans numerically: one float64 training step of every simulated rank against the model, each
op's strategies against the unsharded op, and scaled-down copies of large models."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.check module, deprecated
