"""Pipeline stage balance: contiguous runs of a split's subgraphs onto stages, their time and memory, the
stage plan."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.solver.stages module, deprecated
