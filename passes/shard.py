"""The `shard` pass: enumerate strategies per op, solve the ILP, write the chosen placements.

Every op's result types get the chosen placements, and the op gets an attribute ``in`` with the
placements its inputs must have ("*" where any will do); `insert-collectives` turns every mismatch
between a producer's placement and a consumer's ``in`` into collectives and drops the attribute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autopar.passes.ir import Op, Placement, Program, R, Ref, TensorType, Value, iter_refs
from autopar.solver import cost as C
from autopar.solver.ilp import Edge, Node, Solution, solve
from autopar.solver.strategies import Strategy, chunk_counts, is_divergent, op_strategies, value_strategies


@dataclass
class ShardOptions:
    alpha: float = 1.0  # weight of communication bytes against memory bytes
    time_limit: float | None = 60.0
    backend: str = "cbc"
    budget_bytes: float | None = None
    shard_inputs: bool = True  # may user inputs be sharded (e.g. the batch over dp)


@dataclass
class ShardResult:
    program: Program
    solution: Solution
    strategies: list[list[Strategy]]
    unruled: list[str] = field(default_factory=list)  # op targets that fell back to replication


def format_placements(p: tuple[Placement, ...] | None) -> str:
    return "*" if p is None else ",".join(str(x) for x in p)


def build_problem(prog: Program, opts: ShardOptions):
    mesh = prog.mesh
    types = prog.types()
    counts = chunk_counts(prog)
    nodes: list[Node] = []
    strategies: list[list[Strategy]] = []
    index: dict[str, tuple[int, int]] = {}  # value name -> (node, result position)
    unruled: set[str] = set()

    def add(name: str, strats: list[Strategy], costs: list[float], memory: list[float]) -> int:
        nodes.append(Node(name, costs, memory))
        strategies.append(strats)
        return len(nodes) - 1

    for v in prog.inputs:
        shardable = v.kind == "param" or (v.kind == "input" and opts.shard_inputs) or v.kind == "buffer"
        strats = value_strategies(v.type, mesh, counts, shardable)
        factor = 4.0 if v.kind == "param" else 1.0
        mem = [factor * C.local_bytes(v.type, s.outputs[0], mesh) for s in strats]
        index[v.name] = (add(v.name, strats, list(mem), mem), 0)

    edges: list[Edge] = []
    for op in prog.ops:
        strats, ruled = op_strategies(op, types, mesh, counts)
        if not ruled:
            unruled.add(op.target)
        refs = op.input_refs()
        costs, memory = [], []
        for s in strats:
            mem = sum(C.local_bytes(t, p, mesh) for t, p in zip(op.types, s.outputs))
            comm = 0.0
            for ref, p in zip(refs, s.inputs):
                t = types[ref.name]
                if p is None or not t.is_float:
                    continue
                for a in range(len(mesh.axes)):
                    if isinstance(p[a], type(R)) and is_divergent(s, a):
                        comm += C.grad_reduce_bytes(t, p, mesh, a)
            costs.append(mem + opts.alpha * comm)
            memory.append(mem)
        k = add(op.result, strats, costs, memory)
        for r_i, r in enumerate(op.results):
            index[r] = (k, r_i)
        for pos, ref in enumerate(refs):
            edges.append(_edge(index[ref.name], (k, pos), strategies, types[ref.name], mesh, opts))

    # the outputs are returned whole: every rank gets the replicated value
    out_refs = list(iter_refs(prog.outputs))
    if out_refs:
        sink = add("<output>", [Strategy(tuple((R,) * len(mesh.axes) for _ in out_refs), ())], [0.0], [0.0])
        for pos, ref in enumerate(out_refs):
            edges.append(_edge(index[ref.name], (sink, pos), strategies, types[ref.name], mesh, opts))
    return nodes, edges, strategies, index, sorted(unruled)


def _edge(src, dst, strategies, t: TensorType, mesh, opts) -> Edge:
    (u, ui), (v, vi) = src, dst
    u_keys = [s.outputs[ui] for s in strategies[u]]
    v_keys = [s.inputs[vi] for s in strategies[v]]
    ug = _group(u_keys)
    vg = _group(v_keys)
    cost = {}
    for a_key, a in ug[1].items():
        for b_key, b in vg[1].items():
            c = 0.0 if b_key is None else C.redistribute_bytes(t, a_key, b_key, mesh)
            if c != C.INF:
                cost[a, b] = opts.alpha * c
    return Edge(u, v, ug[0], vg[0], cost)


def _group(keys):
    ids: dict = {}
    out = []
    for k in keys:
        ids.setdefault(k, len(ids))
        out.append(ids[k])
    return out, ids


def shard(prog: Program, opts: ShardOptions | None = None) -> ShardResult:
    opts = opts or ShardOptions()
    nodes, edges, strategies, index, unruled = build_problem(prog, opts)
    sol = solve(nodes, edges, budget=opts.budget_bytes, time_limit=opts.time_limit, backend=opts.backend)
    chosen = [strategies[i][c] for i, c in enumerate(sol.choice)]
    inputs = []
    for v in prog.inputs:
        s = chosen[index[v.name][0]]
        inputs.append(Value(v.name, v.kind, v.type.with_placements(s.outputs[0]), dict(v.attrs)))
    ops = []
    for op in prog.ops:
        s = chosen[index[op.result][0]]
        types = tuple(t.with_placements(p) for t, p in zip(op.types, s.outputs))
        attrs = dict(op.attrs, **{"in": [format_placements(p) for p in s.inputs]})
        ops.append(op.with_(types=types, attrs=attrs))
    out = prog.with_(inputs=tuple(inputs), ops=tuple(ops))
    out = out.with_(attrs=dict(out.attrs, ilp_objective=round(sol.objective, 3), ilp_status=sol.status))
    return ShardResult(out, sol, strategies, unruled)


def required_inputs(op: Op) -> list[tuple[Placement, ...] | None]:
    """The placements recorded by `shard` for each tensor input of op (None where any will do)."""
    from autopar.passes.ir import parse_placement

    out = []
    for text in op.attrs.get("in", []):
        out.append(
            None
            if text == "*"
            else tuple(parse_placement(x) for x in re.findall(r"[^,(]+(?:\([^)]*\))?", text))
        )
    return out


__all__ = ["ShardOptions", "ShardResult", "shard", "required_inputs", "Ref", "TensorType"]
