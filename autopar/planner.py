"""Plan a model on a mesh offline: capture on meta, solve the strategy ILP and the baselines, make a Plan."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from autopar.build import pricing_options, stash_points_of
from autopar.errors import BatchCouplingError, CaptureError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import MeshSpec
from autopar.ir.printer import print_program
from autopar.models.resolve import build
from autopar.passes.batch_coupling import TAIL_SCHEDULES, microbatching_refusal
from autopar.passes.capture import Captured, capture
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.lower import lower
from autopar.passes.repeat_layers import planning_cut
from autopar.passes.shard import ShardOptions, ShardResult
from autopar.plan import Plan, fingerprint
from autopar.runtime.build.precision import for_capture
from autopar.runtime.call.batch import split_batch
from autopar.schedule.generators import make_schedule, splits_backward
from autopar.schedule.placement import placement_shape
from autopar.solver.sharding.baselines import BASELINES, Unavailable, run_baselines
from autopar.solver.sharding.buckets import grad_buckets
from autopar.solver.sharding.cost import CostModel, TrainingSetup


@dataclass
class PlanReport:
    plan: Plan
    result: ShardResult
    baselines: dict[str, ShardResult | Unavailable]  # Unavailable: the baseline cannot run on this mesh, and why
    capture_seconds: float


def options_dict(opts: ShardOptions) -> dict:
    return {
        "objective": opts.objective,
        "alpha": opts.alpha,
        "budget_bytes": opts.budget_bytes,
        "time_limit": opts.time_limit,
        "backend": opts.backend,
        "setup": dataclasses.asdict(opts.setup),
        "batch": opts.batch,
        "roles": opts.roles,
        "data_parallel": opts.data_parallel,
        "context_attention": opts.context_attention,
        "capacity_factor": opts.capacity_factor,
    }


def options_from_dict(d: dict, cluster=None) -> ShardOptions:
    setup = d.get("setup", {})
    if setup.get("zero_axes") is not None:
        setup = dict(setup, zero_axes=tuple(setup["zero_axes"]))
    return ShardOptions(
        objective=d.get("objective", "memory"),  # plans written before "time" became the default
        alpha=d.get("alpha", 1.0),
        budget_bytes=d.get("budget_bytes"),
        time_limit=d.get("time_limit", 60.0),
        backend=d.get("backend", "cbc"),
        setup=TrainingSetup(**setup),
        cluster=cluster,
        batch=d.get("batch", "global"),
        roles=d.get("roles", "auto"),  # plans written before roles by name: the ILP's free choice
        data_parallel=d.get("data_parallel"),
        context_attention=d.get("context_attention", "auto"),
        capacity_factor=d.get("capacity_factor"),
    )


@dataclass
class PipelinePlanOptions:
    """The pipeline ``autopar plan`` lays out over a mesh's ``pp`` axis."""

    chunks: int = 1  # Megatron's virtual chunks per rank
    waves: int | None = None  # Hanayo's waves
    microbatches: int | None = None
    schedule: str | None = None  # default: 1f1b, interleaved (chunks > 1) or wave (waves)


def plan_captured(
    captured: Captured,
    mesh: MeshSpec,
    opts: ShardOptions,
    model: str | None = None,
    baselines: tuple[str, ...] = BASELINES,
    pipeline: PipelinePlanOptions | None = None,
    config: dict | None = None,
) -> PlanReport:
    """Plan a captured model by the flow (``autopar.passes.flow``). A mesh axis named ``pp`` is pipeline
    parallelism: the intra-op ILP runs on the other axes, then the sharded graph is split into stages
    over it (Merak's split, balanced stages)."""
    pp = dict(mesh.axes).get(PIPELINE_AXIS)
    po = pipeline or PipelinePlanOptions()
    chunks, waves, points = po.chunks, po.waves, None
    if pp and po.schedule and splits_backward(po.schedule):  # its stages where it places them, its own stash points
        sched = make_schedule(po.schedule, pp, po.microbatches or 1)
        chunks, waves = placement_shape(sched.stage_to_rank, pp)
        points = stash_points_of(sched)
        opts = pricing_options(opts, sched, False)  # its split backward runs each f unfused
    if (config or {}).get("torch_compile") and not (config or {}).get("sub_pipeline_tp"):  # priced compiled
        opts = dataclasses.replace(opts, setup=dataclasses.replace(opts.setup, compiled=True))
    flow_opts = FlowOptions(
        shard=opts,
        chunks=chunks,
        waves=waves,
        microbatches=po.microbatches or 1,
        schedule=po.schedule,
        stash_points=points,
        cache=False,
    )
    planned = plan_program(captured, mesh, flow_opts)
    semantics = (config or {}).get("microbatch_semantics", "exact")
    if planned.train is not None and semantics == "exact":  # compile would refuse the plan's microbatches
        weighed = (config or {}).get("loss_weight", "auto") != "auto"
        tail = bool(pp) and po.schedule in TAIL_SCHEDULES  # a batch tail runs it exactly (GPipe)
        schedule = po.schedule or "1f1b"
        refusal = microbatching_refusal(planned.train, po.microbatches or 1, weighed, tail, schedule)
        if refusal is not None:
            raise BatchCouplingError(refusal)
    pipeline_info = None
    if pp:
        stage_plan = planned.stage_plan
        schedule = po.schedule or stage_plan.schedule
        sched_opts = {"chunks": po.chunks} if schedule == "interleaved" else {}
        if schedule == "wave" and po.waves:
            sched_opts = {"waves": po.waves}
        pipeline_info = {
            "pp": pp,
            "mesh": dict(mesh.axes),
            "schedule": schedule,
            "schedule_options": sched_opts,
            "chunks": chunks,
            "waves": waves,
            "microbatches": po.microbatches,
            "split_seconds": planned.split_seconds,
            "stage_plan": stage_plan.to_dict(),
            "table": stage_plan.format(),
        }
    result = planned.shard_result
    prog = planned.lowered
    base = run_baselines(prog, opts, baselines)
    plan = Plan(
        pipeline=pipeline_info,
        fingerprint=fingerprint(captured),
        mesh=dict(planned.sharded.mesh.axes),
        program=print_program(planned.staged if pp else planned.sharded),
        model=model,
        cluster=opts.cluster.to_dict() if opts.cluster else None,
        options=options_dict(opts),
        stats=dict(shard_stats(result, opts, len(prog.ops)), grad_buckets=bucket_stats(planned.sharded, opts)),
        baselines={k: baseline_dict(v) for k, v in base.items()},
        config=config,
    )
    return PlanReport(plan, result, base, captured.seconds)


def shard_stats(result: ShardResult, opts: ShardOptions, ops: int) -> dict:
    """The shard pass's report in a plan file: the objective it solved, the ILP's status and size, and its
    predictions per device; ``how``: the attempt that solved it (``passes.shard.attempts``)."""
    sol = result.solution
    return {
        "objective": "time" if opts.objective == "comm" else opts.objective,
        "budget_bytes": opts.budget_bytes,
        "how": result.how,
        "step_seconds": result.step_seconds,
        "status": sol.status,
        "ilp_gap": sol.gap,  # relative gap to the solver's bound (0: optimal; None: unknown)
        "solve_seconds": sol.seconds,
        "ilp_variables": sol.variables,
        "ilp_constraints": sol.constraints,
        "ilp_eliminated": sol.eliminated,  # decisions solved exactly before the ILP (solver/sharding/eliminate.py)
        "ilp_groups": len(result.groups),
        "layers_solved_once": sol.layers,
        "memory_per_device_bytes": result.memory_bytes,
        "redundant_bytes": result.redundancy_bytes,
        "comm_bytes": result.comm_bytes,
        "comm_seconds": result.comm_seconds,
        "unruled_ops": result.unruled,
        "ops": ops,
    }


def bucket_stats(program, opts: ShardOptions) -> dict:
    """The plan's gradient buckets (``solver/sharding/buckets.py``): per axis, each bucket's parameter count and
    bytes per rank, and the latency seconds they add to the step (one per bucket)."""
    buckets = grad_buckets(program, opts.setup.bucket_bytes)
    cost = CostModel(program.mesh, opts.setup, opts.cluster)
    names = list(program.mesh.names)
    return {
        "cap_mb": opts.setup.bucket_cap_mb,
        "buckets": [{"axis": b.axis, "params": len(b.names), "bytes": b.nbytes} for b in buckets],
        "latency_seconds": sum(cost.bucket_latency(names.index(b.axis), 1) for b in buckets),
    }


def baseline_dict(b: ShardResult | Unavailable) -> dict:
    """A baseline's entry in the plan file: its predictions, or ``{"unavailable": reason}``."""
    if isinstance(b, Unavailable):
        return {"unavailable": b.reason}
    return {"memory_per_device_bytes": b.memory_bytes, "comm_bytes": b.comm_bytes, "comm_seconds": b.comm_seconds}


def capture_for_planning(model, args: tuple, kwargs: dict, precision: str = "fp32") -> Captured:
    """``capture(*for_capture(model, args, kwargs, precision))`` for planning (``autopar plan``, the search): the
    main layer stack's runs of alike layers cut to two each (``Captured.repeat``, ``passes/repeat_layers.py``)
    when that capture passes its checks, else the whole model. ``lower`` gives the same program either way."""
    t0 = time.perf_counter()
    cut = planning_cut(model)
    if cut is not None:
        repeat, stack = cut
        try:  # a forward that refuses the shorter stack, or a capture the checks refuse: the whole model
            with stack:
                captured = capture(*for_capture(model, args, kwargs, precision))
            captured.repeat = repeat
            captured.plain = lower(captured, MeshSpec())  # the checks (repeat_layers.LayersDiffer)
        except CaptureError:
            pass
        else:
            captured.seconds = time.perf_counter() - t0
            return captured
    captured = capture(*for_capture(model, args, kwargs, precision))
    captured.seconds = time.perf_counter() - t0
    return captured


def plan_model(
    spec: str,
    mesh: MeshSpec,
    opts: ShardOptions,
    baselines: tuple[str, ...] = BASELINES,
    pipeline: PipelinePlanOptions | None = None,
    config: dict | None = None,
) -> PlanReport:
    """Plan preset or ``file.py:fn`` ``spec`` (``autopar plan``); ``config``: the TrainConfig the plan keeps."""
    m = build(spec, device="meta")
    if pipeline is not None and pipeline.microbatches:
        split_batch(m.args, m.kwargs, pipeline.microbatches)  # a count the batch does not divide: named, as compile
    # as compile captures, each run of alike layers cut to two that lower repeats (passes/repeat_layers.py)
    captured = capture_for_planning(m.model, m.args, m.kwargs, opts.setup.precision)
    return plan_captured(captured, mesh, opts, model=spec, baselines=baselines, pipeline=pipeline, config=config)
