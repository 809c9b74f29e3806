"""The `shard` pass: solve the program's sharding strategy (solver/sharding.py), write the chosen placements.

Every value's type and every op's result types get the chosen placements, and each op the attribute
``in`` with the placements its inputs must have ("*" where any will do); `insert-collectives` turns
every mismatch into collectives and drops the attribute. What the solver decides, and how, is in
solver/groups.py (decisions and their prices) and solver/sharding.py (the problem and its solution).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from autopar.ir.core import Op, Placement, Program, Value, parse_placement
from autopar.solver.options import OBJECTIVES, ShardOptions, planning_options
from autopar.solver.sharding import Sharding, solve_sharding


@dataclass
class ShardResult(Sharding):
    """The solved strategy and the program it was written into."""

    program: Program = field(kw_only=True)


def format_placements(p: tuple[Placement, ...] | None) -> str:
    return "*" if p is None else ",".join(str(x) for x in p)


def required_inputs(op: Op) -> list[tuple[Placement, ...] | None]:
    """The placements recorded by `shard` for each tensor input of op (None where any will do)."""
    out: list[tuple[Placement, ...] | None] = []
    for text in op.attrs.get("in", []):
        out.append(
            None if text == "*" else tuple(parse_placement(x) for x in re.findall(r"[^,(]+(?:\([^)]*\))?", text))
        )
    return out


def shard(prog: Program, opts: ShardOptions | None = None) -> ShardResult:
    """``prog`` with the placements of the strategy solved under ``opts`` (see the module docstring)."""
    solved = solve_sharding(prog, opts)
    chosen = solved.chosen
    inputs = tuple(
        Value(v.name, v.kind, v.type.with_placements(chosen[v.name].outputs[0]), dict(v.attrs)) for v in prog.inputs
    )
    ops = []
    for op in prog.ops:
        s = chosen[op.result]
        types = tuple(t.with_placements(p) for t, p in zip(op.types, s.outputs))
        ops.append(op.with_(types=types, attrs=dict(op.attrs, **{"in": [format_placements(p) for p in s.inputs]})))
    out = prog.with_(inputs=inputs, ops=tuple(ops))
    sol = solved.solution
    out = out.with_(attrs=dict(out.attrs, ilp_status=sol.status, ilp_objective=round(sol.objective, 3)))
    return ShardResult(**{f.name: getattr(solved, f.name) for f in fields(solved)}, program=out)


__all__ = [
    "OBJECTIVES",
    "ShardOptions",
    "ShardResult",
    "format_placements",
    "planning_options",
    "required_inputs",
    "shard",
]
