"""The flow: the one ordered list of named passes from a captured model to the programs of every rank.

    capture -> lower -> shard -> insert-collectives -> split -> assign-stages -> prune-outputs
            -> insert-transfers -> codegen

``autopar.compile``, ``autopar plan``, the search's materialization and the pipeline runtime all run it
through ``plan_program``; only ``codegen`` (one GraphModule per stage of a rank) runs in the runtime, on
the rank. A mesh without the pipeline axis is a one-stage pipeline: ``split`` does nothing, every op
gets ``stage=0`` and ``insert-transfers`` adds no send/recv. Stages are assigned before the outputs are
pruned, so the forward program (every model output) and the training program (the loss) are cut at the
same places and share every parameter placement. The memory budget is per device: ``shard`` solves the
whole program, of which a device holds 1/pp, within pp budgets; ``assign-stages`` holds each rank's stages to one
(``FlowOptions.stage_budget_bytes`` may set its own).

With ``dump_dir`` (or ``AUTOPAR_DUMP_DIR``) every pass writes its output, numbered in flow order:
``01-capture.py`` (the exported graph), ``02-lower.ir`` ... ``08-insert-transfers.ir`` (the training
program; ``08-insert-transfers.forward.ir`` the forward one) and, from the runtime,
``09-codegen.rank{r}.stage{s}.py``. The IR is verified after every pass.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from autopar.errors import PipelineError, PlanError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import MeshSpec, Program
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.passes.capture import Captured
from autopar.passes.lower import lower
from autopar.passes.manager import PassManager
from autopar.passes.shard import ShardOptions, ShardResult
from autopar.passes.split_cache import cache_dir, code_fingerprint, write_atomic
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
    stage_to_rank: tuple[int, ...] | None = None  # the schedule's placement, checked against the stage plan
    # the schedule that runs: the stage balancer prices its in-flight activations (ZB-H1/H2 have 1F1B's
    # shape, ZB-V/DualPipeV a wave's, but keep more); None or a schedule without its own count: the shape's
    schedule: str | None = None
    # with it, the schedule's stash points per rank (runtime/actions.stage_stash_points of its lists): the
    # balancer prices each rank's worst point, the output gradients a split backward keeps until W included
    stash_points: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] | None = None
    scatter_gather: bool = False  # Megatron: send 1/t of tp-replicated boundary tensors
    cache: bool = True  # reuse a sharded program solved before (on disk, keyed by content)


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
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return int(self.forward.attrs["pipeline_stages"])

    def require_train(self) -> Program:
        """The training program, or the error saying why this model cannot be trained by ``train_step``."""
        if self.train is None:
            raise PipelineError(
                "training needs the model's first output to be the scalar training loss (a Hugging Face model "
                f"returns it first when given labels); the first output here is {_first_output_type(self.sharded)}"
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
    """Run the flow up to codegen on ``mesh`` (the whole mesh, with its pipeline axis if any).

    ``sharded``: a planned program (a plan file's) to start from instead of lowering and solving; its
    stages are kept when it has as many as the pipeline needs.
    """
    opts = options or FlowOptions()
    shard_opts = opts.shard or ShardOptions()
    pp = mesh.pipeline_size  # the stages are spread over the pp axis; a mesh without it has one stage
    whole = shard_opts
    if pp > 1 and shard_opts.budget_bytes is not None:
        # the budget is per device, and a device holds 1/pp of the program: the shard pass, which solves the
        # whole program before it is split, gets pp budgets; assign-stages holds each stage to the budget
        whole = replace(shard_opts, budget_bytes=shard_opts.budget_bytes * pp)
    inner = mesh.without_pipeline()
    dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR") or None
    if dump_dir:
        _write(dump_dir, f"{flow_index('capture'):02d}-capture.py", captured.exported.graph_module.code)
    timings: dict[str, float] = {}
    lowered = None
    result = None
    if sharded is None:
        lowered = lower(captured, inner)
        verify(lowered)
        if dump_dir:
            _write(dump_dir, f"{flow_index('lower'):02d}-lower.ir", print_program(lowered))
        sharded, result = _shard(lowered, whole, opts.cache and not dump_dir, dump_dir, timings)
    elif sharded.mesh != inner:
        raise PlanError(
            f"the planned program is for the mesh {sharded.mesh}, not {inner} ({mesh} without {PIPELINE_AXIS})"
        )
    staged, stage_plan, split_seconds = _stage(sharded, pp, opts, shard_opts, dump_dir, timings)
    pm = PassManager(["prune-outputs"], dump_dir=dump_dir, timings=timings)
    train = pm.run(staged, flow_index("prune-outputs") - 1) if _is_loss(staged) else None
    transfers = {"scatter_gather": opts.scatter_gather}
    n = flow_index("insert-transfers") - 1
    forward = PassManager(["insert-transfers"], None, options={"insert-transfers": transfers}).run(staged, n)
    if dump_dir:
        _write(dump_dir, f"{n + 1:02d}-insert-transfers.forward.ir", print_program(forward))
    if train is not None:
        pm = PassManager(["insert-transfers"], dump_dir, options={"insert-transfers": transfers}, timings=timings)
        train = pm.run(train, n)
    return Planned(lowered, sharded, staged, forward, train, result, stage_plan, split_seconds, timings)


def _shard(
    lowered: Program, opts: ShardOptions, cache: bool, dump_dir, timings: dict[str, float]
) -> tuple[Program, ShardResult | None]:
    """``shard`` and ``insert-collectives``; the result is kept on disk by content (lowered IR, options,
    the planning code's fingerprint)."""
    names = ["shard", "insert-collectives"]
    text = print_program(lowered) + repr(opts) + ",".join(names) + code_fingerprint()
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    folder = cache_dir() if cache else None
    path = folder / f"{key}.ir" if folder else None
    if path is not None and path.exists():
        return parse(path.read_text()), None
    pm = PassManager(names, dump_dir, options={"shard": opts}, timings=timings)
    out = pm.run(lowered, flow_index("shard") - 1)
    if path is not None:
        write_atomic(path, print_program(out))
    return out, pm.info.get("shard")


def _stage(
    sharded: Program, pp: int, opts: FlowOptions, shard_opts: ShardOptions, dump_dir, timings: dict[str, float]
) -> tuple[Program, StagePlan | None, float]:
    """``split`` and ``assign-stages``: a plan's own stages when it has the right number, else Merak's split
    balanced over ``pp`` ranks (one stage without a pipeline)."""
    stages = 1 if pp == 1 else num_stages(pp, opts.chunks, opts.waves)
    planned = _planned_stages(sharded)
    if planned is not None and planned == stages:
        staged = _complete_stages(sharded)
        verify(staged)
        return staged, None, 0.0
    precision = "fp32" if shard_opts.setup.precision == "fp32" else "bf16"
    stage_opts = {
        "pp": pp,
        "chunks": opts.chunks,
        "waves": opts.waves,
        "microbatches": opts.microbatches,
        "cluster": shard_opts.cluster,
        "budget_bytes": shard_opts.budget_bytes if opts.stage_budget_bytes is None else opts.stage_budget_bytes,
        "precision": precision,
    }
    if opts.schedule in SCHEDULES and opts.schedule != "none":
        stage_opts["schedule"] = opts.schedule
    if opts.stash_points is not None:
        stage_opts["stash_points"] = opts.stash_points
    pass_opts = {"split": {"pp": pp}, "assign-stages": stage_opts}
    pm = PassManager(["split", "assign-stages"], dump_dir, options=pass_opts, timings=timings)
    staged = pm.run(_without_stages(sharded), flow_index("split") - 1)
    stage_plan, split_seconds = pm.info.get("assign-stages", (None, 0.0))
    if stage_plan is not None and opts.stage_to_rank is not None:
        if tuple(stage_plan.stage_to_rank) != tuple(opts.stage_to_rank):
            raise PipelineError(
                f"the schedule places stages on ranks {list(opts.stage_to_rank)} but the stage plan on "
                f"{list(stage_plan.stage_to_rank)}"
            )
    return staged, stage_plan, split_seconds


def _is_loss(prog: Program) -> bool:
    t = _first_output_type(prog)
    return t is not None and t.shape == () and t.is_float


def _first_output_type(prog: Program):
    if not prog.outputs:
        return None
    return prog.types().get(getattr(prog.outputs[0], "name", ""))


def _planned_stages(prog: Program) -> int | None:
    """The number of stages a program was already cut into (``stage=`` on its computing ops), if any."""
    staged = [op.attrs["stage"] for op in prog.ops if "stage" in op.attrs]
    computing = [op for op in prog.ops if op.target.startswith("aten.")]
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


def _write(dump_dir: str | os.PathLike, name: str, text: str) -> None:
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)


__all__ = ["FLOW", "FlowOptions", "Planned", "flow_index", "plan_program"]
