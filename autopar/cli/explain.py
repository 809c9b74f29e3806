"""`autopar explain plan.json OP`: why an op got its placement, beside the cost of every alternative."""

from __future__ import annotations

import argparse
import math

from autopar.errors import AutoparError
from autopar.ir.core import Op
from autopar.models.resolve import build
from autopar.passes.lower import lower
from autopar.passes.shard import AS_ASKED, attempts, constrained
from autopar.plan import Plan
from autopar.planner import capture_for_planning, options_from_dict
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.problem import switch_costs
from autopar.solver.sharding.solve import SharedReads, build_problem

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
    opts, (b, groups, nodes, edges) = rebuild(plan)
    key = args.op.lstrip("%")
    gi = _find(groups, key)
    if gi is None:
        raise AutoparError(
            f"no op, parameter or module {args.op!r} in the plan's program; see `autopar ir {plan.model}`"
        )
    g, node = groups[gi], nodes[gi]
    choice = plan_choice(groups, nodes, edges, plan.parsed().types())
    shared = [i for i, x in enumerate(groups) if isinstance(x, SharedReads)]
    delta = switch_costs(nodes, edges, choice, gi, shared) if choice is not None else None
    chosen = choice[gi] if choice is not None else None
    print(f"decision: {node.name}  ({len(g.ops)} ops, {len(g.values)} folded values, {len(g.candidates)} candidates)")
    for op in g.ops:
        print(f"  %{op.result} = {op.target}  # {op.path}")
    for v in g.values:
        print(f"  {v.kind} %{v.name}")
    rank = delta if delta is not None else node.costs
    order = sorted(range(len(g.candidates)), key=lambda i: (rank[i], node.costs[i]))
    shown = order[: args.top] + ([chosen] if chosen is not None and chosen not in order[: args.top] else [])
    print(f"\n{'':2s}{'vs plan':>10s} {'own cost':>10s} {'memory':>10s} {'redundant':>10s} {'comm':>10s}  placements")
    for i in shown:
        c = g.candidates[i]
        mark = "->" if i == chosen else "  "
        head = g.head.result if isinstance(g.head, Op) else g.head.name
        placements = ",".join(str(p) for p in c[head].outputs[0])
        vs = f"{delta[i]:+10.3g}" if delta is not None else f"{'?':>10s}"
        print(
            f"{mark}{vs} {node.costs[i]:>10.4g} {g.memory[i] / MiB:>8.2f}Mi {g.redundancy[i] / MiB:>8.2f}Mi "
            f"{g.comm_bytes[i] / MiB:>8.2f}Mi  {{{placements}}} " + _params(c, g)
        )
    print(
        "\nvs plan: the ILP objective's change if this decision alone took the candidate, the rest of the plan as it"
        "\nis (the reshardings to its neighbours and the f's and gathers its readers share re-priced); own cost:"
        "\nthe candidate's compute, memory and communication inside the decision. "
        + ("In seconds per step." if opts.objective != "memory" else "In bytes (redundant memory + alpha x comm).")
    )
    if choice is None:
        print("\n(the plan's placements match no candidate here: the plan was made with other options)")
    return 0


def rebuild(plan: Plan):
    """(the sharding options, ``build_problem``'s (builder, groups, nodes, edges)) of the strategy problem that
    ``plan`` solved: its model captured again on the meta device as planning captures it, its mesh, cluster and
    options."""
    if not plan.model:
        raise AutoparError("the plan does not name its model; explain needs a plan made by `autopar plan MODEL`")
    spec = build(plan.model, device="meta")
    precision = plan.options.get("setup", {}).get("precision", "fp32")  # captured as the plan was (bf16: its copy)
    # as `autopar plan` captured it: alike layers captured twice and repeated by lower, the same program
    captured = capture_for_planning(spec.model, spec.args, spec.kwargs, precision)
    plan.check(captured, plan.mesh_spec)
    cluster = ClusterSpec.from_dict(plan.cluster) if plan.cluster else None
    opts = options_from_dict(plan.options, cluster)
    lowered = lower(captured, plan.mesh_spec)
    # the constraints the attempt that solved it had (roles by name, data_parallel), named by the program
    how = plan.parsed().attrs.get("plan_how", AS_ASKED)
    opts = constrained(lowered, dict(attempts(opts)).get(how, opts))
    return opts, build_problem(lowered, opts)


def plan_choice(groups, nodes, edges, types) -> list[int] | None:
    """The candidate of each decision that the plan's placements (``types``: SSA name -> type) took, None where
    some decision has none. Where several match (alike in their outputs), the one cheapest beside its
    neighbours; each ``SharedReads`` node takes its best key beside its producer and readers."""
    shared = [i for i, g in enumerate(groups) if isinstance(g, SharedReads)]
    matching = []
    for g in groups:
        if isinstance(g, SharedReads):
            matching.append(list(range(len(g.candidates))))
            continue
        m = [i for i, c in enumerate(g.candidates) if all(_matches(types, n, s) for n, s in c.items())]
        if not m:
            return None
        matching.append(m)
    choice = [min(m, key=lambda i, n=n: n.costs[i]) for m, n in zip(matching, nodes)]
    for i, m in enumerate(matching):  # the alike candidates (and the shared keys) settled by their neighbours
        if len(m) > 1:
            free = () if isinstance(groups[i], SharedReads) else shared
            d = switch_costs(nodes, edges, choice, i, free)
            if math.isnan(d[choice[i]]):  # the first guess is incompatible with a neighbour (inf - inf): re-measure
                choice[i] = next((k for k in m if d[k] == -math.inf), choice[i])  # from a compatible candidate
                d = switch_costs(nodes, edges, choice, i, free)
            choice[i] = min(m, key=lambda k: d[k])
    return choice


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
