"""Pass assign-stages: split a program into subgraphs (Merak) and put contiguous runs of them on pipeline stages.

    prog, stage_plan, split = assign_stages(prog, pp=4, chunks=2, microbatches=8)

The split is ``passes/pipeline_split.py`` (cached by the program's fingerprint), the balance
``solver/stages.balance_stages`` (min-max stage time within the memory budget, in-flight microbatches
of ``schedule/placement.py``). The program comes back with ``subgraph=k`` and ``stage=s`` on every op
(graph inputs: those of their first use) and ``pipeline_stages`` in its attrs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.errors import NoLegalCutError, PipelineError
from autopar.ir.core import Program
from autopar.passes.pipeline_split import blockers, common_nodes, split_options, split_program
from autopar.passes.subgraphs import Split, SplitOptions, annotate
from autopar.schedule.placement import check_shape, num_stages
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.stages.balance import StashPoints, balance_stages, pipeline_shape_text
from autopar.solver.stages.cost import CommFn, megatron_tp_comm_seconds
from autopar.solver.stages.plan import StagePlan


def assign_stages(
    prog: Program,
    pp: int,
    chunks: int = 1,
    waves: int | None = None,
    microbatches: int | None = 1,
    *,
    cluster: ClusterSpec | str | None = None,
    budget_bytes: float | None = None,
    efficiency: float | None = None,
    precision: str = "bf16",
    split_options: SplitOptions | None = None,
    comm_fn: CommFn = megatron_tp_comm_seconds,
    schedule: str | None = None,
    stash_points: StashPoints | None = None,
    compiled: bool = False,
) -> tuple[Program, StagePlan, Split]:
    """Split ``prog`` and balance its subgraphs over ``pp`` ranks holding ``pp * chunks`` (interleaved)
    or ``2 * pp * waves`` (wave) stages; ``microbatches`` per step (None: as many as the schedule keeps
    in flight). Returns the annotated program, the StagePlan and the Split (``split.seconds``: the time
    the split took, near zero from its cache). ``cluster`` defaults to ``dgx-a100``, ``budget_bytes`` to
    its device memory. ``stash_points``: the schedule's, per rank (``solver/stages.balance_stages``);
    ``compiled``: priced as torch.compile runs the stages (``balance_stages``)."""
    check_shape(pp, chunks, waves)
    split = split_program(prog, split_options)
    S = num_stages(pp, chunks, waves)
    if len(split) == 1 and S > 1:
        raise NoLegalCutError(
            f"{pipeline_shape_text(pp, chunks, waves)} needs {S} stages, but the graph has no legal cut: at every "
            f"gap between ops more tensors cross than the split allows. Longest-lived tensors: "
            f"{'; '.join(blockers(prog))}. Raise SplitOptions.max_crossing, or restructure the model so that "
            "layers hand on one tensor."
        )
    plan = balance_stages(
        prog,
        split,
        pp,
        chunks,
        waves,
        cluster,
        budget_bytes,
        microbatches,
        commons=frozenset(common_nodes(prog)),
        efficiency=efficiency,
        precision=precision,
        comm_fn=comm_fn,
        schedule=schedule,
        stash_points=stash_points,
        compiled=compiled,
    )
    return annotate(prog, split, plan.stage_of_subgraph), plan, split


_STAGE_OPTIONS = (
    "pp",
    "chunks",
    "waves",
    "microbatches",
    "cluster",
    "budget_bytes",
    "efficiency",
    "precision",
    "schedule",
    "stash_points",
    "compiled",
)


def assign_stages_pass(prog: Program, options: Any = None) -> tuple[Program, tuple[StagePlan | None, float]]:
    """The ``assign-stages`` pass: ``stage=s`` on every op, and its report ``(StagePlan, split seconds)``.
    ``options``: a dict with ``pp`` and optionally ``chunks``, ``waves``, ``microbatches``, ``cluster``,
    ``budget_bytes``, ``efficiency``, ``precision``, ``schedule``, ``stash_points``, ``compiled`` and SplitOptions
    fields, and ``stage_to_rank``: the schedule's placement, which the stage plan must have. With ``pp=1`` every op
    is stage 0 (a mesh without a pipeline is a one-stage pipeline) and there is no stage plan."""
    opts = dict(options or {})
    if "pp" not in opts:
        raise PipelineError(f"the assign-stages pass needs pp (options: {', '.join(_STAGE_OPTIONS)})")
    stage_to_rank = opts.pop("stage_to_rank", None)
    stage = {k: opts.pop(k) for k in _STAGE_OPTIONS if k in opts}
    split_fields = {f.name for f in dataclasses.fields(SplitOptions)}
    unknown = sorted(set(opts) - split_fields)
    if unknown:
        known = sorted((*_STAGE_OPTIONS, "stage_to_rank", *split_fields))
        raise PipelineError(f"unknown assign-stages option(s) {unknown}; known: {known}")
    pp = stage.pop("pp")
    if pp == 1:
        ops = tuple(op.with_(attrs=dict(op.attrs, stage=0)) for op in prog.ops)
        return prog.with_(ops=ops, attrs=dict(prog.attrs, pipeline_stages=1)), (None, 0.0)
    annotated, plan, split = assign_stages(prog, pp, split_options=split_options(opts), **stage)
    if stage_to_rank is not None and tuple(plan.stage_to_rank) != tuple(stage_to_rank):
        raise PipelineError(
            f"the schedule places stages on ranks {list(stage_to_rank)} but the stage plan on "
            f"{list(plan.stage_to_rank)}"
        )
    annotated = annotated.with_(attrs=dict(annotated.attrs, pipeline_stages=plan.num_stages))
    return annotated, (plan, split.seconds)


__all__ = ["assign_stages", "assign_stages_pass"]
