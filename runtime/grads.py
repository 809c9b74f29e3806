"""Gradient reductions of one rank: data-parallel sync, tied parameters across pipeline ranks, ZeRO.

Every parameter's ``grad_sync`` axes (set by insert-collectives: its gradient is a partial sum over
them) are all-reduced once per step, in one flat bucket per axis (``collectives.sync_grads``):

- in ``train_step``, at each stage's ``REDUCE_GRADS`` for the parameters whose last user on this
  rank that stage is, and at ``STEP`` for tied parameters after their sum over the pipeline ranks
  holding them (Megatron's embedding group: one process group per set of holders and coordinate of
  the other axes);
- after a backward the user runs on ``forward``'s outputs (a one-stage pipeline), at the end of that
  backward (``hook``: the first accumulated gradient queues one callback, DDP's place).

Axes that ZeRO reduces itself are skipped: ZeRO-3's gather reduce-scatters its slices over the ZeRO
and replica axes in its backward; ``ZeroOptimizer`` (ZeRO-1/2, MiCS) reduce-scatters at its step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import PipelineError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import Program
from autopar.passes.stage_program import StageProgram, stage_program
from autopar.runtime import collectives as coll
from autopar.runtime.actions import Kind, Schedule
from autopar.runtime.precision import cast_to


class GradSync:
    """The reductions of ``params`` (name -> this rank's parameter, a ZeRO-3 slice where it has one)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        grad_sync: dict[str, list[str]],
        comm: coll.Comm,
        skip: Callable[[str, str], bool],
        sync_at: dict[int, list[str]] | None = None,
        tied: dict[str, tuple[int, ...]] | None = None,
        tie_groups: dict[tuple[int, ...], Any] | None = None,
    ):
        self.params, self.grad_sync, self.comm, self.skip = params, grad_sync, comm, skip
        self.sync_at = sync_at or {}
        self.tied = tied or {}
        self.tie_groups = tie_groups or {}
        self.enabled = True  # the backward hook's; train_step reduces at its own actions
        self._queued = False

    @classmethod
    def of(cls, program: Program, schedule: Schedule, pp_rank: int, stages, params, grad_sync, comm, skip, mesh=None):
        """The reductions of a rank's ``params`` for ``program`` cut by ``schedule`` (``stages``: the
        rank's stage programs; ``mesh``: the DeviceMesh, needed for parameters tied across pipeline ranks)."""
        sync_at, tied = reduction_points(program, schedule, pp_rank, stages)
        groups = {}
        if tied:
            if mesh is None:
                raise PipelineError("parameters are tied across pipeline ranks: give the DeviceMesh (mesh=)")
            groups = tie_groups(mesh, tied)
        return cls(params, grad_sync, comm, skip, sync_at, tied, groups)

    def by_axis(self, names) -> dict[str, list[torch.nn.Parameter]]:
        out: dict[str, list[torch.nn.Parameter]] = {}
        for n in names:
            for axis in self.grad_sync.get(n, ()):
                if not self.skip(n, axis):
                    out.setdefault(axis, []).append(self.params[n])
        return out

    def sync(self, names) -> None:
        with coll.use_comm(self.comm):
            coll.sync_grads(self.by_axis(names))

    def reduce_stage(self, stage: int) -> None:
        """REDUCE_GRADS: the parameters whose last backward on this rank is ``stage``'s."""
        self.sync(self.sync_at.get(stage, ()))

    def reduce_tied(self) -> None:
        """STEP: tied parameters' gradients summed over the pipeline ranks holding them, then synced."""
        tied = sorted(n for n in self.tied if n in self.params)
        for holders in sorted({self.tied[n] for n in tied}):
            params = [self.params[n] for n in tied if self.tied[n] == holders]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = cast_to(torch.cat([g.reshape(-1) for g in grads]), self.comm.grad_dtype)
            dist.all_reduce(flat, group=self.tie_groups[holders])
            for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
                p.grad = chunk.view_as(p).to(p.dtype, copy=True)
        self.sync(tied)

    # -- after a user's backward ------------------------------------------------------------------
    def install_hooks(self) -> None:
        """Sync every parameter at the end of each backward that accumulates a gradient into one."""
        for n, p in self.params.items():
            if self.grad_sync.get(n):
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _p) -> None:
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._sync_all)

    def _sync_all(self) -> None:
        self._queued = False
        self.sync(list(self.params))


def reduction_points(
    program: Program, schedule: Schedule, pp_rank: int, stages: dict[int, StageProgram]
) -> tuple[dict[int, list[str]], dict[str, tuple[int, ...]]]:
    """(stage -> the synced parameters whose last backward on rank ``pp_rank`` is that stage's, tied
    parameter -> the pipeline ranks holding it) for ``program`` cut by ``schedule``; ``stages``: this
    rank's stage programs."""
    holders: dict[str, set[int]] = {}
    if schedule.num_ranks > 1:
        for s in range(schedule.num_stages):
            for n in stage_program(program, s).param_names:
                holders.setdefault(n, set()).add(schedule.stage_to_rank[s])
    tied = {n: tuple(sorted(r)) for n, r in holders.items() if len(r) > 1}
    last_user: dict[str, int] = {}
    for a in schedule.actions[pp_rank]:
        if a.kind is Kind.REDUCE_GRADS and a.stage in stages:
            for n in stages[a.stage].param_names:
                last_user[n] = a.stage
    values = {v.name: v for v in program.inputs}
    sync_at: dict[int, list[str]] = {}
    for n in sorted(last_user):
        if values[n].attrs.get("grad_sync") and n not in tied:
            sync_at.setdefault(last_user[n], []).append(n)
    return sync_at, tied


def tie_groups(mesh, tied: dict[str, tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
    """One process group per set of pipeline ranks sharing a tied parameter, per coordinate of the
    other axes of ``mesh`` (a DeviceMesh; every rank creates every group, in the same order, as
    ``new_group`` requires)."""
    names = mesh.mesh_dim_names
    pp_index = names.index(PIPELINE_AXIS)
    groups: dict[tuple[int, ...], Any] = {}
    me = dist.get_rank()
    others = [range(mesh.size(i)) for i in range(len(names)) if i != pp_index]
    for holders in sorted(set(tied.values())):
        for rest in itertools.product(*others):
            ranks = []
            for p in holders:
                c = list(rest)
                c.insert(pp_index, p)
                ranks.append(int(mesh.mesh[tuple(c)]))
            g = dist.new_group(ranks)
            if me in ranks:
                groups[holders] = g
    return groups


__all__ = ["GradSync", "reduction_points", "tie_groups"]
