"""Build a rank's pipeline stages from a planned program: one GraphModule per stage, sharing parameters.

A planned program (``stage=`` on every op, send/recv at the boundaries) is cut into its stages
(``stage_program``); each stage this rank holds becomes a ``StageRunner`` for the executor, its
GraphModule generated with the rank's ready local shards (``local_tensor``), so the stages of one
rank, its forward and its training programs share one tensor per parameter. With recomputation the
stage is also built as a head (run without autograd in ``F``) and a rest. A mesh without a pipeline
axis is a one-stage pipeline: the same code builds its single stage.

``forward_schedule`` is the forward-only action list of a schedule's placement: every microbatch
through every stage, no backward (``ParallelModule.forward`` on a pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch

from autopar.errors import PlanError, ScheduleError
from autopar.ir.core import MeshSpec, Op, Program, Ref, Replicate, Value
from autopar.passes.assign_stages import assign_stages_pass
from autopar.passes.flow import FLOW
from autopar.passes.manager import PassManager, Variants
from autopar.passes.prune import updates_state, writes_in_place
from autopar.passes.stage_program import StageProgram, recompute_cut, split_for_recompute, stage_program
from autopar.passes.transfers import insert_transfers
from autopar.runtime.build.codegen import CodegenOptions
from autopar.runtime.build.rng import DropoutRng
from autopar.runtime.execute.stage_runner import Buffer, Part, StageRunner
from autopar.schedule.actions import F, Kind, Schedule
from autopar.schedule.comm_actions import insert_comm_actions


class StageBuilder:
    """Generates the GraphModules of one rank's stages by the flow's ``codegen`` pass; ``modules`` keeps them
    by label, ``passes`` is the PassManager that ran it (variant ``rank{r}.{label}`` of each part: its dumps
    ``09-codegen.rank{r}.{label}.py``, written where the facade says, ``ParallelModule.passes.dump_into``)."""

    def __init__(
        self,
        coords: dict[str, int],
        local_tensor: Callable[[Value], torch.Tensor],
        device: torch.device,
        rng: DropoutRng | None,
        rank: int = 0,
    ):
        self.coords, self.local_tensor, self.device, self.rng, self.rank = coords, local_tensor, device, rng, rank
        self.modules: dict[str, torch.fx.GraphModule] = {}
        self.passes = PassManager(FLOW, dump_env=False)  # AUTOPAR_DUMP_DIR is the facade's to apply

    def part(self, prog: Program, label: str, overlap_tp: bool = True) -> Part:
        options = CodegenOptions(self.coords, _no_whole, self.device, self.local_tensor, self.rng, overlap_tp)
        variant = f"rank{self.rank}.{label}"
        out = self.passes.run(Variants({variant: prog}), start="codegen", stop="codegen", options={"codegen": options})
        gm = self.modules[label] = out[variant]
        return Part.of(gm, prog)

    def runners(
        self,
        program: Program,
        stages: list[int],
        recompute: dict[int, set[Fraction]],
        label: str,
        overlap_tp: bool = True,
    ) -> tuple[dict[int, StageRunner], dict[int, StageProgram]]:
        """The runners of ``stages`` of ``program`` (with the recompute variants each needs); ``overlap_tp``:
        codegen's (off where the backward is split or sub-pipelined)."""
        if any(recompute.values()):  # the whole program's: every rank that recomputes refuses alike
            _refuse_replayed_updates(program.ops)
        require_whole_buffer_writes(program)
        inner = program.mesh
        runners: dict[int, StageRunner] = {}
        programs: dict[int, StageProgram] = {}
        for s in stages:
            sp = stage_program(program, s)
            programs[s] = sp
            whole = self.part(sp.program, f"{label}{s}", overlap_tp)
            runner = StageRunner(
                s, whole, [_buffer(v, inner) for v in sp.recv], [_buffer(v, inner) for v in sp.send], sp.is_last
            )
            for x in sorted(recompute.get(s, ())):
                cut = recompute_cut(sp, x)
                if cut >= len(sp.program.ops):
                    runner.variants[x] = (whole, None)
                else:
                    head, rest = split_for_recompute(sp.program, cut)
                    runner.variants[x] = (
                        self.part(head, f"{label}{s}.head{x}", overlap_tp),
                        self.part(rest, f"{label}{s}.rest{x}", overlap_tp),
                    )
            runners[s] = runner
        return runners, programs


def _refuse_replayed_updates(ops: tuple[Op, ...]) -> None:
    """Recomputation runs a stage's forward again: an op that updates a buffer (an in-place write, a
    batch norm's running statistics) would update it twice, and later reads would see the second."""
    hit = next((op for op in ops if updates_state(op)), None)
    if hit is not None:
        raise ScheduleError(
            f"the schedule recomputes forwards, and %{hit.result} = {hit.target} (at {hit.path or 'the top'}) "
            "updates a buffer "
            "(running statistics or an in-place write): recomputation would apply the update twice. "
            "Train this model with a schedule without recompute."
        )


def require_whole_buffer_writes(program: Program) -> None:
    """An in-place write (``passes/functionalize.py`` keeps those to buffers) must write the rank's buffer
    itself: the buffer stored replicated and read as it is, not a resharded copy of it."""
    producers = program.producers()
    for op in program.ops:
        if not writes_in_place(op):
            continue
        src = producers.get(op.args[0].name) if isinstance(op.args[0], Ref) else None
        while isinstance(src, Op) and writes_in_place(src) and isinstance(src.args[0], Ref):
            src = producers.get(src.args[0].name)
        if not (
            isinstance(src, Value)
            and src.kind == "buffer"
            and all(isinstance(p, Replicate) for p in src.type.placements)
        ):
            what = f"{src.kind} %{src.name} {src.type}" if isinstance(src, Value) else "a computed value"
            raise PlanError(
                f"%{op.result} = {op.target} (at {op.path or 'the top'}) updates {what} in place, which the plan does "
                "not hold as the rank's whole buffer: the update would be lost. Plan again (buffers updated in "
                "place must stay replicated)"
            )


def recompute_fractions(schedule: Schedule, pp_rank: int) -> dict[int, set[Fraction]]:
    """Per stage of rank ``pp_rank``, the recompute fractions its forwards use."""
    out: dict[int, set[Fraction]] = {}
    for a in schedule.actions[pp_rank]:
        if a.kind is Kind.F and a.recompute:
            out.setdefault(a.stage, set()).add(a.recompute)
    return out


def forward_schedule(schedule: Schedule, microbatches: int) -> Schedule:
    """Every microbatch forward through every stage of ``schedule``'s placement, in microbatch order."""
    s2r = schedule.stage_to_rank
    compute = [
        [F(m, s) for m in range(microbatches) for s in schedule.stages_of_rank(r)] for r in range(schedule.num_ranks)
    ]
    # each receive right before its consumer: sound for the executor's eager point-to-point (no
    # backward runs, so no two ranks wait on each other)
    actions = insert_comm_actions(compute, s2r, microbatches, post_ahead=False)
    return Schedule(schedule.num_ranks, schedule.num_stages, microbatches, s2r, actions, "forward")


def one_stage(program: Program) -> Program:
    """A program without stages as a one-stage pipeline, as the flow makes it for a mesh without a
    pipeline axis: its ``assign-stages`` (``stage=0`` on every op) and ``insert-transfers`` (none)."""
    staged, _ = assign_stages_pass(program, {"pp": 1})
    return insert_transfers(staged)


def _buffer(v: Value, inner: MeshSpec) -> Buffer:
    t = v.type
    return Buffer(v.name, t.local_shape(inner), t.torch_dtype, bool(v.attrs.get("grad")))


def _no_whole(name: str) -> torch.Tensor:
    raise AssertionError(f"{name} should come from local_tensor")


__all__ = ["StageBuilder", "forward_schedule", "one_stage", "recompute_fractions"]
