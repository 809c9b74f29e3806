"""Materialize a searched candidate as a Plan: capture at its micro-batch, its stages, the intra-op ILP per stage.

``SearchResult.materialize()`` (``result.py``) calls ``build_plan``:

1. capture the model on the meta device (or the CPU) with one microbatch of every data-parallel
   replica (``micro_batch * dp`` samples) and lower it on the mesh without ``pp``;
2. with a pipeline, split it and balance the subgraphs over the candidate's stages (the
   assign-stages pass, ``autopar.passes.assign_stages``; time only: memory was the search's business);
3. solve the intra-op ILP (``passes/shard.py``, objective: step time within the budget) once per
   distinct stage: stages whose ops have the same signature (targets, types, arguments with value
   names replaced by their order) share one solve and take its placements by position. The
   ``dp*`` axes stay data parallel (``data_parallel_axes``); the ILP decides the ``tp`` placements;
4. merge every stage's placements into the one program, make each stage's assumption about values
   made elsewhere an explicit requirement, insert the collectives and verify.

``launch_options`` reads a searched plan back: the mesh and the ``autopar.compile`` options to run it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from fractions import Fraction
from typing import Any, Protocol

from autopar.errors import InfeasibleError
from autopar.ir.axes import data_axes, is_data_axis
from autopar.ir.core import MeshSpec, Program, Ref, Replicate, Shard, Value, map_refs
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.models import build
from autopar.passes.assign_stages import assign_stages
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.lower import lower
from autopar.passes.pipeline_split import common_nodes
from autopar.passes.shard import ShardOptions, ShardResult, format_placements, shard
from autopar.plan import Plan, fingerprint
from autopar.planner import options_dict, options_from_dict
from autopar.search.price import Evaluation
from autopar.search.profile import with_batch
from autopar.solver.cluster import ClusterSpec
from autopar.solver.cost import TrainingSetup


class SearchOutcome(Protocol):
    """What ``build_plan`` reads of a search (``result.SearchResult``, which calls it, is one)."""

    spec: str | None
    precision: str
    budget_bytes: float
    cluster: ClusterSpec
    global_batch: int
    stats: dict[str, Any]

    def summary(self, ev: Evaluation) -> dict[str, Any]: ...


def build_plan(
    result: SearchOutcome, ev: Evaluation, time_limit: float = 60.0, backend: str = "cbc", capture_device: str = "meta"
) -> Plan:
    """The Plan of candidate ``ev`` of a search (see the module docstring).

    ``capture_device="meta"`` allocates no weights. A plan is checked against the graph the training
    run captures, and a few kernels lay out their outputs differently on the meta device than on a real
    one (GPT-2's attention output gains an ``aten.contiguous`` on meta): a run that captures a model with
    real weights on the CPU needs a plan captured with ``capture_device="cpu"``; the pipeline runtime,
    which builds a model on the meta device and initializes it shard by shard, matches a meta plan."""
    c = ev.candidate
    spec = with_batch(result.spec, c.micro_batch * c.dp)
    t0 = time.perf_counter()
    m = build(spec, device=capture_device, seed=0 if capture_device != "meta" else None)
    captured = capture(m.model, m.args, m.kwargs)
    capture_seconds = time.perf_counter() - t0
    inner = MeshSpec(tuple(c.inner_mesh().items()))
    prog = lower(captured, inner)
    zero_axes = data_axes(inner.names)
    setup = TrainingSetup(precision=result.precision, zero=c.zero, zero_axes=zero_axes, mics_group=c.mics_group or None)
    opts = ShardOptions(
        objective="comm",
        constrain=data_parallel_axes(prog),
        budget_bytes=result.budget_bytes,
        time_limit=time_limit,
        backend=backend,
        setup=setup,
        cluster=result.cluster,
    )
    pipeline_info = None
    if c.pp > 1:
        prog, stage_plan, split = assign_stages(
            prog, c.pp, chunks=c.chunks, waves=c.waves or None, microbatches=c.microbatches, cluster=result.cluster,
            budget_bytes=math.inf, precision="fp32" if result.precision == "fp32" else "bf16",
        )  # fmt: skip
        split_seconds = split.seconds
        sp = stage_plan.to_dict()
        sp["budget_bytes"] = None  # stages balanced for time only; memory is the search's model (stats.predicted)
        pipeline_info = {
            "split_seconds": split_seconds,
            "stage_plan": sp,
            "table": stage_plan.format(),
        }
        ranges = _stage_op_ranges(prog)
    else:
        ranges = [(0, len(prog.ops))]
    if inner.size == 1:  # one device per pipeline stage: nothing to place, every value stays whole
        merged = prog
        stage_stats = [
            {"stage": k, "ops": b - a, "signature": "", "solved": False, "how": "one device", "status": "none",
             "solve_seconds": 0.0, "memory_per_device_bytes": 0.0, "comm_seconds": 0.0, "layers_solved_once": 0}
            for k, (a, b) in enumerate(ranges)
        ]  # fmt: skip
    else:
        merged, stage_stats = _solve_stages(prog, ranges, opts)
    final = insert_collectives(merged)
    verify(final)
    summary = result.summary(ev)
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
        **(pipeline_info or {}),
    }
    stats = {
        "search": {k: v for k, v in result.stats.items()},
        "predicted": summary,
        "stage_ilp": stage_stats,
        "capture_seconds": capture_seconds,
        "ops": len(prog.ops),
        "memory_per_device_bytes": ev.memory,
        "step_seconds": ev.step_time,
    }
    return Plan(
        fingerprint=fingerprint(captured),
        mesh=c.inner_mesh(),  # what autopar.compile checks (the pipeline runtime checks the mesh without pp)
        program=print_program(final),
        model=spec,
        cluster=result.cluster.to_dict(),
        options=options_dict(opts),
        stats=stats,
        baselines={},
        pipeline=pipeline,
    )


def data_parallel_axes(prog: Program, activations: bool = True) -> dict:
    """ILP constraints that keep the search's meaning of the ``dp*`` axes (data parallelism):
    parameters and buffers replicated on them (ZeRO shards their states, which is memory accounting,
    not placement); user inputs and, with ``activations``, every float activation that carries the
    batch (not derived from weights alone, not a common node, dim 0 a multiple of the dp size) split
    on dim 0. Without the activation constraints a model too small for its compute to matter would be
    computed redundantly on every dp rank (the cheapest plan in communication). The ILP decides
    everything on ``tp``."""
    dp = tuple(i for i, n in enumerate(prog.mesh.names) if is_data_axis(n))
    if not dp:
        return {}
    size = math.prod(prog.mesh.sizes[i] for i in dp)

    def replicated(p) -> bool:
        return all(isinstance(p[i], Replicate) for i in dp)

    def batch_split(p) -> bool:
        return all(isinstance(p[i], Shard) and p[i].dim == 0 for i in dp)

    out = {
        v.name: replicated if v.kind in ("param", "buffer") else batch_split
        for v in prog.inputs
        if v.kind in ("param", "buffer") or len(v.type.shape) >= 1
    }
    if not activations:
        return out
    weights = {v.name for v in prog.inputs if v.kind in ("param", "buffer")}
    commons = common_nodes(prog)
    for op in prog.ops:
        refs = [r.name for r in op.input_refs()]
        if refs and all(r in weights for r in refs):
            weights.update(op.results)
            continue
        for r, t in zip(op.results, op.types):
            if t.is_float and r not in commons and t.shape and t.shape[0] >= size and t.shape[0] % size == 0:
                out[r] = batch_split
    return out


def _stage_op_ranges(prog: Program) -> list[tuple[int, int]]:
    """Op index range [start, stop) of each pipeline stage, from the ``stage`` annotations."""
    ranges: list[list[int]] = []
    for i, op in enumerate(prog.ops):
        s = op.attrs.get("stage", 0)
        while len(ranges) <= s:
            ranges.append([i, i])
        ranges[s][1] = i + 1
    return [(a, b) for a, b in ranges]


def _canonical(sub: Program) -> str:
    """A stage's op signature: targets, types and arguments with value names replaced by their order
    of definition. Two stages with equal signatures get the same ILP (solved once)."""
    index: dict[str, int] = {}
    lines = []
    for v in sub.inputs:
        index[v.name] = len(index)
        lines.append(f"{v.kind} {v.type}")
    for op in sub.ops:
        args = map_refs((op.args, op.kwargs), lambda r: f"%{index[r.name]}")
        lines.append(f"{op.target} {op.types} {args!r}")
        for r in op.results:
            index[r] = len(index)
    lines.append("outputs " + " ".join(str(index.get(getattr(r, "name", ""), r)) for r in sub.outputs))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _solve_stages(
    prog: Program, ranges: list[tuple[int, int]], opts: ShardOptions
) -> tuple[Program, list[dict[str, Any]]]:
    """Solve the intra-op ILP once per distinct stage and write every stage's placements into ``prog``.

    A stage is ``prog.ops[a:b]`` with the tensors it receives as inputs. Stages with the same
    signature share the solve (their ops and inputs correspond by position). Where a stage reads a
    value made elsewhere (a received boundary tensor, a parameter another stage stores first), the
    placement its ILP assumed becomes an explicit requirement, so ``insert-collectives`` reshards.
    """
    types = prog.types()
    produced_in = {}
    for k, (a, b) in enumerate(ranges):
        for op in prog.ops[a:b]:
            for r in op.results:
                produced_in[r] = k
    cache: dict[str, Any] = {}
    placement: dict[str, tuple] = {}  # graph input -> placements (the first stage reading it decides)
    new_ops = list(prog.ops)
    stats = []
    for k, (a, b) in enumerate(ranges):
        ops = prog.ops[a:b]
        defined = {r for op in ops for r in op.results}
        reads: dict[str, None] = {}
        for op in ops:
            for r in op.input_refs():
                if r.name not in defined:
                    reads[r.name] = None
        graph = {v.name: v for v in prog.inputs}
        received = [Value(n, "input", types[n]) for n in reads if n not in graph]
        own = [graph[n] for n in reads if n in graph]
        later = {r.name for op in prog.ops[b:] for r in op.input_refs()}
        later |= {r.name for r in prog.outputs if isinstance(r, Ref)}
        outputs = tuple(Ref(r) for op in ops for r in op.results if r in later) or (Ref(ops[-1].result),)
        sub = Program(prog.mesh, (*received, *own), tuple(ops), outputs, dict(prog.attrs))
        sig = _canonical(sub)
        t0 = time.perf_counter()
        hit = sig in cache
        if not hit:
            cache[sig] = (sub, _shard_or_fallback(sub, opts))
        rep_sub, (res, how) = cache[sig]
        solved = res.program
        # the representative's inputs and ops correspond to this stage's by position
        chosen = {}
        for v, w in zip(sub.inputs, solved.inputs):
            chosen[v.name] = w.type.placements
            if v.name in graph and v.name not in placement:
                placement[v.name] = w.type.placements
        for i, (op, sop) in enumerate(zip(ops, solved.ops)):
            req = list(sop.attrs.get("in", []))
            for j, r in enumerate(op.input_refs()):
                if j < len(req) and req[j] == "*" and r.name not in defined:
                    req[j] = format_placements(chosen[r.name])
            tys = tuple(t.with_placements(s.placements) for t, s in zip(op.types, sop.types))
            new_ops[a + i] = op.with_(types=tys, attrs=dict(op.attrs, **{"in": req}))
        stats.append(
            {
                "stage": k,
                "ops": b - a,
                "signature": sig[:12],
                "solved": not hit,
                "how": how,
                "status": res.solution.status,
                "solve_seconds": time.perf_counter() - t0,
                "memory_per_device_bytes": res.memory_bytes,
                "comm_seconds": res.comm_seconds,
                "layers_solved_once": res.solution.layers,
            }
        )
    inputs = tuple(
        dataclasses.replace(v, type=v.type.with_placements(placement[v.name])) if v.name in placement else v
        for v in prog.inputs
    )
    return prog.with_(inputs=inputs, ops=tuple(new_ops)), stats


def _shard_or_fallback(sub: Program, opts: ShardOptions) -> tuple[ShardResult, str]:
    """The ILP with the step-time objective within the budget; if the ILP's own memory model (every
    activation of one microbatch saved, no recomputation) finds nothing within it, the least-memory
    strategy instead; if constraining the activations to data parallelism leaves no strategy, the
    parameters and inputs only (each reported as such)."""
    try:
        return shard(sub, opts), "comm within budget"
    except InfeasibleError:
        pass
    try:
        return shard(sub, dataclasses.replace(opts, objective="memory", budget_bytes=None)), "least memory"
    except InfeasibleError:  # the activation constraints left an op without a strategy: parameters only
        loose = data_parallel_axes(sub, activations=False)
        return shard(sub, dataclasses.replace(opts, constrain=loose)), "parameters constrained only"


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


__all__ = ["build_plan", "data_parallel_axes", "launch_options"]
