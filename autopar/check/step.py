"""`autopar check`: one training step of a plan on simulated ranks in float64 against the unsharded model.

Three runs of the same step (forward, backward with fixed random output gradients; on a pipeline, the
loss's backward), all in float64 (``autopar/check/float64.py``):

1. the model itself, eagerly (the truth);
2. the planned program interpreted on whole tensors (collectives are identities on whole values, a
   stage's ``recv`` is what the previous stage sent): if it differs from 1, the captured graph is not
   the model (capture or lowering is wrong);
3. every rank's generated program on the rank simulator (runtime/sim/ranksim.py), through the same
   ``ParallelModule`` that training uses (input slicing, gradient sync; on a mesh with ``pp``, one
   microbatch through every stage by the executor, stage boundaries sent point to point): each op's
   per-rank results and gradients are recorded, assembled by their placements and compared with 2.

The first op whose output differs (in program order), or else the op whose backward first makes a
gradient differ (the latest value in program order with a wrong gradient: its consumers' backward
made it), is reported with its IR line, module path, source line and placements.

A model with dropout: the eager model draws its masks from torch's stream generator, autopar from its
keyed one (docs/runtime.md "Dropout"), so run 1 is left out and 2 draws autopar's keyed masks on one
device, the masks every mesh must reproduce; the report says so.
"""

from __future__ import annotations

import copy
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.build import ModuleParts, build_module, plan_programs
from autopar.check.float64 import Float64Mode, double, to_float64
from autopar.check.report import TOLERANCE, CheckReport, Finding, compare_ranks, relative_difference
from autopar.check.rules import call_op
from autopar.check.scale import scaled_copy
from autopar.errors import CheckError
from autopar.ir.core import COLLECTIVES, MeshSpec, Op, Program, Ref, Shard, resolve_target
from autopar.passes.batch_coupling import batch_couplings
from autopar.passes.capture import Captured, capture, flatten_inputs
from autopar.passes.dropout import has_keyed, is_keyed
from autopar.passes.experts import CAPACITY, EXPERT_OPS
from autopar.passes.flow import FlowOptions, plan_program
from autopar.plan import Plan
from autopar.runtime.build.precision import cast_floats, compute_copy, policy_of
from autopar.runtime.build.rng import DropoutRng, DropoutSite, keyed_dropout
from autopar.runtime.comm.all_to_all import capacity_grouped_mm
from autopar.runtime.module import RuntimeOptions
from autopar.runtime.sim.one_stage import one_stage_module
from autopar.runtime.sim.placement_values import distribute_grad
from autopar.runtime.sim.ranksim import SimWorld
from autopar.schedule.actions import B, F, Schedule
from autopar.schedule.comm_actions import insert_comm_actions
from autopar.schedule.generators import make_schedule

# compile(check=True) holds float64 copies of the model (the model, the whole program, every rank's
# shards) and every rank's activations in one process: at 10M parameters that is about 0.5 GB; a larger
# model is checked on a scaled-down copy (autopar/check/scale.py)
CHECK_MAX_PARAMS = 10_000_000


# ---------------------------------------------------------------------------------------------
# The three runs


SEED = 0  # the keyed dropouts' seed in the check (the whole program and every rank draw the same masks)


def _call(op: Op, env: dict[str, Any], rng: DropoutRng, sent: dict[tuple[int, int], deque]) -> Any:
    if op.target == "send":  # a stage boundary: the receiving stage's recv takes it (same order)
        sent[(int(op.attrs["stage"]), int(op.kwargs["peer_stage"]))].append(env[op.args[0].name])
    if op.target == "recv":
        return sent[(int(op.kwargs["peer_stage"]), int(op.attrs["stage"]))].popleft().clone()
    if op.target in COLLECTIVES or op.target in EXPERT_OPS:  # on whole values every collective is the identity
        # a copy, not a view: its gradient is its own, and an in-place op on it (div_) must not
        # change its input, which on the ranks is another tensor
        return env[op.args[0].name].clone()
    if is_keyed(op.target, op.args):  # the mask autopar draws on one device
        t = op.type
        site = DropoutSite.of(
            rng, op.attrs["rng"], float(op.args[1]), t.shape, op.attrs.get("batch_dim"), (), (), (), {}, "cpu"
        )
        return keyed_dropout(env[op.args[0].name], site)
    if op.attrs.get(CAPACITY) is not None:  # an experts kernel's grouped matmul dropping rows over capacity
        x, w, offs = (env[r.name] for r in op.input_refs())
        return capacity_grouped_mm(x, w, offs, kernel=resolve_target(op.target), rows=(), capacity=op.attrs[CAPACITY])
    return call_op(op.target, op.args, op.kwargs, env)


def interpret_whole(prog: Program, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of the program computed on whole tensors (gradients retained)."""
    env: dict[str, Any] = dict(values)
    rng = DropoutRng(SEED)
    sent: dict[tuple[int, int], deque] = defaultdict(deque)
    for op in prog.ops:
        out = _call(op, env, rng, sent)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        for r, t in zip(op.results, outs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.retain_grad()
            env[r] = t
    return env


class _Recorder(torch.nn.Module):
    """Runs a rank's GraphModule node by node and keeps each IR value's local result."""

    def __init__(self, gm: fx.GraphModule, prog: Program):
        super().__init__()
        self.gm = gm
        # the IR value each node computes, as codegen marks it (a matmul fused with its bias add has none)
        self.names: dict[fx.Node, str] = {
            node: node.meta["autopar_value"] for node in gm.graph.nodes if "autopar_value" in node.meta
        }
        self.values: dict[str, torch.Tensor] = {}
        self.outputs: tuple = ()

    def forward(self, *args):
        rec = self

        class Interp(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                name = rec.names.get(n)
                if name is not None and isinstance(out, torch.Tensor):
                    if out.requires_grad:
                        out.retain_grad()
                    rec.values[name] = out
                return out

        self.values = {}
        self.outputs = Interp(self.gm).run(*args)
        return self.outputs


@dataclass(frozen=True)
class Pipeline:
    """How a pipelined plan runs: its forward program (every output, stages and transfers), the whole mesh
    with its ``pp`` axis, and which pipeline rank holds each stage."""

    forward: Program
    mesh: MeshSpec
    stage_to_rank: tuple[int, ...]


def check_program(
    prog: Program,
    model: torch.nn.Module,
    captured: Captured,
    args: tuple,
    kwargs: dict,
    seed: int = 0,
    pipeline: Pipeline | None = None,
) -> CheckReport:
    """One step of ``prog`` (placements planned; on a ``pipeline``, its training program) on simulated
    ranks vs the whole program and vs ``model`` (float64 copies made here)."""
    keyed = has_keyed(prog.ops)
    prog = to_float64(prog)
    model = copy.deepcopy(model).to(torch.float64)
    args, kwargs = pytree.tree_map(double, (args, kwargs))
    mesh = prog.mesh
    names = dict(model.named_parameters(remove_duplicate=False))
    # the buffers as they are before the model's forward, which may update some in place (running statistics)
    names.update({k: b.clone() for k, b in model.named_buffers(remove_duplicate=False)})
    for k, v in captured.exported.constants.items():
        names.setdefault(k, double(v))
    flat = flatten_inputs(captured.in_spec, args, kwargs)
    flat_tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    g = torch.Generator().manual_seed(seed)
    outputs = [r for r in prog.outputs if isinstance(r, Ref)]
    types = prog.types()
    if pipeline is not None:  # the training program's loss, back-propagated from 1 as the executor does
        cots = {outputs[0].name: torch.ones((), dtype=torch.float64)}
    else:
        cots = {r.name: torch.randn(types[r.name].shape, generator=g, dtype=torch.float64) for r in outputs}
        cots = {k: v for k, v in cots.items() if types[k].is_float}

    # 1. the model (not with dropout: its masks come from torch's stream generator)
    model_out: list[torch.Tensor] = []
    if not keyed:
        with Float64Mode():
            model_out = [o for o in pytree.tree_leaves(model(*args, **kwargs)) if isinstance(o, torch.Tensor)]
        float_out = [(o, r) for o, r in zip(model_out, outputs) if r.name in cots and o.requires_grad]
        with Float64Mode():
            torch.autograd.backward([o for o, _ in float_out], [cots[r.name] for _, r in float_out])

    # 2. the program on whole tensors
    whole_in: dict[str, torch.Tensor] = {}
    for v, x in zip([v for v in prog.inputs if v.kind == "input"], flat_tensors):
        whole_in[v.name] = x
    for v in prog.inputs:
        if v.kind != "input":
            trained = v.kind == "param" and v.type.is_float and not v.attrs.get("frozen")
            whole_in[v.name] = names[v.name].detach().clone().requires_grad_(trained)
    ref = interpret_whole(prog, whole_in)
    ref_out = [ref[r.name] for r in outputs]
    diff = [(ref[r.name], cots[r.name]) for r in outputs if r.name in cots and ref[r.name].requires_grad]
    torch.autograd.backward([o for o, _ in diff], [c for _, c in diff])
    if keyed:
        model_out = [o.detach() for o in ref_out]  # the reference is autopar on one device
    for (o, r), m in zip([(ref[r.name], r) for r in outputs], model_out):
        err = relative_difference(o.detach(), m.detach())
        if err > TOLERANCE:
            return CheckReport(mesh, None, None, err, 0, Finding("capture", f"output %{r.name}", err))
    for v in prog.params if not keyed else ():
        p = names[v.name]
        if p.grad is not None and whole_in[v.name].grad is not None:
            err = relative_difference(whole_in[v.name].grad, p.grad)
            if err > TOLERANCE:
                return CheckReport(mesh, None, None, err, 0, Finding("capture", f"gradient of {v.name}", err))

    # 3. the ranks
    if pipeline is None:
        ranks = _one_stage_ranks(prog, captured, names, args, kwargs, cots, keyed)
    else:
        ranks = _pipeline_ranks(prog, pipeline, captured, model, args, kwargs, keyed)
    report = compare_ranks(prog, ref, ranks, captured, 0.0, ref_out, model_out, outputs)
    note = DROPOUT_NOTE if keyed else ""
    return replace(report, mesh=pipeline.mesh if pipeline is not None else mesh, program=prog, note=note)


DROPOUT_NOTE = (
    "the model has dropout: compared with autopar's keyed dropout on one device (the masks every mesh "
    "draws), not with the eager model, whose masks come from torch's stream generator (docs/runtime.md)"
)


def _one_stage_ranks(prog, captured, names, args, kwargs, cots, keyed) -> list:
    """Every rank's values and parameter gradients of one forward and backward of ``prog``."""
    world = SimWorld(prog.mesh)
    types = prog.types()

    def rank_step(rank: int) -> tuple[_Recorder, dict[str, torch.Tensor | None]]:
        comm = world.comm(rank)
        rng = DropoutRng(SEED) if keyed else None
        cm = one_stage_module(prog, captured.in_spec, captured.out_spec, comm, lambda n: names[n], rng=rng)
        gm = cm.stage_modules["forward0"]
        rec = _Recorder(gm, prog)
        cm.forward_runners[0].whole.module = rec
        cm(*args, **kwargs)
        coords = list(comm.coords.values())
        pairs = [
            (o, distribute_grad(cots[r.name], types[r.name].placements, prog.mesh, coords))
            for o, r in zip(rec.outputs, prog.outputs)
            if isinstance(r, Ref) and r.name in cots and o.requires_grad
        ]
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        grads = {v.name: gm.get_parameter(v.name).grad for v in prog.params if v.type.is_float}
        return rec, grads

    return world.run(rank_step)


def _pipeline_ranks(train, pipe: Pipeline, captured, model, args, kwargs, keyed) -> list:
    """One microbatch through every stage of the pipeline by the executor (``train_step``, no optimizer):
    each rank's recorded values and gradients, the pipeline ranks of each coordinate of the other axes
    merged (each stage's values live on one of them)."""
    world = SimWorld(pipe.mesh)
    sched = one_microbatch(pipe.stage_to_rank)
    run = RuntimeOptions(record=False)
    parts = ModuleParts(model, captured, (args, kwargs), to_float64(pipe.forward), train, sched, None, run, 0)

    def rank_step(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
        rng = DropoutRng(SEED) if keyed else None
        m = build_module(parts, world.comm(rank), torch.device("cpu"), world.device_mesh(rank), rng)
        recs = []
        for s, runner in m.train_runners.items():
            recs.append(_Recorder(runner.whole.module, m.stages[s].program))
            runner.whole.module = recs[-1]
        m.train_step(*args, **kwargs)
        grads = {n: t.grad for n, t in m.local_tensors().items() if isinstance(t, torch.nn.Parameter)}
        return {k: v for rec in recs for k, v in rec.values.items()}, grads

    merged: dict[tuple[int, ...], tuple[dict, dict]] = {}
    for rank, (values, grads) in enumerate(world.run(rank_step)):
        coords = world.coords(rank)
        held = merged.setdefault(tuple(coords[a] for a in train.mesh.names), ({}, {}))
        held[0].update(values)
        held[1].update(grads)
    return [(SimpleNamespace(values=v), g) for _, (v, g) in sorted(merged.items())]


def one_microbatch(stage_to_rank: tuple[int, ...]) -> Schedule:
    """One microbatch forward through every stage of ``stage_to_rank``'s placement and back."""
    ranks = max(stage_to_rank) + 1
    mine = [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(ranks)]
    compute = [[F(0, s) for s in stages] + [B(0, s) for s in reversed(stages)] for stages in mine]
    actions = insert_comm_actions(compute, stage_to_rank, 1)
    return Schedule(ranks, len(stage_to_rank), 1, tuple(stage_to_rank), actions, "check")


# ---------------------------------------------------------------------------------------------
# Entry points


def check_model(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    mesh: MeshSpec,
    plan: str | None = None,
    options: Any = None,
) -> CheckReport:
    """Plan ``model`` on ``mesh`` (or load ``plan``) and check one step on simulated ranks (with ``pp``:
    one microbatch through the 1F1B stages, boundaries included)."""

    _require_weights(model)
    sharded = None
    if plan is not None:
        loaded = Plan.load(plan)
        captured = _plan_capture(model, args, kwargs, loaded)
        sharded = loaded.program_for(captured, mesh)
    else:
        captured = capture(model, args, kwargs)
    if mesh.pipeline_size > 1:
        sched = make_schedule("1f1b", mesh.pipeline_size, 1)
        forward, train = plan_programs(captured, mesh, sched, options, sharded)
        report = check_planned(train, model, args, kwargs, Pipeline(forward, mesh, sched.stage_to_rank))
        report.couplings = tuple(c.describe() for c in batch_couplings(train) if c.certain)
        return report
    if sharded is None:
        sharded = plan_program(captured, mesh, FlowOptions(shard=options)).sharded
    return check_planned(sharded, model, args, kwargs)


def check_planned(
    prog: Program, model: torch.nn.Module, args: tuple, kwargs: dict, pipeline: Pipeline | None = None
) -> CheckReport:
    """Check one step of an already planned program of ``model`` (the float64 capture is made here); on a
    ``pipeline``, ``prog`` is its training program and ``args``/``kwargs`` one microbatch."""
    _require_weights(model)
    prog = _strip_pipeline(prog)
    cap64 = capture(copy.deepcopy(model).to(torch.float64), *pytree.tree_map(double, (args, kwargs)))
    return check_program(prog, model, cap64, args, kwargs, pipeline=pipeline)


def check_before_training(
    forward: Program,
    train: Program | None,
    model: torch.nn.Module,
    captured: Captured,
    args: tuple,
    kwargs: dict,
    mesh: MeshSpec,
    stage_to_rank: tuple[int, ...],
) -> CheckReport:
    """``autopar.compile(..., check=True)``: the check of the planned programs (``forward`` and, on a mesh
    with ``pp``, ``train`` cut at ``stage_to_rank``) on ``args``/``kwargs`` (one microbatch). A model of at
    most ``CHECK_MAX_PARAMS`` parameters with real weights is checked as it is; a larger one (or one on the
    meta device) on a scaled-down copy carrying the same ops and placements (``autopar/check/scale.py``).
    Raises ``CheckError`` with the report's summary (the first op that differs) when the ranks disagree."""
    pipeline = Pipeline(forward, mesh, stage_to_rank) if mesh.pipeline_size > 1 else None
    if pipeline is not None and train is None:
        raise CheckError("check=True on a pipeline checks the training step, and the model's first output is no loss")
    params = {id(p): p for p in model.parameters()}.values()
    scaled = ""
    if sum(p.numel() for p in params) > CHECK_MAX_PARAMS or any(p.device.type == "meta" for p in params):
        programs = [forward] if pipeline is None else [forward, train]
        model, args, kwargs, programs = scaled_copy(programs, model, captured, args, kwargs)  # type: ignore[arg-type]
        forward = programs[0]
        if pipeline is not None:
            train, pipeline = programs[1], Pipeline(forward, mesh, stage_to_rank)
        scaled = " (on a scaled-down copy of the model: the same ops and placements, smaller widths and inputs)"
    report = check_planned(train if pipeline is not None else forward, model, args, kwargs, pipeline)  # type: ignore[arg-type]
    if not report.agrees:
        raise CheckError(f"the plan does not train this model exactly (check=True{scaled}):\n{report.summary()}")
    return report


def _plan_capture(model: torch.nn.Module, args: tuple, kwargs: dict, plan: Plan) -> Captured:
    """``model`` captured as ``compile(plan=...)`` captures it: in the plan's compute dtype (its options' setup
    precision; ``autopar plan``'s default is the cluster's, bf16 on a GPU cluster), from a compute-dtype copy
    with the float inputs cast (``api._capture``), so the graph is the one the plan was made for and its
    fingerprint agrees. The check itself runs in float64 whatever the plan's dtype (``to_float64``)."""
    policy = policy_of(plan.options.get("setup", {}).get("precision", "fp32"))
    if policy is None:
        return capture(model, args, kwargs)
    inputs = cast_floats((args, kwargs), policy.param_dtype) if policy.cast_forward_inputs else (args, kwargs)
    return capture(compute_copy(model, policy.param_dtype), *inputs)


def _require_weights(model: torch.nn.Module) -> None:
    if any(p.device.type == "meta" for p in model.parameters()):
        raise CheckError("the model is on the meta device: check needs real weights (build it on the CPU)")


def _strip_pipeline(prog: Program) -> Program:
    """The sharded program of a pipelined plan is checked whole: stage cuts do not change values."""
    mesh = prog.mesh.without_pipeline()
    if mesh == prog.mesh:
        return prog
    raise CheckError(f"the plan's program is over mesh {prog.mesh}; check a plan whose program has no pp axis")


__all__ = [
    "CHECK_MAX_PARAMS",
    "CheckReport",
    "Finding",
    "check_before_training",
    "check_model",
    "check_planned",
    "check_program",
    "to_float64",
    "Shard",
]
