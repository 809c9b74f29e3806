"""The flow: the one ordered list of named passes from a captured model to the programs of every rank.

    capture -> lower -> shard -> insert-collectives -> split -> assign-stages -> prune-outputs
            -> insert-transfers -> codegen

``FLOW`` is the program that runs: ``plan_program`` gives it to one ``PassManager`` (``passes/manager.py``)
and runs it from ``lower`` (capture made the flow's input) through ``insert-transfers``. ``autopar.compile``,
``autopar plan``, the search's materialization and the pipeline runtime all plan through ``plan_program``
(``autopar ir`` runs the same list up to ``insert-collectives``); only ``codegen`` (one GraphModule per stage
of a rank, registered by the runtime) runs in the runtime, on the rank, through a PassManager over the same
list. A plan file's program takes the flow up at ``split``, or at ``prune-outputs`` when it brings as many
stages as the pipeline needs. Adding a pass is one ``register_pass`` (below, beside the others) and its
name in ``FLOW``; the manager numbers its dump by its place.

A mesh without the pipeline axis is a one-stage pipeline: ``split`` does nothing, every op
gets ``stage=0`` and ``insert-transfers`` adds no send/recv. Stages are assigned before the outputs are
pruned, so the forward program (every model output) and the training program (the loss) are cut at the
same places and share every parameter placement: ``prune-outputs`` forks the flow into the training program
and the forward one (variant ``forward``), and ``insert-transfers`` runs on both. The memory budget is per
device: ``shard`` solves the whole program, of which a device holds 1/pp, within pp budgets;
``assign-stages`` holds each rank's stages to one (``FlowOptions.stage_budget_bytes`` may set its own).

With ``dump_dir`` (or ``AUTOPAR_DUMP_DIR``) every pass writes its output, numbered in flow order by the
manager: ``01-capture.py`` (the exported graph), ``02-lower.ir`` ... ``08-insert-transfers.ir`` (the training
program; ``08-insert-transfers.forward.ir`` the forward one) and, from the runtime,
``09-codegen.rank{r}.{label}.py`` (label: ``forward{s}``, ``stage{s}``, a recompute part, ``loss_weight``).
The IR is verified after every pass. Without a dump, the shard pass's output is kept on disk by content
(``FlowOptions.cache``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autopar.errors import PipelineError, PlanError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import MeshSpec, Program
from autopar.ir.verify import verify
from autopar.passes.assign_stages import assign_stages_pass
from autopar.passes.capture import Captured, capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.lower import lower
from autopar.passes.manager import MAIN, PassManager, Variants, register_pass
from autopar.passes.pipeline_split import pipeline_split
from autopar.passes.prune import first_output_type, has_scalar_loss, prune_outputs
from autopar.passes.shard import ShardOptions, ShardResult, shard
from autopar.passes.transfers import insert_transfers
from autopar.schedule.generators import SCHEDULES
from autopar.schedule.placement import num_stages
from autopar.solver.stages.plan import StagePlan

FLOW: tuple[str, ...] = (
    "capture",
    "lower",
    "shard",
    "insert-collectives",
    "split",
    "assign-stages",
    "prune-outputs",
    "insert-transfers",
    "codegen",
)


def flow_index(name: str) -> int:
    """The number a pass's dump carries (``01`` for capture ... ``09`` for codegen)."""
    return FLOW.index(name) + 1


# -- what each name of FLOW runs (codegen: registered by the runtime, runtime/build/codegen.py) ---------------
ModelCall = tuple[torch.nn.Module, tuple, dict]  # capture's input: the model and one call's inputs


def _capture(call: ModelCall, options: Any) -> Captured:
    model, args, kwargs = call
    return capture(model, args, kwargs)


def exported_code(captured: Captured) -> str:
    """``capture``'s dump: the exported graph's Python."""
    return captured.exported.graph_module.code


def _shard(prog: Program, opts: ShardOptions | None) -> tuple[Program, ShardResult]:
    result = shard(prog, opts)
    return result.program, result


def _insert_collectives(prog: Program, options: Any) -> Program:
    return insert_collectives(prog)


def _insert_transfers(prog: Program, options: dict | None) -> Program:
    return insert_transfers(prog, **(options or {}))


def _prune(prog: Program, options: Any) -> Variants:
    """The fork: the training program (pruned to the loss, the main variant) and the forward one (every output,
    ``forward``); without a scalar loss first, the forward one alone."""
    train = {MAIN: prune_outputs(prog)} if has_scalar_loss(prog) else {}
    return Variants({**train, "forward": prog})


register_pass("capture", _capture, dump=exported_code, suffix=".py")
register_pass("lower", lower)  # options: the mesh (without the pipeline axis)
register_pass("shard", _shard, cached=True)
register_pass("insert-collectives", _insert_collectives)
register_pass("split", pipeline_split)
register_pass("assign-stages", assign_stages_pass)
register_pass("prune-outputs", _prune)
register_pass("insert-transfers", _insert_transfers)


@dataclass(frozen=True)
class FlowOptions:
    """How the flow plans, besides the mesh: the sharding options and the pipeline's shape."""

    shard: ShardOptions | None = None  # None: ShardOptions()
    chunks: int = 1  # Megatron's virtual chunks per pipeline rank
    waves: int | None = None  # Hanayo's waves
    microbatches: int = 1  # in flight: the stage balancer's activation memory
    # the stage balancer's memory budget per device; None: the shard budget (ShardOptions.budget_bytes), math.inf:
    # balance time alone (the search, whose own model, with recomputation and ZeRO, decided what fits)
    stage_budget_bytes: float | None = None
    stage_to_rank: tuple[int, ...] | None = None  # the schedule's placement, checked by assign-stages
    # the schedule that runs: the stage balancer prices its in-flight activations (ZB-H1/H2 have 1F1B's
    # shape, ZB-V/DualPipeV a wave's, but keep more); None or a schedule without its own count: the shape's
    schedule: str | None = None
    # with it, the schedule's stash points per rank (schedule/actions.stage_stash_points of its lists): the
    # balancer prices each rank's worst point, the output gradients a split backward keeps until W included
    stash_points: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] | None = None
    scatter_gather: bool = False  # Megatron: send 1/t of tp-replicated boundary tensors
    cache: bool = True  # reuse the shard pass's output solved before (on disk, keyed by content; not when dumping)


@dataclass(frozen=True)
class Planned:
    """Everything the flow made, pass by pass."""

    lowered: Program | None  # None when the flow started from a planned program (a plan file)
    sharded: Program  # after insert-collectives: the placements, no stages
    staged: Program  # after assign-stages: ``stage=`` on every op (what a pipelined plan file stores)
    forward: Program  # every model output kept, with send/recv at the stage boundaries
    train: Program | None  # pruned to the scalar loss; None when the first output is not one
    shard_result: ShardResult | None  # the solver's report; None from the cache or a plan file
    stage_plan: StagePlan | None  # None with one stage or stages given by a plan file
    split_seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass over the IR (shard ... insert-transfers)

    @property
    def num_stages(self) -> int:
        return int(self.forward.attrs["pipeline_stages"])

    def require_train(self) -> Program:
        """The training program, or the error saying why this model cannot be trained by ``train_step``."""
        if self.train is None:
            raise PipelineError(
                "training needs the model's first output to be the scalar training loss (a Hugging Face model "
                f"returns it first when given labels); the first output here is {first_output_type(self.sharded)}"
            )
        return self.train


def plan_program(
    captured: Captured,
    mesh: MeshSpec,
    options: FlowOptions | None = None,
    *,
    dump_dir: str | os.PathLike | None = None,
    sharded: Program | None = None,
) -> Planned:
    """Run the flow up to codegen on ``mesh`` (the whole mesh, with its pipeline axis if any): one
    ``PassManager`` over ``FLOW``, from ``lower`` on ``captured``.

    ``sharded``: a planned program (a plan file's) to start from instead of lowering and solving: the flow
    is taken up at ``split``, or at ``prune-outputs`` with the plan's own stages when it has as many as the
    pipeline needs.
    """
    opts = options or FlowOptions()
    pp = mesh.pipeline_size  # the stages are spread over the pp axis; a mesh without it has one stage
    pm = PassManager(FLOW, dump_dir, options=_pass_options(mesh, opts), cache=opts.cache)
    pm.dump("capture", captured)  # capture made the flow's input
    start, value = ("lower", captured) if sharded is None else _resume(sharded, mesh, pp, opts)
    out = pm.run(value, start=start, stop="insert-transfers")
    stage_plan, split_seconds = pm.info.get("assign-stages", (None, 0.0))
    return Planned(
        lowered=pm.outputs.get("lower"),
        sharded=pm.outputs.get("insert-collectives", sharded),
        staged=pm.outputs.get("assign-stages", value),
        forward=out["forward"],
        train=out.get(MAIN),
        shard_result=pm.info.get("shard"),
        stage_plan=stage_plan,
        split_seconds=split_seconds,
        timings={name: t for name, t in pm.timings.items() if name != "lower"},  # the passes over the IR
    )


def _pass_options(mesh: MeshSpec, opts: FlowOptions) -> dict[str, Any]:
    """Each pass's options: ``lower``'s mesh without the pipeline axis, the sharding options, the stages'."""
    shard_opts = opts.shard or ShardOptions()
    pp = mesh.pipeline_size
    whole = shard_opts
    if pp > 1 and shard_opts.budget_bytes is not None:
        # the budget is per device, and a device holds 1/pp of the program: the shard pass, which solves the
        # whole program before it is split, gets pp budgets; assign-stages holds each stage to the budget
        whole = replace(shard_opts, budget_bytes=shard_opts.budget_bytes * pp)
    stage_opts = {
        "pp": pp,
        "chunks": opts.chunks,
        "waves": opts.waves,
        "microbatches": opts.microbatches,
        "cluster": shard_opts.cluster,
        "budget_bytes": shard_opts.budget_bytes if opts.stage_budget_bytes is None else opts.stage_budget_bytes,
        "precision": "fp32" if shard_opts.setup.precision == "fp32" else "bf16",
        "compiled": shard_opts.setup.compiled,
    }
    if opts.schedule in SCHEDULES:  # a registered schedule prices its own in-flight counts
        stage_opts["schedule"] = opts.schedule
    if opts.stash_points is not None:
        stage_opts["stash_points"] = opts.stash_points
    if opts.stage_to_rank is not None:
        stage_opts["stage_to_rank"] = opts.stage_to_rank
    return {
        "lower": mesh.without_pipeline(),
        "shard": whole,
        "split": {"pp": pp},
        "assign-stages": stage_opts,
        "insert-transfers": {"scatter_gather": opts.scatter_gather},
    }


def _resume(sharded: Program, mesh: MeshSpec, pp: int, opts: FlowOptions) -> tuple[str, Program]:
    """Where the flow takes up a plan's program, and with what: its own stages when it has the right number
    (``prune-outputs``), else the program without them, split and balanced over ``pp`` ranks (``split``)."""
    inner = mesh.without_pipeline()
    if sharded.mesh != inner:
        raise PlanError(
            f"the planned program is for the mesh {sharded.mesh}, not {inner} ({mesh} without {PIPELINE_AXIS})"
        )
    stages = 1 if pp == 1 else num_stages(pp, opts.chunks, opts.waves)
    if _planned_stages(sharded) == stages:
        staged = _complete_stages(sharded)
        verify(staged)
        return "prune-outputs", staged
    return "split", _without_stages(sharded)


def _planned_stages(prog: Program) -> int | None:
    """The number of stages a program was already cut into (``stage=`` on its computing ops), if any."""
    staged = [op.attrs["stage"] for op in prog.ops if "stage" in op.attrs]
    computing = [op for op in prog.ops if "." in op.target]  # torch ops of any namespace, not collectives
    if not staged or any("stage" not in op.attrs for op in computing):
        return None
    return int(prog.attrs.get("pipeline_stages", max(staged) + 1))


def _complete_stages(prog: Program) -> Program:
    """Give ops without a stage (collectives inserted after a plan's stages were chosen) the stage of the
    next staged op in program order, their consumer: stages stay contiguous, and a value crossing to that
    stage is sent as it was produced and redistributed where it is used."""
    ops = list(prog.ops)
    last = max(op.attrs["stage"] for op in ops if "stage" in op.attrs)
    nxt = last
    for i in range(len(ops) - 1, -1, -1):
        if "stage" in ops[i].attrs:
            nxt = ops[i].attrs["stage"]
        else:
            ops[i] = ops[i].with_(attrs=dict(ops[i].attrs, stage=nxt))
    return prog.with_(ops=tuple(ops), attrs=dict(prog.attrs, pipeline_stages=last + 1))


def _without_stages(prog: Program) -> Program:
    """Drop a plan's stages (``stage=``, ``subgraph=``) when the pipeline needs a different number."""
    if not any("stage" in op.attrs or "subgraph" in op.attrs for op in prog.ops):
        return prog
    ops = tuple(
        op.with_(attrs={k: v for k, v in op.attrs.items() if k not in ("stage", "subgraph")}) for op in prog.ops
    )
    attrs = {k: v for k, v in prog.attrs.items() if k != "pipeline_stages"}
    return prog.with_(ops=ops, attrs=attrs)


__all__ = ["FLOW", "FlowOptions", "Planned", "flow_index", "plan_program"]
