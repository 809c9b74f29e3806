"""The `shard` pass: solve the program's sharding strategy (solver/sharding/solve.py), write the chosen placements.

Every value's type and every op's result types get the chosen placements, and each op the attribute
``in`` with the placements its inputs must have ("*" where any will do); `insert-collectives` turns
every mismatch into collectives and drops the attribute. What the solver decides, and how, is in
solver/sharding/groups.py (decisions and their prices) and solver/sharding/solve.py (the problem and its solution).

With ``roles="name"`` (TrainConfig's default) each mesh axis does what its name says (solver/sharding/roles.py:
dp* data parallel, tp* Megatron's layout), also as ``constrain`` entries, and an axis name without a known role is
a MeshError. Three options are the pass's own (solver/sharding/options.py): ``data_parallel`` becomes constraints
on the program it solves (solver/sharding/baselines.py:data_parallel_constraints over the ``dp*`` axes,
ir/axes.py), so does a local ``batch`` (its inputs split over the ``dp*`` axes as their rows are dealt:
local_batch_constraints), and with ``fallbacks`` a problem that nothing solves is retried in a fixed order
(``attempts``); the result's ``how`` names the attempt that solved it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, fields, replace

from autopar.errors import InfeasibleError, NotOptimalPlanWarning
from autopar.ir.axes import check_axis_names, data_axes
from autopar.ir.core import Op, Placement, Program, Value, parse_placement
from autopar.passes.experts import set_capacity
from autopar.solver.sharding.baselines import data_parallel_constraints, local_batch_constraints
from autopar.solver.sharding.options import OBJECTIVES, ShardOptions, planning_options
from autopar.solver.sharding.roles import role_constraints
from autopar.solver.sharding.solve import Sharding, solve_sharding

AS_ASKED = "as asked"


@dataclass
class ShardResult(Sharding):
    """The solved strategy, the program it was written into, and which attempt solved it (``attempts``)."""

    program: Program = field(kw_only=True)
    how: str = field(default=AS_ASKED, kw_only=True)


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


def attempts(opts: ShardOptions) -> list[tuple[str, ShardOptions]]:
    """What ``shard`` tries, in order, each named: ``opts``; with roles by name then the dp* axes' inputs split
    only (not every batch-carrying activation), then, where Megatron's layout cannot be laid out on the tp*
    axes for this model (a CNN's), the tp* axes placed by cost, and where the batch does not divide over the
    dp* axes every axis by cost (``how`` and the plan's description say which); with ``opts.fallbacks`` then the
    least memory
    without a budget (when the budget, or the solver's memory model of one microbatch with every activation
    saved, leaves nothing), and when the batch-carrying activations were constrained, the same two with the
    inputs constrained only (an op whose activations cannot all stay split on the batch)."""
    out = [(AS_ASKED, opts)]
    if opts.roles == "name":  # the roles' layout may be impossible for a model: relaxed in this order
        if opts.data_parallel is None:  # roles split the batch-carrying activations too
            out.append(("data parallel inputs only", replace(opts, data_parallel="inputs")))
        # without a tp axis these are the attempts above again, and fail as they did
        for dp in ("activations", "inputs") if opts.data_parallel is None else (opts.data_parallel,):
            how = f"Megatron's layout impossible on the tp axes: placed there by cost (data parallel {dp})"
            out.append((how, replace(opts, roles="auto", data_parallel=dp)))
        # last, a batch that does not divide over the dp axes (2 rows on dp=4): every axis by cost, as roles="auto"
        free = "the roles' layout impossible for this model and batch: every axis placed by cost"
        out.append((free, replace(opts, roles="auto", data_parallel=None)))
    if not opts.fallbacks:
        return out
    least = replace(opts, objective="memory", budget_bytes=None)
    if least != opts:
        out.append(("least memory", least))
    if opts.data_parallel == "activations":
        out.append(("data parallel inputs only", replace(opts, data_parallel="inputs")))
        out.append(("data parallel inputs only, least memory", replace(least, data_parallel="inputs")))
    return out


def shard(prog: Program, opts: ShardOptions | None = None) -> ShardResult:
    """``prog`` with the placements of the strategy solved under ``opts`` (see the module docstring); when
    no attempt finds one, the first attempt's InfeasibleError. A plan the ILP did not prove optimal (its time
    limit passed) is returned with a NotOptimalPlanWarning naming its status and gap, which the program's
    attributes also record (``ilp_status``, ``ilp_gap``)."""
    first: InfeasibleError | None = None
    for how, attempt in attempts(opts or ShardOptions()):
        try:
            solved = solve_sharding(prog, constrained(prog, attempt))
        except InfeasibleError as e:
            first = first or _explained(e, attempt)
            continue
        if solved.solution.status != "optimal":
            warnings.warn(solved.solution.explained(), NotOptimalPlanWarning, stacklevel=2)
        written = _written(prog, solved, how, opts.roles if opts is not None else "auto")
        return replace(written, program=set_capacity(written.program, opts.capacity_factor if opts else None))
    assert first is not None  # attempts() lists the options as given first
    raise first


def _explained(e: InfeasibleError, opts: ShardOptions) -> InfeasibleError:
    """A constraint's error under ``data_parallel`` says where the constraints came from."""
    if opts.roles == "name" and e.smallest_budget_bytes is None:
        return InfeasibleError(
            f"{e} (roles by name keep the dp* axes data parallel and lay the weights out on the tp* axes as "
            "Megatron does; TrainConfig(roles='auto') lets the ILP choose every placement)"
        )
    if opts.data_parallel is None or e.smallest_budget_bytes is not None:
        return e
    where = "the inputs and the activations" if opts.data_parallel == "activations" else "the inputs"
    return InfeasibleError(
        f"{e} (ShardOptions.data_parallel={opts.data_parallel!r} keeps the dp* axes data parallel: weights "
        f"replicated there, the batch split in {where})"
    )


def constrained(prog: Program, opts: ShardOptions) -> ShardOptions:
    """``opts`` with roles by name, ``data_parallel`` and a local ``batch`` turned into ``constrain`` entries (all
    must hold where several constrain): the options the solver is given (``autopar explain`` rebuilds with them)."""
    axes = data_axes(prog.mesh.names)
    added = []
    if opts.roles == "name":
        check_axis_names(prog.mesh.names)
        entries, pin = role_constraints(prog, activations=opts.data_parallel != "inputs")
        added.append(entries)
        opts = replace(opts, pin=opts.pin | pin)
    elif opts.data_parallel is not None:
        added.append(data_parallel_constraints(prog, axes, activations=opts.data_parallel == "activations"))
    if opts.batch == "local":
        added.append(local_batch_constraints(prog, axes))
    if not added:
        return opts
    out = dict(opts.constrain or {})
    for entries in added:
        for n, pred in entries.items():
            out[n] = _all_of(out[n], pred) if n in out else pred
    return replace(opts, constrain=out)


def _all_of(a, b):
    return lambda p: a(p) and b(p)


def _written(prog: Program, solved: Sharding, how: str, roles: str = "auto") -> ShardResult:
    """``prog`` with the chosen placements written into its types and each op's ``in`` attribute, and as program
    attributes how the roles were chosen and what the solve predicts (passes/describe.py reports them)."""
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
    out = out.with_(
        attrs=dict(
            out.attrs,
            ilp_status=sol.status,
            ilp_objective=round(sol.objective, 3),
            roles=roles,
            **({"plan_how": how} if how != AS_ASKED else {}),
            predicted_memory_bytes=int(solved.memory_bytes),
            predicted_step_ms=round(solved.step_seconds * 1e3, 6),
        )
    )
    if sol.status != "optimal":
        out = out.with_(attrs=dict(out.attrs, ilp_gap="unknown" if sol.gap is None else round(sol.gap, 6)))
    return ShardResult(**{f.name: getattr(solved, f.name) for f in fields(solved)}, program=out, how=how)


__all__ = [
    "AS_ASKED",
    "OBJECTIVES",
    "ShardOptions",
    "ShardResult",
    "attempts",
    "constrained",
    "format_placements",
    "planning_options",
    "required_inputs",
    "shard",
]
