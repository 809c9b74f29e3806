"""Axis roles by name (``ShardOptions.roles="name"``, the default of ``TrainConfig``): the constraints that make
each mesh axis do what its name says (``ir/axes.py``), as torchtitan names them.

- ``dp*`` axes are data parallel: parameters and buffers replicated there, the batch split on dim 0 in the
  inputs and in every batch-carrying activation (``baselines.data_parallel_constraints``), so gradients are
  all-reduced over them (ZeRO shards what the config asks on top: memory accounting, not placement);
- ``tp*`` axes are tensor parallel as Megatron-LM lays the weights out (``megatron_roles.megatron_layout``):
  column-parallel weights split on their output features, row-parallel ones on their input features,
  embedding tables by vocabulary, the rest (norms, a weight too small to split) replicated; the user inputs
  replicated there. Every parameter is computed with where it is stored (pinned), so a tp-sharded weight is
  never all-gathered: the activations move instead, as in Megatron;
- ``cp`` axes are context parallel (``context_roles.py``): the user inputs split on the sequence (dim 1),
  parameters and buffers replicated; the ILP places every activation there by cost;
- ``ep*`` axes are expert parallel (``expert_parallel_constraints``): each mixture of experts' expert table (a 3-D
  parameter a grouped matmul reads as its experts' weights or an expert gather as its table) split on its
  experts there, so each rank holds E/n experts and tokens travel to them; a table whose experts do not divide
  over the axis is left to the ILP, and so is everything else on ep;
- ``pp`` is cut into stages before the ILP.

The ILP chooses everything the roles leave open: the placements of the activations on the tp axes (where
Megatron's f and g fall), the activations on cp, and everything but the expert tables on ep. ``roles="auto"``
adds none of these constraints.
"""

from __future__ import annotations

from autopar.ir.axes import data_axes, is_expert_axis, is_tensor_axis
from autopar.ir.core import Op, Placement, Program, R, Shard
from autopar.ir.layout import valid
from autopar.solver.sharding.baselines import Exactly, data_parallel_constraints
from autopar.solver.sharding.context_roles import context_parallel_constraints
from autopar.solver.sharding.experts import EXPERT_GATHER, EXPERT_GROUPED_MM
from autopar.solver.sharding.megatron_roles import megatron_layout, param_origins

ROLES = ("name", "auto")


def tensor_parallel_constraints(prog: Program) -> dict:
    """``ShardOptions.constrain`` entries fixing Megatron's layout on the ``tp*`` axes of ``prog``'s mesh (the
    other axes left open): each parameter's placement there, and the user inputs replicated there."""
    names = prog.mesh.names
    tp = [i for i, (n, s) in enumerate(prog.mesh.axes) if is_tensor_axis(n) and s > 1]
    if not tp:
        return {}
    layout = megatron_layout(prog)
    out: dict = {}
    for v in prog.inputs:
        want: list[Placement | None] = [None] * len(names)
        if v.kind in ("param", "buffer"):
            split = v.kind == "param" and v.name in layout
            for i in tp:
                want[i] = Shard(layout[v.name][1], layout[v.name][2]) if split else R
            strictest = tuple(R if w is None else w for w in want)
            if split and not valid(strictest, v.type.shape, prog.mesh.sizes):  # too small to split: replicated
                want = [R if i in tp else None for i in range(len(names))]
        elif v.kind == "input":
            for i in tp:
                want[i] = R
        else:
            continue
        out[v.name] = Exactly(tuple(want))
    return out


def expert_reads(prog: Program) -> list[tuple[Op, str]]:
    """Each op of ``prog`` reading an expert table, with the table: a 3-D parameter that a grouped matmul reads as
    its weights or an expert gather (``aten.index.Tensor`` by 1-D indices) as its table, directly or through views,
    casts and collectives."""
    types = prog.types()
    origin = param_origins(prog, collectives=True)
    reads = []
    for op in prog.ops:
        refs = [r.name for r in op.input_refs()]
        if op.target in EXPERT_GROUPED_MM and len(refs) == 3:
            read = refs[1]
        elif op.target == EXPERT_GATHER and len(refs) == 2 and len(types[refs[1]].shape) == 1:
            read = refs[0]
        else:
            continue
        if read in origin and len(types[origin[read]].shape) == 3:
            reads.append((op, origin[read]))
    return reads


def expert_parallel_constraints(prog: Program) -> dict:
    """``ShardOptions.constrain`` entries splitting every expert table of ``prog`` (``expert_reads``) on its experts
    (dim 0) over the ``ep*`` axes of its mesh (the other axes left open); one whose experts do not divide over the
    axes is left out."""
    ep = [i for i, (n, s) in enumerate(prog.mesh.axes) if is_expert_axis(n) and s > 1]
    if not ep:
        return {}
    types = prog.types()
    out = {}
    for name in sorted({table for _, table in expert_reads(prog)}):
        want = tuple(Shard(0) if i in ep else None for i in range(len(prog.mesh.axes)))
        if valid(tuple(R if w is None else w for w in want), types[name].shape, prog.mesh.sizes):
            out[name] = Exactly(want)
    return out


def merged(a: Exactly, b: Exactly) -> Exactly:
    """One ``Exactly`` admitting what both admit (each fixes the axes the other leaves open, or agrees there)."""
    want = []
    for x, y in zip(a.want, b.want):
        if x is not None and y is not None and x != y:
            raise ValueError(f"conflicting placements {x} and {y} for one axis")
        want.append(x if x is not None else y)
    return Exactly(tuple(want))


def role_constraints(prog: Program, activations: bool = True) -> tuple[dict, frozenset[str]]:
    """The constraints of roles by name on ``prog`` (see the module docstring), and the values to pin (read where
    they are stored: the parameters, when there is a tp axis). ``activations``: also split the batch-carrying
    activations on the dp axes (without it a model too small for its compute to matter would be computed whole
    on every dp rank, which communicates least)."""
    out = dict(data_parallel_constraints(prog, data_axes(prog.mesh.names), activations=activations))
    tp = tensor_parallel_constraints(prog)
    for extra in (tp, context_parallel_constraints(prog), expert_parallel_constraints(prog)):
        for name, pred in extra.items():
            out[name] = merged(out[name], pred) if name in out else pred
    pinned = frozenset(v.name for v in prog.inputs if v.kind == "param") if tp else frozenset()
    return out, pinned


__all__ = [
    "ROLES",
    "expert_parallel_constraints",
    "expert_reads",
    "merged",
    "role_constraints",
    "tensor_parallel_constraints",
]
