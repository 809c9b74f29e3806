"""The role of a ``cp`` mesh axis by name (``ShardOptions.roles="name"``): context parallel, as torchtitan and
Megatron-Core lay it out.

Each cp rank is given a contiguous block of every sequence: the user inputs split on dim 1 (``[batch, seq]``
token ids, labels, masks and positions), the parameters and buffers replicated (the gradients of what every
cp rank computes with are all-reduced over cp, as over a data-parallel axis). Every activation is left to the
ILP: where attention needs the whole keys and values it chooses, by price, between computing the attention
on the rank's queries against all-gathered keys and values (``solver/sharding/rules/context.py``) and
gathering the whole sequence before it; positions and masks computed in the graph
from ``arange`` are computed whole and sliced to each rank's rows, so rotary and learned positions are the
global ones.
"""

from __future__ import annotations

from autopar.ir.axes import CONTEXT_AXIS
from autopar.ir.core import Program, R, Shard
from autopar.solver.sharding.baselines import Exactly


def context_axes(prog: Program) -> list[int]:
    """The indices of ``prog``'s mesh axes named ``cp`` with more than one rank."""
    return [i for i, (n, s) in enumerate(prog.mesh.axes) if n == CONTEXT_AXIS and s > 1]


def context_parallel_constraints(prog: Program) -> dict:
    """``ShardOptions.constrain`` entries fixing the cp axis's role (the module docstring); the other axes left
    open. An input whose dim 1 does not divide over cp is left to the ILP."""
    cp = context_axes(prog)
    if not cp:
        return {}
    size = prog.mesh.sizes[cp[0]]
    names = prog.mesh.names
    out: dict = {}
    for v in prog.inputs:
        if v.kind in ("param", "buffer"):
            p = R
        elif v.kind == "input" and len(v.type.shape) >= 2 and v.type.shape[1] % size == 0:
            p = Shard(1)
        else:
            continue
        out[v.name] = Exactly(tuple(p if i in cp else None for i in range(len(names))))
    return out


__all__ = ["context_axes", "context_parallel_constraints"]
