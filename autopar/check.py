"""`autopar check`: one training step of a plan on simulated ranks in float64 against the unsharded model.

Three runs of the same step (forward, backward with fixed random output gradients), all in float64:

1. the model itself, eagerly (the truth);
2. the planned program interpreted on whole tensors (collectives are identities on whole values):
   if it differs from 1, the captured graph is not the model (capture or lowering is wrong);
3. every rank's generated program on the rank simulator (runtime/ranksim.py), through the same
   ``ParallelModule`` that training uses (input slicing, gradient sync): each op's per-rank results
   and gradients are recorded, assembled by their placements and compared with 2.

The first op whose output differs (in program order), or else the op whose backward first makes a
gradient differ (the latest value in program order with a wrong gradient: its consumers' backward
made it), is reported with its IR line, module path, source line and placements.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.check_report import TOLERANCE, CheckReport, Finding, compare_ranks, relative_difference
from autopar.errors import CheckError
from autopar.ir.core import (
    COLLECTIVES,
    MeshSpec,
    Op,
    Program,
    Ref,
    Shard,
    TensorType,
    Value,
)
from autopar.ir.parser import parse
from autopar.passes.capture import Captured, capture, flatten_inputs
from autopar.passes.flow import FlowOptions, plan_program
from autopar.plan import Plan
from autopar.rulecheck import call_op
from autopar.runtime.codegen import _getitem
from autopar.runtime.one_stage import one_stage_module
from autopar.runtime.placement_values import distribute_grad
from autopar.runtime.ranksim import SimWorld

# compile(check=True) holds float64 copies of the model (the model, the whole program, every rank's
# shards) and every rank's activations in one process: at 10M parameters that is about 0.5 GB
CHECK_MAX_PARAMS = 10_000_000
_FLOATS = {"f32": "f64", "f16": "f64", "bf16": "f64"}
_TORCH_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# float64


def to_float64(prog: Program) -> Program:
    """The program with every floating tensor and dtype argument in float64 (same ops, placements)."""

    def ty(t: TensorType) -> TensorType:
        return TensorType(_FLOATS.get(t.dtype, t.dtype), t.shape, t.placements)

    def arg(x: Any) -> Any:
        if isinstance(x, torch.dtype):
            return torch.float64 if x in _TORCH_FLOATS else x
        if isinstance(x, (list, tuple)):
            return type(x)(arg(v) for v in x)
        if isinstance(x, dict):
            return {k: arg(v) for k, v in x.items()}
        return x

    inputs = tuple(Value(v.name, v.kind, ty(v.type), v.attrs) for v in prog.inputs)
    ops = tuple(
        op.with_(types=tuple(ty(t) for t in op.types), args=arg(op.args), kwargs=arg(op.kwargs)) for op in prog.ops
    )
    return prog.with_(inputs=inputs, ops=ops)


class _Float64Mode(TorchDispatchMode):
    """Runs the model with every cast to a lower float dtype made to float64 (HF's loss upcasts logits
    with ``.float()``, which on a float64 model would round them to float32)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {k: (torch.float64 if v in _TORCH_FLOATS else v) for k, v in (kwargs or {}).items()}
        args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in _TORCH_FLOATS else a for a in args)
        return func(*args, **kwargs)


def _double(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _TORCH_FLOATS:
        return x.detach().to(torch.float64)
    return x


# ---------------------------------------------------------------------------------------------
# The three runs


def _call(op: Op, env: dict[str, Any]) -> Any:
    if op.target in COLLECTIVES:  # on whole values every collective is the identity
        # a copy, not a view: its gradient is its own, and an in-place op on it (div_) must not
        # change its input, which on the ranks is another tensor
        return env[op.args[0].name].clone()
    return call_op(op.target, op.args, op.kwargs, env)


def interpret_whole(prog: Program, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of the program computed on whole tensors (gradients retained)."""
    env: dict[str, Any] = dict(values)
    for op in prog.ops:
        out = _call(op, env)
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
        self.names: dict[fx.Node, str] = {}
        ops = iter(prog.ops)
        calls: dict[fx.Node, Op] = {}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is _getitem and node.args[0] in calls:
                self.names[node] = calls[node.args[0]].results[node.args[1]]
                continue
            op = next(ops)
            calls[node] = op
            if len(op.results) == 1 and not op.target.startswith("aten.split") and op.target != "aten.unbind.int":
                self.names[node] = op.result
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


def check_program(
    prog: Program,
    model: torch.nn.Module,
    captured: Captured,
    args: tuple,
    kwargs: dict,
    seed: int = 0,
) -> CheckReport:
    """One step of ``prog`` (float64, placements planned) on simulated ranks vs the whole program
    and vs ``model`` (float64 copy made here)."""

    keyed = [op for op in prog.ops if "rng" in op.attrs]
    if keyed:
        raise CheckError(
            f"the program has {len(keyed)} dropout op(s) with p > 0 (first: %{keyed[0].result}); the check "
            "compares against the model run eagerly, whose dropout draws from torch's stream generator, so it "
            "would differ for that reason alone. Check a copy with dropout off (dropout probabilities 0 in the "
            "model's config, or a preset override such as resid_pdrop=0). autopar's dropout is mesh-invariant "
            "by construction (docs/runtime.md, tests/test_dropout.py)."
        )
    prog = to_float64(prog)
    model = copy.deepcopy(model).to(torch.float64)
    args, kwargs = pytree.tree_map(_double, (args, kwargs))
    mesh = prog.mesh
    names = dict(model.named_parameters(remove_duplicate=False))
    names.update(dict(model.named_buffers(remove_duplicate=False)))
    for k, v in captured.exported.constants.items():
        names.setdefault(k, _double(v))
    flat = flatten_inputs(captured.in_spec, args, kwargs)
    flat_tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    g = torch.Generator().manual_seed(seed)

    # 1. the model
    with _Float64Mode():
        model_out = [o for o in pytree.tree_leaves(model(*args, **kwargs)) if isinstance(o, torch.Tensor)]
    outputs = [r for r in prog.outputs if isinstance(r, Ref)]
    types = prog.types()
    cots = {r.name: torch.randn(types[r.name].shape, generator=g, dtype=torch.float64) for r in outputs}
    cots = {k: v for k, v in cots.items() if types[k].is_float}
    float_out = [(o, r) for o, r in zip(model_out, outputs) if r.name in cots and o.requires_grad]
    with _Float64Mode():
        torch.autograd.backward([o for o, _ in float_out], [cots[r.name] for _, r in float_out])

    # 2. the program on whole tensors
    whole_in: dict[str, torch.Tensor] = {}
    for v, x in zip([v for v in prog.inputs if v.kind == "input"], flat_tensors):
        whole_in[v.name] = x
    for v in prog.inputs:
        if v.kind != "input":
            whole_in[v.name] = names[v.name].detach().clone().requires_grad_(v.kind == "param" and v.type.is_float)
    ref = interpret_whole(prog, whole_in)
    ref_out = [ref[r.name] for r in outputs]
    diff = [(ref[r.name], cots[r.name]) for r in outputs if r.name in cots and ref[r.name].requires_grad]
    torch.autograd.backward([o for o, _ in diff], [c for _, c in diff])
    worst = 0.0
    for (o, r), m in zip([(ref[r.name], r) for r in outputs], model_out):
        err = relative_difference(o.detach(), m.detach())
        if err > TOLERANCE:
            return CheckReport(mesh, None, None, err, 0, Finding("capture", f"output %{r.name}", err))
    for v in prog.params:
        p = names[v.name]
        if p.grad is not None and whole_in[v.name].grad is not None:
            err = relative_difference(whole_in[v.name].grad, p.grad)
            if err > TOLERANCE:
                return CheckReport(mesh, None, None, err, 0, Finding("capture", f"gradient of {v.name}", err))

    # 3. the ranks
    world = SimWorld(mesh)

    def rank_step(rank: int) -> tuple[_Recorder, dict[str, torch.Tensor | None]]:
        comm = world.comm(rank)
        cm = one_stage_module(prog, captured.in_spec, captured.out_spec, comm, lambda n: names[n])
        gm = cm.stage_modules["forward0"]
        rec = _Recorder(gm, prog)
        cm.forward_runners[0].whole.module = rec
        cm(*args, **kwargs)
        coords = list(comm.coords.values())
        pairs = [
            (o, distribute_grad(cots[r.name], types[r.name].placements, mesh, coords))
            for o, r in zip(rec.outputs, prog.outputs)
            if isinstance(r, Ref) and r.name in cots and o.requires_grad
        ]
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        grads = {v.name: gm.get_parameter(v.name).grad for v in prog.params if v.type.is_float}
        return rec, grads

    ranks = world.run(rank_step)
    return replace(compare_ranks(prog, ref, ranks, captured, worst, ref_out, model_out, outputs), program=prog)


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
    """Plan ``model`` on ``mesh`` (or load ``plan``) and check one step on simulated ranks."""

    _require_weights(model)
    captured = capture(model, args, kwargs)
    inner = mesh.without_pipeline()
    if plan is not None:
        loaded = Plan.load(plan)
        loaded.check(captured, mesh)
        prog = parse(loaded.program)
    else:
        prog = plan_program(captured, inner, FlowOptions(shard=options)).sharded
    return check_planned(prog, model, args, kwargs)


def check_planned(prog: Program, model: torch.nn.Module, args: tuple, kwargs: dict) -> CheckReport:
    """Check one step of an already planned program of ``model`` (the float64 capture is made here)."""
    _require_weights(model)
    prog = _strip_pipeline(prog)
    cap64 = capture(copy.deepcopy(model).to(torch.float64), *pytree.tree_map(_double, (args, kwargs)))
    return check_program(prog, model, cap64, args, kwargs)


def check_before_training(prog: Program, model: torch.nn.Module, args: tuple, kwargs: dict) -> CheckReport:
    """``autopar.compile(..., check=True)``: the check of the real-size planned program, refused with
    the way to check a scaled-down copy when the model is larger than ``CHECK_MAX_PARAMS``; raises
    ``CheckError`` with the report's summary (the first op that differs) when the ranks disagree."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if n > CHECK_MAX_PARAMS:
        mesh = ",".join(f"{a}={k}" for a, k in prog.mesh.axes)
        raise CheckError(
            f"check=True runs one float64 step of every rank of the plan in this process and takes models of at "
            f"most {CHECK_MAX_PARAMS:,} parameters; this one has {n:,}. Check a scaled-down copy of it instead, on "
            f"the same mesh: `autopar check PRESET:overrides --mesh {mesh}` (e.g. "
            f"gpt3-175b:n_layer=2,n_embd=256), or `autopar check file.py:fn --mesh {mesh}` with fn "
            "returning a small configuration of your model and its inputs; then compile with check=False"
        )
    report = check_planned(prog, model, args, kwargs)
    if not report.agrees:
        raise CheckError(f"the plan does not train this model exactly (check=True):\n{report.summary()}")
    return report


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
