"""Check one sharding strategy of one op on simulated ranks against the unsharded op, in float64.

    prog, whole = one_op_program("aten.mm", (a, b), {}, MeshSpec((("tp", 2),)))
    for s in strategies_of(prog):
        problems = check_strategy(prog, whole, s)   # [] when the strategy computes the op

The op becomes a one-op program whose inputs carry the strategy's input placements and whose
result carries its output placements; codegen emits the rank program exactly as for a model (local
shape arguments, vocab-parallel lookups and losses), each simulated rank runs it forward and
backward on its local values (``runtime/sim/placement_values.distribute``), and the ranks' outputs and
input gradients are assembled and compared with the whole op's. Gradient conventions are
Megatron's: the gradient of a sharded value is its shard, of a partial value whole on every rank,
of a replicated value whole and equal on every rank of an axis where the op computes the same
thing, and a partial sum where it does not (``insert-collectives`` adds f there).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autopar.ir.core import (
    DEVICE,
    DTYPE_SHORT,
    MeshSpec,
    Op,
    Program,
    R,
    Ref,
    Shard,
    TensorType,
    Value,
    map_refs,
    resolve_target,
)
from autopar.ir.layout import valid
from autopar.passes.experts import insert_expert_dispatch
from autopar.runtime.build.codegen import codegen
from autopar.runtime.comm import all_to_all as experts
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm import context_attention, vocab_parallel
from autopar.runtime.comm.context import use_comm
from autopar.runtime.sim.placement_values import assemble, assemble_grad, distribute, distribute_grad
from autopar.runtime.sim.ranksim import SimWorld
from autopar.solver.sharding.strategies import Strategy, is_divergent, op_strategies

TOLERANCE = 1e-10  # relative to the largest magnitude of the reference, float64
# Ops whose output values are undefined (uninitialised memory): only shapes are compared.
UNDEFINED_VALUES = {"aten.empty_like", "aten.empty.memory_format", "aten.new_empty"}


def _to_ir(x: Any, inputs: list[tuple[str, torch.Tensor]]) -> Any:
    if isinstance(x, torch.Tensor):
        name = f"x{len(inputs)}"
        inputs.append((name, x))
        return Ref(name)
    if isinstance(x, torch.device):
        return DEVICE
    if isinstance(x, list):
        return [_to_ir(v, inputs) for v in x]
    if isinstance(x, tuple):
        return tuple(_to_ir(v, inputs) for v in x)
    return x


def one_op_program(target: str, args: tuple, kwargs: dict, mesh: MeshSpec) -> tuple[Program, dict[str, torch.Tensor]]:
    """A program of the single op ``target(*args, **kwargs)`` (tensors in the arguments become its
    inputs), every placement replicated, and the whole input tensors by name."""
    inputs: list[tuple[str, torch.Tensor]] = []
    ir_args, ir_kwargs = _to_ir(tuple(args), inputs), _to_ir(dict(kwargs), inputs)
    whole = dict(inputs)
    out = call_op(target, ir_args, ir_kwargs, whole)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    reps = (R,) * len(mesh.axes)
    types = tuple(TensorType(DTYPE_SHORT[t.dtype], tuple(t.shape), reps) for t in outs)
    op = Op(tuple(f"y{i}" for i in range(len(outs))), types, target, ir_args, ir_kwargs)
    values = tuple(Value(n, "input", TensorType(DTYPE_SHORT[t.dtype], tuple(t.shape), reps)) for n, t in inputs)
    prog = Program(mesh, values, (op,), tuple(Ref(r) for r in op.results))
    return prog, whole


def call_op(target: str, args: Any, kwargs: Any, env: dict[str, torch.Tensor]) -> Any:
    """Call the ATen op ``target`` with the IR arguments' refs taken from ``env`` (the device: CPU)."""

    def sub(x: Any) -> Any:
        x = map_refs(x, lambda r: env[r.name])
        if x is DEVICE:
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(sub(v) for v in x)
        return x

    return resolve_target(target)(*sub(args), **{k: sub(v) for k, v in kwargs.items()})


def strategies_of(prog: Program, counts: tuple[int, ...] = (1, 2)) -> list[Strategy]:
    """Every strategy the op's rule offers on the program's mesh (interleaved shards of ``counts``)."""
    op = prog.ops[0]
    more = (len(op.types),) if op.target.startswith("aten.split") and len(op.types) > 1 else ()
    return op_strategies(op, prog.types(), prog.mesh, tuple(sorted(set(counts + more))))[0]


def _any_placement(t: TensorType, mesh: MeshSpec) -> tuple:
    """For an input a strategy leaves free (read only for its dtype): a shard where one is valid."""
    for d in range(len(t.shape)):
        p = tuple(Shard(d) for _ in mesh.sizes)
        if valid(p, t.shape, mesh.sizes):
            return p
    return (R,) * len(mesh.sizes)


def place(prog: Program, strategy: Strategy) -> Program:
    """The one-op program with the strategy's placements on its inputs and results."""
    op = prog.ops[0]
    by_name = {r.name: p for r, p in zip(op.input_refs(), strategy.inputs)}
    values = tuple(
        v.__class__(v.name, v.kind, v.type.with_placements(by_name.get(v.name) or _any_placement(v.type, prog.mesh)))
        for v in prog.inputs
    )
    types = tuple(t.with_placements(p) for t, p in zip(op.types, strategy.outputs))
    return prog.with_(inputs=values, ops=(op.with_(types=types),))


def check_strategy(prog: Program, whole: dict[str, torch.Tensor], strategy: Strategy, seed: int = 0) -> list[str]:
    """What the strategy gets wrong on simulated ranks (outputs, input gradients, replicas that
    differ), each with its largest error; [] when it computes the op exactly."""
    placed = place(prog, strategy)
    op, mesh = placed.ops[0], placed.mesh
    world = SimWorld(mesh)
    g = torch.Generator().manual_seed(seed + 1)
    ref_in = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in whole.items()}
    ref_out = call_op(op.target, op.args, op.kwargs, ref_in)
    ref_outs = list(ref_out) if isinstance(ref_out, (list, tuple)) else [ref_out]
    cots = [torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point() else None for t in ref_outs]
    diff_outs = [(o, c) for o, c in zip(ref_outs, cots) if c is not None and o.requires_grad]
    if diff_outs:
        torch.autograd.backward([o for o, _ in diff_outs], [c for _, c in diff_outs])
    # an expert-parallel gather runs with its dispatch and combine, as insert-collectives writes them
    gm = codegen(insert_expert_dispatch(placed), world.coords(0), lambda name: whole[name])
    # the modules whose calls communicate (ring attention's send/recv among them)
    communicating = {coll.__name__, vocab_parallel.__name__, experts.__name__, context_attention.__name__}
    communicates = any(getattr(n.target, "__module__", "") in communicating for n in gm.graph.nodes)
    coords_of = [list(world.coords(r).values()) for r in range(world.size)]

    modes = _get_current_dispatch_mode_stack()  # the caller's (Float64Mode): thread-local, so re-entered per rank

    def rank_step(rank: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(copy.copy(m))
            return _rank_step(rank)

    def _rank_step(rank: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
        ins = {}
        for v in placed.inputs:
            local = distribute(whole[v.name], v.type.placements, mesh, coords_of[rank], seed)
            ins[v.name] = local.detach().requires_grad_(local.is_floating_point())
        with use_comm(world.comm(rank)):
            outs = list(gm(*(ins[v.name] for v in placed.inputs)))
            pairs = []
            for o, c, t in zip(outs, cots, op.types):
                if c is not None and o.requires_grad:
                    pairs.append((o, distribute_grad(c, t.placements, mesh, coords_of[rank])))
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        return [o.detach() for o in outs], {n: t.grad for n, t in ins.items()}

    results = world.run(rank_step) if communicates else [rank_step(r) for r in range(world.size)]
    problems: list[str] = []
    for i, (t, ref) in enumerate(zip(op.types, ref_outs)):
        got, spread = assemble([res[0][i] for res in results], t.placements, mesh)
        _compare(problems, f"output {i} {_fmt(t.placements)}", got, ref.detach(), spread, op.target)
    for v in placed.inputs:
        ref = ref_in[v.name].grad
        if ref is None:
            continue
        grads = [res[1][v.name] for res in results]
        if any(gr is None for gr in grads):
            problems.append(f"gradient of input {v.name} {_fmt(v.type.placements)}: missing on some ranks")
            continue
        divergent = frozenset(a for a in range(len(mesh.sizes)) if is_divergent(strategy, a))
        got, spread = assemble_grad(grads, v.type.placements, mesh, divergent)
        _compare(problems, f"gradient of input {v.name} {_fmt(v.type.placements)}", got, ref, spread, "")
    return problems


def _compare(problems: list[str], what: str, got: torch.Tensor, ref: torch.Tensor, spread: float, target: str) -> None:
    if tuple(got.shape) != tuple(ref.shape):
        problems.append(f"{what}: shape {list(got.shape)}, expected {list(ref.shape)}")
        return
    if target in UNDEFINED_VALUES:
        return
    scale = max(1.0, float(ref.abs().max())) if ref.numel() and ref.is_floating_point() else 1.0
    if not ref.is_floating_point():
        err = 0.0 if torch.equal(got.to(ref.dtype), ref) else float("inf")
    else:
        d = (got.to(torch.float64) - ref.to(torch.float64)).abs()
        err = float("inf") if torch.isnan(d).any() else (float(d.max()) if d.numel() else 0.0)
    if err > TOLERANCE * scale:
        problems.append(f"{what}: differs by {err:.3g} (scale {scale:.3g})")
    if spread > TOLERANCE * scale:
        problems.append(f"{what}: replicas differ by {spread:.3g}")


def _fmt(placements: Sequence) -> str:
    return "{" + ",".join(str(p) for p in placements) + "}"
