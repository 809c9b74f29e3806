"""The planned programs of a captured model on a mesh, and one rank's ``ParallelModule`` of them: what
``autopar.compile`` does after capture, shared with the rank simulator's training (``autopar/check/simtrain.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from autopar.errors import PipelineError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import MeshSpec, Program
from autopar.passes.capture import Captured
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.shard import ShardOptions
from autopar.runtime.build.params import state_keys, value_source
from autopar.runtime.build.rng import DropoutRng
from autopar.runtime.comm.context import Comm
from autopar.runtime.module import ParallelModule, RuntimeOptions
from autopar.schedule.actions import Kind, Schedule, split_backwards, stage_stash_points
from autopar.schedule.placement import placement_shape


def stash_points_of(schedule: Schedule) -> tuple | None:
    """A split-backward schedule's stash points per rank (what the stage balancer prices its memory by, the
    W-kept gradients included); None for the others, whose in-flight counts the balancer knows."""
    if not any(a.kind is Kind.W for lst in schedule.actions for a in lst):
        return None
    return tuple(tuple(stage_stash_points(lst)) for lst in schedule.actions)


def pricing_options(
    options: ShardOptions | None, schedule: Schedule, sub_pipeline_tp: bool, torch_compile: bool = False
) -> ShardOptions | None:
    """``options`` with the training setup the runtime will run: Megatron's f is fused with its matmuls, and
    hidden behind their weight gradients on NCCL, unless ``schedule`` splits the backward (zero bubble) or
    the stages are sub-pipelined (``runtime/module.py``); then the ILP prices each f whole. ``torch_compile``:
    the programs run compiled (``TrainingSetup.compiled``: the stage balancer prices elementwise ops fused)."""
    if torch_compile and not sub_pipeline_tp:  # sub-pipelined training programs stay eager
        options = options or ShardOptions()
        options = dataclasses.replace(options, setup=dataclasses.replace(options.setup, compiled=True))
    if not (sub_pipeline_tp or any(split_backwards(actions) for actions in schedule.actions)):
        return options
    options = options or ShardOptions()
    return dataclasses.replace(options, setup=dataclasses.replace(options.setup, overlap_tp=False))


def plan_programs(
    captured: Captured,
    mesh: MeshSpec,
    schedule: Schedule,
    options: ShardOptions | None,
    sharded: Program | None = None,
    *,
    scatter_gather: bool = False,
    dump_dir: str | None = None,
    sub_pipeline_tp: bool = False,
    torch_compile: bool = False,
) -> tuple[Program, Program | None]:
    """The planned programs of ``captured`` on ``mesh`` (the whole mesh) by the flow
    (``passes/flow.py``): the forward program (every output) and the training program (pruned to the
    loss; ``None`` when the first output is not a scalar float), both cut into ``schedule``'s stages
    at the same places, with send/recv ops. Priced as the runtime will run them (``pricing_options``)."""
    chunks, waves = placement_shape(schedule.stage_to_rank, schedule.num_ranks)
    flow = FlowOptions(
        shard=pricing_options(options, schedule, sub_pipeline_tp, torch_compile),
        chunks=chunks,
        waves=waves,
        microbatches=schedule.num_microbatches,
        stage_to_rank=tuple(schedule.stage_to_rank),
        schedule=schedule.name,
        stash_points=stash_points_of(schedule),
        scatter_gather=scatter_gather,
    )
    planned = plan_program(captured, mesh, flow, dump_dir=dump_dir, sharded=sharded)
    if planned.num_stages != schedule.num_stages:
        raise PipelineError(
            f"the {schedule.name} schedule runs {schedule.num_stages} stages but the mesh {mesh} plans "
            f"{planned.num_stages}: a mesh without a {PIPELINE_AXIS} axis is one stage (use 1f1b, gpipe or scp there)"
        )
    if planned.num_stages > 1:
        planned.require_train()  # a pipeline exists to train: refuse a model without a scalar loss here
    return planned.forward, planned.train


@dataclass
class ModuleParts:
    """What every rank's module of one compile shares: the model, its capture and example inputs, the
    planned programs and schedule, and how the module runs."""

    model: torch.nn.Module
    captured: Captured
    example: tuple  # (args, kwargs) of one captured call
    forward: Program
    train: Program | None
    schedule: Schedule
    options: ShardOptions | None
    run: RuntimeOptions
    seed: int


def build_module(parts: ModuleParts, comm: Comm, device: torch.device, mesh, rng: DropoutRng | None) -> ParallelModule:
    """The ``ParallelModule`` of the rank ``comm`` describes (``mesh``: its DeviceMesh, or the simulator's
    stand-in; ``rng``: the keyed dropouts' state when the programs have any)."""
    get_value = value_source(parts.model, parts.captured, parts.seed)
    read = {v.name for v in parts.forward.inputs if v.kind != "input"}
    return ParallelModule(
        parts.forward,
        parts.train,
        parts.schedule,
        parts.captured.in_spec,
        parts.captured.out_spec,
        comm,
        get_value,
        device,
        (parts.options or ShardOptions()).setup,
        parts.run,
        mesh=mesh,
        rng=rng,
        state=state_keys(parts.model, read, get_value),
        leaves=tuple(i for i, x in enumerate(pytree.tree_leaves(parts.example)) if isinstance(x, torch.Tensor)),
    )


__all__ = ["ModuleParts", "build_module", "plan_programs"]
