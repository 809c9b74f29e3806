"""Baseline strategies priced by the same cost model: Megatron, data parallel, ZeRO-2/3, Alpa's objective.

Each baseline fixes how parameters and inputs are stored and lets the ILP (objective: least
communication) place everything else, so it gets the cheapest execution of that storage choice:

- ``megatron``: on axes named ``tp*``, Megatron-LM's hand strategy (Shoeybi et al. 2019): the
  QKV and MLP-up projections column-parallel (output features split; a fused QKV per head), the
  attention-output and MLP-down projections row-parallel (input features split), embeddings and
  the output layer vocabulary-parallel, norms and other weights replicated; every other axis data
  parallel (batch split, weights replicated).
- ``dp``: every axis data parallel; ``zero2`` / ``zero3``: the same with ZeRO stage 2 / 3 over all
  axes (gradients and optimizer states, plus weights for stage 3, sharded over data parallel).
- ``comm``: no constraint, least communication time within the budget (Alpa's objective).

Embedding tables are split by vocabulary on the tp axes, as Megatron's VocabParallelEmbedding.

A baseline fixes a placement (``Exactly``) for every parameter and input. Where one of them is not
valid for its value's shape on the mesh (a sharded dim that does not divide over the devices of the
axes sharding it, e.g. a batch of 2 on 4 data-parallel devices), the baseline does not exist on that
mesh: ``run_baseline`` raises ``BaselineUnavailableError`` naming that dim, and ``run_baselines``
reports it as ``Unavailable`` beside the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from autopar.errors import BaselineUnavailableError, InfeasibleError
from autopar.ir.axes import is_tensor_axis
from autopar.ir.core import MeshSpec, Placement, Program, R, Shard, Value
from autopar.ir.layout import deals_rows, valid
from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.megatron_roles import megatron_layout
from autopar.solver.sharding.options import ShardOptions
from autopar.solver.sharding.rules.elementwise import SOURCES
from autopar.solver.sharding.solve import Layout, Sharding, solve_with_layout

BASELINES = ("megatron", "dp", "zero2", "zero3", "comm")


def megatron_constraints(prog: Program) -> dict:
    names = prog.mesh.names
    tp = [i for i, n in enumerate(names) if is_tensor_axis(n)]
    layout = megatron_layout(prog)
    out: dict = {}
    for v in prog.inputs:
        if v.kind == "param":
            want = [R] * len(names)
            if v.name in layout:
                _, dim, chunks = layout[v.name]
                for i in tp:
                    want[i] = Shard(dim, chunks)
            # a weight too small to split over the tp axes stays replicated, as Megatron's would
            target = tuple(want) if valid(tuple(want), v.type.shape, prog.mesh.sizes) else (R,) * len(names)
            out[v.name] = _exactly(target)
        elif v.kind == "input":
            out[v.name] = _batch_on(tuple(i for i in range(len(names)) if i not in tp), len(names))
    return out


@dataclass(frozen=True)
class Exactly:
    """A ``ShardOptions.constrain`` predicate admitting one placement per mesh axis (``None``: any placement
    on that axis), kept as data so that a baseline can say why it cannot run where it is not valid."""

    want: tuple[Placement | None, ...]

    def __post_init__(self) -> None:  # the axes it fixes (the solver calls it once per candidate placement)
        object.__setattr__(self, "_fixed", tuple((i, w) for i, w in enumerate(self.want) if w is not None))

    def __call__(self, p: tuple[Placement, ...]) -> bool:
        for i, w in self._fixed:
            if p[i] != w:
                return False
        return True

    @property
    def strictest(self) -> tuple[Placement, ...]:
        """``want`` with ``R`` for ``None``: valid exactly when some placement the predicate admits is."""
        return tuple(R if w is None else w for w in self.want)


@dataclass(frozen=True)
class Unavailable:
    """A baseline that does not exist on this mesh, and why, in the user's terms."""

    reason: str


def _exactly(want: tuple[Placement, ...]) -> Exactly:
    return Exactly(tuple(want))


def _batch_on(axes: tuple[int, ...], n: int) -> Exactly:
    return Exactly(tuple(Shard(0) if i in axes else R for i in range(n)))


def data_parallel_constraints(prog: Program, axes: Iterable[str] | None = None, activations: bool = False) -> dict:
    """``ShardOptions.constrain`` entries that make the mesh ``axes`` (default: every axis) data parallel:
    parameters and buffers replicated on them (ZeRO shards their states, which is memory accounting, not
    placement), user inputs split on dim 0, the batch. With ``activations`` also every float activation
    that carries the batch: one a gradient flows through, not computed from weights alone, whose dim 0
    divides over the axes. Without that a model too small for its compute to matter would be computed
    whole on every data-parallel rank (the cheapest plan in communication). The other axes are left to
    the ILP (``None`` in each ``Exactly``), and so are axes of size 1 (nothing to split). The ``dp``
    baseline is every axis; the search's plans (``ShardOptions.data_parallel``) are the ``dp*`` axes."""
    names = prog.mesh.names
    on = {n for n, s in prog.mesh.axes if s > 1 and (axes is None or n in axes)}
    if not on:
        return {}

    def exactly(p: Placement) -> Exactly:
        return Exactly(tuple(p if n in on else None for n in names))

    size = math.prod(s for n, s in zip(names, prog.mesh.sizes) if n in on)
    out: dict = {}
    for v in prog.inputs:
        if v.kind in ("param", "buffer"):
            out[v.name] = exactly(R)
        elif v.kind == "input" and v.type.shape:
            out[v.name] = exactly(Shard(0))
    if activations:
        weights = {v.name for v in prog.inputs if v.kind in ("param", "buffer")}
        grad = prog.requires_grad()
        for op in prog.ops:
            refs = op.input_refs()
            if refs and all(r.name in weights for r in refs):
                weights.update(op.results)
                continue
            if op.target in SOURCES:  # a fresh tensor (DeepSeek-V3's q.new_empty), whole on every rank: its rows
                continue  # are the slice writes' that fill it, which are constrained
            for r, t in zip(op.results, op.types):
                if r in grad and t.shape and t.shape[0] >= size and t.shape[0] % size == 0:
                    out[r] = exactly(Shard(0))
    return out


@dataclass(frozen=True)
class DealtRows:
    """A ``ShardOptions.constrain`` predicate: dim 0 split over the mesh axes at the indices ``on`` as a
    local batch deals its rows (``ir.layout.deals_rows``)."""

    on: tuple[int, ...]

    def __call__(self, p: tuple[Placement, ...]) -> bool:
        return deals_rows(p, self.on)


def local_batch_constraints(prog: Program, axes: Iterable[str]) -> dict:
    """``ShardOptions.constrain`` entries for a local batch (``ShardOptions.batch="local"``): each user input
    split on dim 0 over the mesh ``axes`` (the ``dp*`` axes) as its rows are dealt, which is how the ranks
    are given it. An input whose dim 0 does not divide over them is left free (the runtime refuses a local
    batch of it, saying so)."""
    on = tuple(i for i, (n, s) in enumerate(prog.mesh.axes) if s > 1 and n in set(axes))
    size = math.prod(prog.mesh.sizes[i] for i in on)
    if not on:
        return {}
    return {
        v.name: DealtRows(on) for v in prog.inputs if v.kind == "input" and v.type.shape and v.type.shape[0] % size == 0
    }


def unavailable_reason(prog: Program, constrain: dict) -> str | None:
    """Why the fixed placements in ``constrain`` cannot be laid out on the program's mesh (None if they can):
    the first value whose required placement splits a dim that does not divide over the axes splitting it."""
    for v in prog.inputs:
        c = constrain.get(v.name)
        if isinstance(c, Exactly) and not valid(c.strictest, v.type.shape, prog.mesh.sizes):
            return _why_invalid(v, c.strictest, prog.mesh)
    return None


def _why_invalid(v: Value, want: tuple[Placement, ...], mesh: MeshSpec) -> str:
    shape = v.type.shape
    dims: dict[int, list[int]] = {}
    for i, p in enumerate(want):
        if isinstance(p, Shard):
            dims.setdefault(p.dim, []).append(i)
    for d, axes in dims.items():
        what = f"batch {shape[0]}" if v.kind == "input" and d == 0 else f"dim {d} of {v.kind} {v.name}"
        on = ",".join(f"{mesh.names[i]}={mesh.sizes[i]}" for i in axes)
        if d >= len(shape):
            return f"{v.kind} {v.name} has no dim {d} to split over {on}"
        pieces = math.prod(mesh.sizes[i] for i in axes) * max(want[i].chunks for i in axes)
        if shape[d] % pieces:
            size = "" if what.startswith("batch") else f" (size {shape[d]})"
            return f"{what}{size} does not divide over {pieces} devices ({on})"
    return f"{v.kind} {v.name} {v.type} cannot be laid out as {','.join(map(str, want))} on mesh {mesh}"


def megatron_options(prog: Program, opts: ShardOptions | None = None) -> ShardOptions:
    """``opts`` (default: the time objective) with Megatron's layout fixed on ``prog``'s tensor axes, each weight
    shard computed where it is stored (``pin_constrained``)."""
    return replace(opts or ShardOptions(), constrain=megatron_constraints(prog), pin_constrained=True)


def run_baseline(prog: Program, name: str, opts: ShardOptions, layouts: list[Layout] | None = None) -> Sharding:
    """Solve the program under a baseline's constraints with the same cost model as autopar. Raises
    ``BaselineUnavailableError`` where the baseline's layout cannot exist on the mesh. ``layouts``: the
    problem layouts (``solve.Layout``) of the baselines solved before on ``prog``, which this one joins: the
    dp, zero2 and zero3 baselines differ only in the ZeRO stage, a price, and start from one."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    layouts = [] if layouts is None else layouts
    if name == "comm":
        return _solve(prog, replace(opts, objective="comm"), layouts)
    run = replace(opts, objective="comm", budget_bytes=None)
    if name == "megatron":
        run = megatron_options(prog, run)
    else:
        run = replace(run, constrain=data_parallel_constraints(prog))
        if name in ("zero2", "zero3"):
            run = replace(run, setup=replace(opts.setup, zero=int(name[-1]), zero_axes=prog.mesh.names))
    reason = unavailable_reason(prog, run.constrain)
    if reason is not None:
        raise BaselineUnavailableError(f"the {name} baseline cannot run on mesh {prog.mesh}: {reason}", reason)
    return _solve(prog, run, layouts)


def _solve(prog: Program, opts: ShardOptions, layouts: list[Layout]) -> Sharding:
    """``solve_sharding`` from the layout in ``layouts`` that fits ``opts``, else from a new one, kept there."""
    layout = next((x for x in layouts if x.fits(opts)), None)
    solved, made = solve_with_layout(prog, opts, layout)
    if layout is None:
        layouts.append(made)
    return solved


def run_baselines(prog: Program, opts: ShardOptions, names=BASELINES) -> dict[str, Sharding | Unavailable]:
    """Every named baseline; one that cannot run on this mesh (its layout impossible, or no strategy within
    the budget for ``comm``) is an ``Unavailable`` with the reason, so the others and autopar's plan remain."""
    out: dict[str, Sharding | Unavailable] = {}
    layouts: list[Layout] = []
    for n in names:
        try:
            out[n] = run_baseline(prog, n, opts, layouts)
        except BaselineUnavailableError as e:
            out[n] = Unavailable(e.reason)
        except InfeasibleError as e:
            out[n] = Unavailable(str(e))
    return out


__all__ = [
    "BASELINES",
    "Exactly",
    "Unavailable",
    "unavailable_reason",
    "data_parallel_constraints",
    "megatron_layout",
    "megatron_constraints",
    "megatron_options",
    "run_baseline",
    "run_baselines",
    "TrainingSetup",
]
