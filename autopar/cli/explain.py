"""`autopar explain plan.json OP`: why an op got its placement, beside the cost of every alternative."""

from __future__ import annotations

import argparse

from autopar.errors import AutoparError
from autopar.ir.core import Op
from autopar.models import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.plan import Plan
from autopar.planner import options_from_dict
from autopar.solver.cluster import ClusterSpec
from autopar.solver.sharding import build_problem

MiB = 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="show an op's chosen sharding and what each alternative would cost",
        description=(
            "Rebuild the strategy problem of a plan file and show, for the decision that contains OP, the chosen "
            "candidate and the alternatives with their per-device memory, redundant memory, communication and "
            "ILP objective. OP is an SSA name from the plan's IR (%%12 or 12), a parameter name, or a module path "
            "(the first op of that module)."
        ),
        epilog="example: autopar explain plan.json transformer.h.0.attn.c_attn.weight",
    )
    p.add_argument("plan", help="a plan file written by `autopar plan -o`")
    p.add_argument("op", metavar="OP", help="SSA name, parameter name or module path")
    p.add_argument("--top", type=int, default=12, help="how many alternatives to list (default 12)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if not plan.model:
        raise AutoparError("the plan does not name its model; explain needs a plan made by `autopar plan MODEL`")
    spec = build(plan.model, device="meta")
    captured = capture(spec.model, spec.args, spec.kwargs)
    plan.check(captured, plan.mesh_spec)
    cluster = ClusterSpec.from_dict(plan.cluster) if plan.cluster else None
    opts = options_from_dict(plan.options, cluster)
    prog = lower(captured, plan.mesh_spec)
    b, groups, nodes, _ = build_problem(prog, opts)
    key = args.op.lstrip("%")
    gi = _find(groups, key)
    if gi is None:
        raise AutoparError(
            f"no op, parameter or module {args.op!r} in the plan's program; see `autopar ir {plan.model}`"
        )
    g, node = groups[gi], nodes[gi]
    chosen_types = plan.parsed().types()
    chosen = next(
        (i for i, c in enumerate(g.candidates) if all(_matches(chosen_types, n, s) for n, s in c.items())),
        None,
    )
    print(f"decision: {node.name}  ({len(g.ops)} ops, {len(g.values)} folded values, {len(g.candidates)} candidates)")
    for op in g.ops:
        print(f"  %{op.result} = {op.target}  # {op.path}")
    for v in g.values:
        print(f"  {v.kind} %{v.name}")
    order = sorted(range(len(g.candidates)), key=lambda i: node.costs[i])
    shown = order[: args.top] + ([chosen] if chosen is not None and chosen not in order[: args.top] else [])
    print(
        f"\n{'':2s}{'objective':>12s} {'memory':>10s} {'redundant':>10s} {'comm':>10s}  placements "
        "(own costs; resharding to neighbours is on the edges)"
    )
    for i in shown:
        c = g.candidates[i]
        mark = "->" if i == chosen else "  "
        head = g.head.result if isinstance(g.head, Op) else g.head.name
        placements = ",".join(str(p) for p in c[head].outputs[0])
        print(
            f"{mark}{node.costs[i]:>12.4g} {g.memory[i] / MiB:>8.2f}Mi {g.redundancy[i] / MiB:>8.2f}Mi "
            f"{g.comm_bytes[i] / MiB:>8.2f}Mi  {{{placements}}} " + _params(c, g)
        )
    if chosen is None:
        print("\n(the chosen candidate could not be matched: the plan was made with other options)")
    return 0


def _find(groups, key: str) -> int | None:
    for i, g in enumerate(groups):
        names = {r for op in g.ops for r in op.results} | {v.name for v in g.values}
        if isinstance(g.head, Op):
            names.add(g.head.result)
        else:
            names.add(g.head.name)
        if key in names or any(op.path == key for op in g.ops):
            return i
    return None


def _matches(types, name: str, strategy) -> bool:
    t = types.get(name)
    return t is None or t.placements == strategy.outputs[0]


def _params(c, g) -> str:
    items = [
        f"{v.name.rsplit('.', 2)[-2]}.{v.name.rsplit('.', 1)[-1]}={{{','.join(map(str, c[v.name].outputs[0]))}}}"
        for v in g.values
        if v.kind == "param"
    ]
    return " ".join(items[:3])
