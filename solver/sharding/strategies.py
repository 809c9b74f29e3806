"""Sharding candidates: for each IR op, every valid assignment of placements on an N-D mesh.

A rule gives the op's *one-axis* strategies (``solver/sharding/one_axis.py``): placements of each tensor input
and each result on a single mesh axis of size n. The rules live by kind of op in ``solver/sharding/rules/``
and are collected in ``RULES``. Strategies on the whole mesh are the product over axes, keeping those
that shard no tensor dim on two axes. An op without a rule is replicated (and listed by
``autopar plan --verbose``).

Conventions the codegen relies on (and the equivalence tests prove):
- an op is computed on local shards with the same ATen call; shape arguments are rewritten to the
  local shape of the result;
- ``Partial`` results come only from linear maps (matmul contractions, sums, means, linear
  pointwise ops of partial inputs);
- an input marked ``None`` is only read for its dtype/device (``new_ones``) and needs no placement.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.ir.core import MeshSpec, Op, Placement, Program, R, Ref, Replicate, Shard, TensorType
from autopar.ir.layout import valid
from autopar.solver.sharding.experts import EXPERT_GATHER, expert_axes
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule, replicated, shards
from autopar.solver.sharding.rules import context as rules_context
from autopar.solver.sharding.rules import contractions as rules_contractions
from autopar.solver.sharding.rules import elementwise as rules_elementwise
from autopar.solver.sharding.rules import experts as rules_experts
from autopar.solver.sharding.rules import reductions as rules_reductions
from autopar.solver.sharding.rules import views as rules_views

# ATen target -> its one-axis rule
RULES: dict[str, Rule] = {
    **rules_elementwise.RULES,
    **rules_views.RULES,
    **rules_contractions.RULES,
    **rules_reductions.RULES,
    **rules_experts.RULES,
    **rules_context.RULES,  # after reductions: adds the query-sequence split to its attention rule
}
ATTENTION = "aten.scaled_dot_product_attention"
# Ops whose placement is fixed by their input's (pointwise and view ops): in the ILP they follow their
# producer instead of making a decision of their own.
FOLLOWERS = rules_elementwise.FOLLOWERS | rules_views.FOLLOWERS


@dataclass(frozen=True)
class Strategy:
    """Placements of every tensor input (None = any) and every result, one tuple per mesh axis each."""

    inputs: tuple[tuple[Placement, ...] | None, ...]
    outputs: tuple[tuple[Placement, ...], ...]

    def label(self) -> str:
        return ",".join("{" + ",".join(str(p) for p in o) + "}" for o in self.outputs)


def is_follower(target: str) -> bool:
    return target in FOLLOWERS


def chunk_counts(prog: Program) -> tuple[int, ...]:
    """Interleaved-shard chunk counts worth trying: the piece counts of equal splits in the graph."""
    counts = {1}
    for op in prog.ops:
        if op.target in ("aten.split.Tensor", "aten.split_with_sizes") and len(op.types) > 1:
            counts.add(len(op.types))
    return tuple(sorted(counts))


def _combine(per_axis: list[list[OneD]], nin: int, in_types, out_types, sizes) -> list[Strategy]:
    """Products of one-axis strategies whose every tensor divides evenly over the axes sharding it
    (a dim may be sharded over several axes: nested, the earlier axis outer)."""
    out: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        ins = tuple(None if any(c[0][i] is None for c in combo) else tuple(c[0][i] for c in combo) for i in range(nin))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(len(out_types)))
        ok_in = all(p is None or valid(p, t.shape, sizes) for p, t in zip(ins, in_types))
        if ok_in and all(valid(p, t.shape, sizes) for p, t in zip(outs, out_types)):
            out.append(Strategy(ins, outs))
    return out


def op_strategies(
    op: Op, types: dict[str, TensorType], mesh: MeshSpec, counts: tuple[int, ...]
) -> tuple[list[Strategy], bool]:
    """All strategies of ``op`` on ``mesh``, and whether a rule (not the fallback) produced them."""
    ins = [types[r.name] for r in op.input_refs()]
    rule = RULES.get(op.target)
    per_axis = []
    for _, n in mesh.axes:
        c = Ctx(op, ins, list(op.types), n, counts)
        per_axis.append(rule(c) if rule else [replicated(c)])
    found = _combine(per_axis, len(ins), ins, op.types, mesh.sizes)
    if op.target == EXPERT_GATHER:  # experts split over one axis at a time (passes/experts.py)
        found = [s for s in found if len(expert_axes(ins, s.inputs)) <= 1]
    if op.target == ATTENTION:  # ring attention on one axis alone (solver/sharding/rules/context.py)
        found = [s for s in found if rules_context.well_formed(ins, s.inputs)]
    return found, rule is not None


def value_strategies(t: TensorType, mesh: MeshSpec, counts: tuple[int, ...], shardable: bool = True) -> list[Strategy]:
    """Storage placements of a parameter, buffer or input: replicated, or sharded on any dim."""
    per_axis = []
    for _, n in mesh.axes:
        opts: list[OneD] = [((), (R,))]
        if shardable:
            for d, size in enumerate(t.shape):
                for k in shards(size, n, counts):
                    opts.append(((), (Shard(d, k),)))
        per_axis.append(opts)
    return _combine(per_axis, 0, [], [t], mesh.sizes)


def is_divergent(strategy: Strategy, axis: int) -> bool:
    """Whether ranks of ``axis`` compute different things (some input is not replicated there)."""
    return any(p is not None and not isinstance(p[axis], Replicate) for p in strategy.inputs)


def column_weight(op: Op, pos: int, types: dict[str, TensorType]) -> str | None:
    """The weight of ``op`` when it is a matmul reading input ``pos`` as its left operand in a form whose f the
    runtime fuses with it (``runtime/comm/column_linear.py``, Megatron's asynchronous TP backward): ``mm(x, w)`` or
    ``linear(x, w[, b])``, ``w`` a 2-D tensor other than ``x``; else None. Fused, f's all-reduce runs while the
    weight's gradient is computed, and on a backend whose collectives run beside compute it is hidden there."""
    kind = {"aten.mm": (2,), "aten.linear": (2, 3)}.get(op.target)
    if kind is None or pos != 0 or op.kwargs or len(op.args) not in kind:
        return None
    x, w, *bias = op.args
    if not isinstance(x, Ref) or not isinstance(w, Ref) or w.name == x.name or len(types[w.name].shape) != 2:
        return None
    if bias and (not isinstance(bias[0], Ref) or bias[0].name == x.name):
        return None
    return w.name


def partial_axes(strategy: Strategy, read: tuple[Placement, ...] | None) -> tuple[int, ...]:
    """The axes over which the gradient of an input the op reads at placements ``read`` is a partial sum (and
    needs Megatron's f): the read is replicated there and the op's ranks compute different things."""
    if read is None:
        return ()
    return tuple(a for a, p in enumerate(read) if isinstance(p, Replicate) and is_divergent(strategy, a))
