"""Cluster specs: nodes, devices, memory, FLOP/s and links, the units they are written in, the presets,
and collectives priced on them (alpha-beta)."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.solver.cluster module, deprecated
