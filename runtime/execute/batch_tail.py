"""A batch tail: a loss that couples the batch, computed exactly over the microbatches of a step.

``passes/batch_coupling.py:batch_tail`` finds, for a loss whose couplings are products of batch means with a
gradient-free factor (the MoE load-balancing loss ``N * sum_e f_e * P_e``: ``f`` counts top-k choices) or
divisions by a gradient-free count over the batch (a cross-entropy's count of targets, before the auxiliary
term is added), the statistics to take over the whole step. On the stage that holds those ops (the last),
every forward of the step runs first: each microbatch's program once without autograd for its own values of
the statistics, their mean over the microbatches is the step's value (each microbatch is an equal share of
the batch), and then each microbatch's forward with autograd reads the step's value in their place
(``tail_program``: the statistics are inputs there). The microbatches' mean loss is then the batch's, and so
is its gradient, since the statistics carry none; the backwards run as the schedule lists them.

It needs every forward of that stage before its first backward: GPipe (``gpipe``). 1F1B, interleaved 1F1B,
waves, ZB-V, DualPipeV and the other schedules that start a backward of the last stage before its last
forward keep the refusal (``BatchCouplingError``), and so do recomputation on that stage, sub-microbatches and
pieces weighed unequally (``loss_weight``). The cost: one more forward of the last stage per microbatch,
without autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.errors import BatchCouplingError
from autopar.ir.core import Program
from autopar.passes.batch_coupling import TAIL_SCHEDULES, Tail, batch_tail, tail_program
from autopar.runtime.execute.state import Stash
from autopar.schedule.actions import Kind, Schedule


def runs_tail(schedule: Schedule, stage: int) -> bool:
    """Whether ``schedule`` runs every forward of ``stage`` before its first backward, none recomputed."""
    rank = schedule.stage_to_rank[stage]
    kinds = [a for a in schedule.actions[rank] if a.stage == stage and a.kind in (Kind.F, Kind.B, Kind.W)]
    forwards = [i for i, a in enumerate(kinds) if a.kind is Kind.F]
    backwards = [i for i, a in enumerate(kinds) if a.kind is not Kind.F]
    if any(kinds[i].recompute for i in forwards):
        return False
    return not backwards or max(forwards) < min(backwards)


def step_tail(program: Program, schedule: Schedule, sub_microbatches: int = 1) -> Tail | None:
    """The ``Tail`` this step runs ``program`` (the planned training program) with, or ``None``: no coupling it
    makes exact, coupling ops off the last stage, or a schedule that cannot run it (``runs_tail``)."""
    if schedule.num_microbatches * sub_microbatches <= 1 or sub_microbatches != 1:
        return None
    tail = batch_tail(program)
    last = schedule.num_stages - 1
    if tail is None or any(s != last for s in tail.stages) or not runs_tail(schedule, last):
        return None
    return tail


class StageTail:
    """The executor's side of a ``Tail`` on the last stage: holds each microbatch's inputs until the step's
    last forward, then runs them all (module docstring)."""

    def __init__(self, tail: Tail, inputs: list[tuple[str, tuple[int, ...], torch.dtype]], microbatches: int):
        self.tail, self.inputs, self.microbatches = tail, inputs, microbatches
        self.pending: dict[int, dict[str, torch.Tensor]] = {}

    def forward(
        self, mb: int, envs: list[dict[str, torch.Tensor]], call: Callable, scales: list[list[float]]
    ) -> list[tuple[int, Stash, list[tuple]]]:
        """Keep microbatch ``mb``'s inputs; at the step's last forward, every microbatch's ``(mb, stash,
        outputs)`` with the step's statistics. ``call(envs, mb)``: the stage's program on them."""
        if len(envs) != 1:
            raise BatchCouplingError("a batch tail runs whole microbatches (sub_microbatches=1)")
        if len({round(s, 15) for row in scales for s in row}) > 1:
            raise BatchCouplingError(
                "a batch tail takes the batch's statistics as the mean of the microbatches' (equal shares): the "
                "pieces are weighed unequally here (loss_weight); leave loss_weight to the loss's own mean"
            )
        self.pending[mb] = envs[0]
        if len(self.pending) < self.microbatches:
            return []
        pending, self.pending = sorted(self.pending.items()), {}
        k = len(self.inputs)
        with torch.no_grad():  # each microbatch's own statistics (the tail's inputs are not read for them)
            blank = {n: torch.zeros(shape, dtype=dtype) for n, shape, dtype in self.inputs}
            own = [call([{**env, **blank}], m)[0][-k:] for m, env in pending]
        step = {n: torch.stack([o[i].to(d) for o in own]).mean(0) for i, (n, _, d) in enumerate(self.inputs)}
        out = []
        for m, env in pending:
            leaves = {**env, **step}
            outs = call([leaves], m)
            stash = Stash([leaves])
            stash.outputs = outs
            out.append((m, stash, outs))
        return out


def install_tail(
    builder, program: Program, schedule: Schedule, stages: dict, runners: dict, sub: int, overlap_tp: bool = True
) -> Tail | None:
    """Rebuild this rank's last stage (when it holds it) to read the step's statistics (``tail_program``) and
    give its runner the ``StageTail``; the ``Tail`` every rank runs the step with, or ``None``."""
    tail = step_tail(program, schedule, sub)
    last = schedule.num_stages - 1
    if tail is None or last not in runners:
        return tail
    sp = stages[last]
    prog = tail_program(sp.program, tail)
    runner = runners[last]
    runner.whole = builder.part(prog, f"stage{last}.tail", overlap_tp)
    mesh = prog.mesh
    names = set(tail.inputs)
    inputs = [(v.name, v.type.local_shape(mesh), v.type.torch_dtype) for v in prog.inputs if v.name in names]
    runner.tail = StageTail(tail, inputs, schedule.num_microbatches)
    return tail


__all__ = ["TAIL_SCHEDULES", "StageTail", "install_tail", "runs_tail", "step_tail"]
