"""Materialize a searched candidate as a Plan: the flow (``autopar.passes.flow``) run at its micro-batch and stages.

``SearchResult.materialize()`` (``result.py``) calls ``build_plan``, which runs the flow as ``autopar plan``
and ``autopar.compile`` do:

1. capture the model on the meta device (or the CPU) with one microbatch of every data-parallel
   replica (``micro_batch * dp`` samples), and lower it on the mesh without ``pp``;
2. shard: the intra-op ILP (objective: step time within the budget) on the whole program, each repeated
   layer solved once (``ShardOptions.reuse_layers``). The ``dp*`` axes stay data parallel
   (``ShardOptions.data_parallel``: weights replicated, the batch split, also in the activations); the ILP
   decides the ``tp`` placements. When its own memory model (every activation of one microbatch saved, no
   recomputation) finds nothing within the budget, the shard pass falls back (``ShardOptions.fallbacks``:
   least memory, then only the inputs kept data parallel) and ``stats["shard"]["how"]`` says so;
3. insert the collectives, split the sharded program (Merak) and balance the subgraphs over the candidate's
   stages, for time only (``FlowOptions.stage_budget_bytes = inf``: memory was the search's business, in
   its own model with recomputation and ZeRO); every pass verified, and dumped with ``dump_dir``.

``launch_options`` reads a searched plan back: the mesh and the ``autopar.compile`` options to run it.

A candidate priced with Megatron's sequence parallelism (``Candidate.sp``) is not written: the runtime runs what the
intra-op ILP places, which takes sequence-sharded norms only where a memory budget makes it (and then in a form that
communicates more: an all-reduce of each gathered input's gradient, ``tests/test_sequence_parallel.py``), so the
plan would not run as it was priced (``build_plan`` raises ``PlanError``; ``sequence_parallel_unwritable``).
"""

from __future__ import annotations

import math
import os
import time
from fractions import Fraction
from typing import Any, Protocol

from autopar.errors import PlanError
from autopar.ir.axes import data_axes
from autopar.ir.core import MeshSpec
from autopar.ir.printer import print_program
from autopar.models.resolve import build
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.shard import ShardOptions
from autopar.plan import Plan, fingerprint
from autopar.planner import capture_for_planning, options_dict, options_from_dict, shard_stats
from autopar.search.evaluation import Evaluation
from autopar.search.profile import with_batch
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.options import decide_gathers


class SearchOutcome(Protocol):
    """What ``build_plan`` reads of a search (``result.SearchResult``, which calls it, is one)."""

    spec: str | None
    precision: str
    budget_bytes: float
    cluster: ClusterSpec
    global_batch: int
    stats: dict[str, Any]
    analytic: Any  # the search's ``price.Analytic``: its pricing assumptions (compiled, router, capacity)

    def summary(self, ev: Evaluation) -> dict[str, Any]: ...


def shard_options(
    result: SearchOutcome, ev: Evaluation, mesh: MeshSpec, time_limit: float, backend: str
) -> ShardOptions:
    """The intra-op ILP's options for candidate ``ev`` on ``mesh``: its ZeRO/MiCS, the search's precision, budget,
    cluster and pricing assumptions (torch_compile, a mixture of experts' router imbalance and capacity factor),
    the dp* axes data parallel."""
    c = ev.candidate
    zero_axes = data_axes(mesh.without_pipeline().names)
    setup = TrainingSetup(
        precision=result.precision, zero=c.zero, zero_axes=zero_axes, mics_group=c.mics_group or None,
        compiled=result.analytic.compiled,  # a plan searched for torch_compile=True is solved priced compiled
        router_imbalance=result.analytic.router_imbalance,  # the router the search priced, priced by the ILP too
    )  # fmt: skip
    opts = ShardOptions(
        objective="time",
        budget_bytes=result.budget_bytes,
        time_limit=time_limit,
        backend=backend,
        setup=setup,
        cluster=result.cluster,
        data_parallel="activations",
        fallbacks=True,
        context_attention=c.cp_form or "auto",  # the form the search priced (ShardOptions fixes it on cp)
        capacity_factor=result.analytic.capacity_factor,  # dropped as the search priced it (set_capacity)
    )
    # ZeRO-3's gathers hierarchical where the cluster says they pay, as the search priced them (CommTime.unit_gather)
    return decide_gathers(opts, mesh)


def build_plan(
    result: SearchOutcome,
    ev: Evaluation,
    time_limit: float = 60.0,
    backend: str = "cbc",
    capture_device: str = "meta",
    dump_dir: str | os.PathLike | None = None,
) -> Plan:
    """The Plan of candidate ``ev`` of a search (see the module docstring); ``dump_dir`` (or
    ``AUTOPAR_DUMP_DIR``) receives every pass's output, as ``autopar plan --dump-dir`` does.

    ``capture_device="meta"`` allocates no weights. A plan is checked against the graph the training
    run captures, and a few kernels lay out their outputs differently on the meta device than on a real
    one (GPT-2's attention output gains an ``aten.contiguous`` on meta): a run that captures a model with
    real weights on the CPU needs a plan captured with ``capture_device="cpu"``; the pipeline runtime,
    which builds a model on the meta device and initializes it shard by shard, matches a meta plan."""
    c = ev.candidate
    if c.sp:
        raise PlanError(sequence_parallel_unwritable(c.describe()))
    spec = with_batch(result.spec, c.micro_batch * c.dp)
    t0 = time.perf_counter()
    m = build(spec, device=capture_device, seed=0 if capture_device != "meta" else None)
    captured = capture_for_planning(m.model, m.args, m.kwargs, result.precision)  # as compile captures it
    capture_seconds = time.perf_counter() - t0
    mesh = MeshSpec(tuple(c.mesh().items()))
    opts = shard_options(result, ev, mesh, time_limit, backend)
    flow = FlowOptions(
        shard=opts,
        chunks=c.chunks,  # the candidate's placement: interleaved, ZB-V and DualPipeV have chunks, waves waves
        waves=c.waves or None,
        microbatches=c.microbatches,
        schedule=c.schedule if c.pp > 1 else None,
        stage_budget_bytes=math.inf,
        cache=False,  # the shard pass's report goes into the plan's stats
    )
    planned = plan_program(captured, mesh, flow, dump_dir=dump_dir)
    pipeline = {
        "pp": c.pp,
        "mesh": c.mesh(),
        "schedule": c.schedule if c.pp > 1 else None,
        "schedule_options": {k: (str(v) if not isinstance(v, int) else v) for k, v in c.schedule_options().items()},
        "chunks": c.chunks,
        "waves": c.waves or None,
        "microbatches": c.microbatches,
        "micro_batch": c.micro_batch,
        "global_batch": result.global_batch,
        "recompute": c.recompute,
        "alpha1": float(c.alpha),
        "recompute_fraction_per_stage": list(ev.recompute_fraction),
    }
    if planned.stage_plan is not None:
        sp = planned.stage_plan.to_dict()
        sp["budget_bytes"] = None  # stages balanced for time only; memory is the search's model (stats.predicted)
        pipeline.update(split_seconds=planned.split_seconds, stage_plan=sp, table=planned.stage_plan.format())
    stats = {
        "search": dict(result.stats),
        "predicted": result.summary(ev),
        "shard": shard_stats(planned.shard_result, opts, len(planned.lowered.ops)),
        "pass_seconds": dict(planned.timings),
        "capture_seconds": capture_seconds,
        "ops": len(planned.lowered.ops),
        "memory_per_device_bytes": ev.memory,
        "step_seconds": ev.step_time,
    }
    return Plan(
        fingerprint=fingerprint(captured),
        mesh=c.inner_mesh(),  # what autopar.compile checks (the pipeline runtime checks the mesh without pp)
        program=print_program(planned.staged if c.pp > 1 else planned.sharded),
        model=spec,
        cluster=result.cluster.to_dict(),
        options=options_dict(opts),
        stats=stats,
        baselines={},
        pipeline=pipeline,
    )


def sequence_parallel_unwritable(what: str) -> str:
    """Why a plan priced with Megatron's sequence parallelism is not written (the module docstring), and what to do."""
    return (
        f"{what} is priced with Megatron's sequence parallelism, which autopar's runtime does not run from a plan "
        "file yet: the intra-op ILP places the tensor-parallel activations itself (sequence-sharded norms only under "
        "a memory budget, in a form that also all-reduces each gathered input's gradient), so the plan would not run "
        "as it was priced. Price it without -o, or write a plan without --sequence-parallel"
    )


def launch_options(plan: Plan) -> tuple[dict[str, int], dict[str, Any]]:
    """(mesh axes for ``autopar.init_mesh``, keyword arguments for ``autopar.compile``) of a searched plan.

        axes, kwargs = launch_options(Plan.load("plan.json"))
        mesh = autopar.init_mesh(**axes)
        model = autopar.compile(model, mesh, kwargs=microbatch, plan="plan.json", **kwargs)

    A pipeline plan adds the schedule, its options, the microbatch count and the training setup (ZeRO,
    MiCS) the pipeline runtime needs; ``microbatch`` is then the whole batch of one step on a pipeline
    (``global_batch / dp`` samples per replica, the runtime cuts it). Without a pipeline it is one
    microbatch (``micro_batch * dp`` samples); with ``microbatches > 1`` accumulate gradients over them.
    ``"sub_pipeline_tp": true`` in the pipeline section (the search never writes it; the program must
    then have been planned for half a microbatch) adds ``sub_pipeline_tp=True``.
    """
    p = plan.pipeline or {}
    axes = dict(plan.launch_mesh.axes)
    if p.get("pp", 1) <= 1:
        return axes, {}
    opts = {k: Fraction(v) if isinstance(v, str) else v for k, v in (p.get("schedule_options") or {}).items()}
    return axes, {
        "microbatches": p.get("microbatches") or 1,
        "schedule": p["schedule"],
        "schedule_options": opts,
        "options": options_from_dict(plan.options),
        **({"sub_pipeline_tp": True} if p.get("sub_pipeline_tp") else {}),
    }


__all__ = ["build_plan", "launch_options", "sequence_parallel_unwritable"]
