"""Gradients and optimizer state: data-parallel sync in buckets, ZeRO-1/2/3 and MiCS, the optimizer,
global-norm clipping."""
