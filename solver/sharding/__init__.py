"""The intra-operator sharding problem: candidates and rules per op, the cost model, the ILP and its
presolve, the baselines, the memory prediction."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.solver.sharding module, deprecated
