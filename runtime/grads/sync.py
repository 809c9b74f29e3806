"""Gradient reductions of one rank: data-parallel sync in overlapped buckets, tied parameters across pipelines, ZeRO.

Every parameter's ``grad_sync`` axes (set by insert-collectives: its gradient is a partial sum over
them) are all-reduced once per step, in the flat buckets of ``solver/sharding/buckets.py`` (per axis, in the
order the backward finishes the gradients, closed at ``TrainingSetup.bucket_cap_mb``), as DDP does:

- **Launch.** A post-accumulate-grad hook on each parameter counts its accumulations in the backward
  that finishes its gradient: a backward the user runs on ``forward``'s outputs, or in
  ``train_step`` the rank's last ``B``/``W`` of a stage using the parameter (``arm``; the other
  microbatches' backwards only accumulate, DDP's ``no_sync``). Once every gradient of a bucket is
  final, the bucket's asynchronous all-reduce starts (buckets of an axis in their order), while the
  backward goes on. A bucket over a second axis of a parameter synced over two starts after the
  first axis's sums are back.
- **Wait.** At the end of the user's backward (a callback the first accumulation queues, DDP's place)
  or at the stage's ``REDUCE_GRADS`` in ``train_step`` (the parameters whose last stage on this rank
  it is): the buckets not started yet start, all are waited, in order, and the sums are copied back
  into ``.grad``; tied parameters at ``STEP``, after their sum over the pipeline ranks holding them
  (Megatron's embedding group: one process group per set of holders and coordinate of the other
  axes).
- **Exactness.** A bucket carries each gradient once it is final, so the sums equal those of an
  all-reduce after the backward. "Final" is one accumulation in that backward, or as many as the
  last step saw: a parameter accumulated twice there (recomputation's two parts, sub-pipelined
  halves, a split W) makes its started bucket stale, and the bucket is all-reduced again at the wait
  with the whole gradient; the next steps wait for that count.

Axes that ZeRO reduces itself are skipped: ZeRO-3's gather reduce-scatters its slices over the ZeRO
and replica axes in its backward; ``ZeroOptimizer`` (ZeRO-1/2, MiCS) reduce-scatters at its step.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import PipelineError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import Program
from autopar.passes.stage_program import StageProgram, stage_program
from autopar.runtime.build.precision import cast_to
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.pending import Pending, start_grad_bucket
from autopar.runtime.comm.teardown import holds_groups
from autopar.runtime.comm.watch import guarded
from autopar.schedule.actions import Action, Kind, Schedule
from autopar.solver.sharding.buckets import Bucket, backward_order, grad_buckets
from autopar.solver.sharding.cost import BUCKET_BYTES

ALL = "all"  # the sync key of a backward the user runs: every synced parameter


class _Sync:
    """One reduction point's buckets in flight: which are final, started, stale."""

    def __init__(self, key: Any, buckets: list[Bucket], params: dict[str, torch.nn.Parameter]):
        self.key, self.buckets = key, buckets
        self.params = [[params[n] for n in b.names] for b in buckets]
        self.left = [len(b.names) for b in buckets]  # gradients not final yet
        self.pending: list[Pending | None] = [None] * len(buckets)
        self.stale = [False] * len(buckets)
        self.of: dict[str, list[int]] = {}  # parameter -> its buckets
        first_axis: dict[str, str] = {}
        for i, b in enumerate(buckets):
            for n in b.names:
                self.of.setdefault(n, []).append(i)
                first_axis.setdefault(n, b.axis)
        # a bucket may start in the backward if none of its parameters is synced over an earlier axis
        self.early = [all(first_axis[n] == b.axis for n in b.names) for b in buckets]
        self.order: dict[str, list[int]] = {}
        for i, b in enumerate(buckets):
            self.order.setdefault(b.axis, []).append(i)
        self.next = {axis: 0 for axis in self.order}  # per axis: the first bucket not started


class GradSync:
    """The reductions of ``params`` (name -> this rank's parameter, a ZeRO-3 slice where it has one)."""

    def __init__(
        self,
        program: Program,
        params: dict[str, torch.nn.Parameter],
        comm: Comm,
        skip: Callable[[str, str], bool],
        sync_at: dict[int, list[str]] | None = None,
        tied: dict[str, tuple[int, ...]] | None = None,
        tie_groups: dict[tuple[int, ...], Any] | None = None,
        final: dict[tuple[Kind, int, int], list[str]] | None = None,
        bucket_bytes: float = BUCKET_BYTES,
    ):
        self.program, self.params, self.comm, self.skip = program, params, comm, skip
        self.sync_at = sync_at or {}
        self.tied = tied or {}
        self.tie_groups = tie_groups or {}
        self.final = final or {}  # (B or W, mb, stage) -> the parameters whose gradient that action finishes
        self.bucket_bytes = bucket_bytes
        self.enabled = True  # the backward hook's; train_step reduces at its own actions
        self._order = backward_order(program)
        self._axes = {v.name: list(v.attrs.get("grad_sync", ())) for v in program.params}
        self._key = {n: s for s, names in self.sync_at.items() for n in names}
        self._name = {id(p): n for n, p in params.items()}
        self._plans: dict[Any, list[Bucket]] = {}
        self._buffers: dict[tuple[Any, int], torch.Tensor] = {}  # (reduction point, bucket) -> its flat buffer
        self._flight: dict[Any, _Sync] = {}
        self._fired: dict[str, int] = {}  # armed parameter -> accumulations so far in its final backward
        self._expect: dict[str, int] = {}  # parameter -> accumulations its final backward makes (default 1)
        self._counted: set[str] = set()  # parameters whose accumulations are counted (install_hooks)
        self._in_graph: dict[Any, list[Bucket]] = {}  # reduction point -> buckets a compiled backward reduces
        self._handles: list = []
        self._summed: dict[str, tuple[weakref.ref, int]] = {}  # parameter -> its .grad as the last wait left it

    @classmethod
    def of(cls, program: Program, schedule: Schedule, pp_rank: int, stages, params, comm, skip, mesh=None,
           bucket_bytes: float = BUCKET_BYTES):  # fmt: skip
        """The reductions of a rank's ``params`` for ``program`` cut by ``schedule`` (``stages``: the
        rank's stage programs; ``mesh``: the DeviceMesh, needed for parameters tied across pipeline ranks)."""
        sync_at, tied = reduction_points(program, schedule, pp_rank, stages)
        groups = {}
        if tied:
            if mesh is None:
                raise PipelineError("parameters are tied across pipeline ranks: give the DeviceMesh (mesh=)")
            groups = tie_groups(mesh, tied, comm.peers.new_group)
        final = final_backwards(schedule.actions[pp_rank], stages, sync_at)
        return cls(program, params, comm, skip, sync_at, tied, groups, final, bucket_bytes)

    def buckets(self, key: Any) -> list[Bucket]:
        """The buckets of a reduction point: a stage (its REDUCE_GRADS), ``ALL`` (a user's backward) or
        ``"tied"`` (STEP), with the axes ZeRO reduces left out."""
        if key not in self._plans:
            if key == ALL:
                names = [n for n in self.params if n not in self.tied]
            elif key == "tied":
                names = [n for n in self.tied if n in self.params]
            else:
                names = [n for n in self.sync_at.get(key, ()) if n in self.params]
            plan = grad_buckets(self.program, self.bucket_bytes, names, self.skip, self._order)
            self._plans[key] = [b for b in plan if b not in self._in_graph.get(key, ())]
        return self._plans[key]

    def hand_over(self, key: Any, present: set[str]) -> list[Bucket]:
        """The buckets of reduction point ``key`` (a stage), if the parameters of every one are in ``present`` (read
        by that stage's compiled program), from now on all-reduced by its compiled backward (``_BucketSync`` in
        runtime/build/compiled.py) and no longer here. Only where one backward per step finishes each gradient
        in one graph, its last microbatch's, which adds the earlier microbatches' gradients before it sums (the
        caller's to know: no split backward, no recomputation, no sub-microbatches)."""
        mine = self.buckets(key)
        if not mine or any(not set(b.names) <= present for b in mine):
            return []  # all of them or none (a second axis's bucket starts after the first's sums)
        self._in_graph.setdefault(key, []).extend(mine)
        self._plans.pop(key, None)
        self.install_hooks()
        return mine

    def replan(self) -> None:
        """Forget the buckets (an optimizer that reduces some gradients itself was attached)."""
        self._plans.clear()
        self._buffers.clear()
        self.install_hooks()

    # -- launching ----------------------------------------------------------------------------------
    def _state(self, key: Any) -> _Sync:
        if key not in self._flight:
            self._flight[key] = _Sync(key, self.buckets(key), self.params)
        return self._flight[key]

    def _flat(self, st: _Sync, i: int) -> torch.Tensor:
        """Bucket ``i``'s buffer, made once and kept (DDP keeps its buckets): the gradients become its slices."""
        flat = self._buffers.get((st.key, i))
        if flat is None:
            p = st.params[i][0]
            dtype = self.comm.grad_dtype or p.dtype
            flat = torch.empty(sum(q.numel() for q in st.params[i]), dtype=dtype, device=p.device)
            self._buffers[(st.key, i)] = flat
        return flat

    def _launch(self, st: _Sync, i: int) -> None:
        group = self.comm.groups[st.buckets[i].axis]
        st.pending[i] = start_grad_bucket(st.params[i], group, self._flat(st, i))

    def _final(self, st: _Sync, name: str) -> None:
        for i in st.of.get(name, ()):
            st.left[i] -= 1
        for axis, idx in st.order.items():  # start the ready buckets of each axis, in their order
            while st.next[axis] < len(idx) and st.early[idx[st.next[axis]]] and not st.left[idx[st.next[axis]]]:
                self._launch(st, idx[st.next[axis]])
                st.next[axis] += 1

    def _start_backward(self) -> None:
        """A user's backward began (its outputs' gradient is being computed): every gradient is final
        in it; the buckets are waited when it ends (a queued callback, DDP's place)."""
        if self.enabled and ALL not in self._flight:
            self._fired.update({n: 0 for n in self._state(ALL).of if n in self._counted})
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.wait(ALL))

    def watch(self, outputs) -> None:
        """Start the sync of a user's backward through any of ``outputs`` (the forward's tensors)."""
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _g: self._start_backward())

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        name = self._name.get(id(p))
        if name is None:
            return
        self._start_backward()  # a backward that did not pass through the forward's outputs
        if name not in self._fired:
            return
        key = ALL if ALL in self._flight else self._key.get(name)
        st = self._state(key)
        self._fired[name] += 1
        expect = self._expect.get(name, 1)
        if self._fired[name] == expect:
            self._final(st, name)
        elif self._fired[name] > expect:  # accumulated again: a started bucket is stale, and later steps wait longer
            self._expect[name] = self._fired[name]
            for i in st.of.get(name, ()):
                st.stale[i] = st.pending[i] is not None
                flat = self._buffers.get((st.key, i))  # started: its buffer exists
                if st.stale[i] and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                    raise PipelineError(
                        f"the gradient of {name} accumulated into its bucket while the bucket's all-reduce was in "
                        "flight (its gradient was still the bucket's slice from the last step): set the gradients "
                        "to None between steps (optimizer.zero_grad(), the default set_to_none=True)"
                    )

    def reset(self, enabled: bool = True) -> None:
        """Before a forward or ``train_step``: forget what a step that raised left in flight;
        ``enabled=False``: ``train_step`` arms its own backwards."""
        self._flight.clear()
        self._fired.clear()
        self._summed.clear()
        self.enabled = enabled

    def arm(self, a: Action) -> None:
        """Before a ``B``/``W`` of ``train_step``: the gradients that action finishes start counting."""
        for n in self.final.get((a.kind, a.mb, a.stage), ()):
            if n in self._counted and n in self._state(self._key[n]).of:
                self._fired[n] = 0

    # -- waiting ------------------------------------------------------------------------------------
    def wait(self, key: Any) -> None:
        """Start what is not started (and again what is stale), wait every bucket of ``key`` in order,
        an axis's sums back before the next axis's buckets start."""
        st = self._flight.pop(key, None) or _Sync(key, self.buckets(key), self.params)
        for idx in st.order.values():
            for i in idx:
                if st.pending[i] is not None and st.stale[i]:
                    st.pending[i].wait_only()  # sums of a gradient that grew since: dropped
                    st.pending[i] = None
                if st.pending[i] is None:
                    self._launch(st, i)
            for i in idx:
                st.pending[i].wait()
        for n in st.of:
            fired = self._fired.pop(n, None)
            if fired is not None and 0 < fired < self._expect.get(n, 1):
                self._expect[n] = fired
        names = [n for n in self.params if n not in self.tied] if key == ALL else self.sync_at.get(key, ())
        for n in names:  # the sums as they stand now (a compiled backward's in-graph buckets' included)
            g = self.params[n].grad if n in self.params else None
            if g is not None:
                self._summed[n] = (weakref.ref(g), g._version)

    def world_identical(self) -> bool:
        """Whether every gradient of this rank is, bit for bit, the same tensor on every rank: each one was summed
        over every axis of the mesh (pure data parallelism: nothing sharded, no ZeRO, no pipeline, nothing tied)
        by the last wait, and has not changed since (the same tensor, its version unchanged: no accumulation, no
        in-place edit). A sum that one rank's NaN or inf entered is then NaN or inf on every rank, so each rank's
        own look at its gradients is already the world's (``NonFinite.step_ok``'s ``agreed``)."""
        world = math.prod(self.comm.sizes.values())
        if world <= 1 or self.tied or not dist.is_initialized() or dist.get_world_size() != world:
            return False
        for n, p in self.params.items():
            axes = [a for a in self._axes.get(n, ()) if not self.skip(n, a)]
            if math.prod(self.comm.sizes.get(a, 1) for a in axes) != world:
                return False
            seen = self._summed.get(n)
            if seen is None or p.grad is None or seen[0]() is not p.grad or seen[1] != p.grad._version:
                return False
        return True

    def reduce_stage(self, stage: int) -> None:
        """REDUCE_GRADS: the parameters whose last backward on this rank is ``stage``'s."""
        self.wait(stage)

    def reduce_tied(self) -> None:
        """STEP: tied parameters' gradients summed over the pipeline ranks holding them, then synced."""
        tied = sorted(n for n in self.tied if n in self.params)
        for holders in sorted({self.tied[n] for n in tied}):
            params = [self.params[n] for n in tied if self.tied[n] == holders]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = cast_to(torch.cat([g.reshape(-1) for g in grads]), self.comm.grad_dtype)
            group = self.tie_groups[holders]
            guarded(group, "pp", "all_reduce (tied gradients)", dist.all_reduce, flat, group=group)
            for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
                p.grad = chunk.view_as(p).to(p.dtype, copy=True)
        if tied:
            self.wait("tied")

    # -- after a user's backward ------------------------------------------------------------------
    def install_hooks(self) -> None:
        """Count the gradient accumulations of the parameters in buckets that can start during the
        backward (each starts when its gradients are final). An axis's last bucket starts at the wait
        anyway, after the backward's last gradient: its parameters get no hook (a Python call per
        parameter per backward, about 1% of GPT-2's dp=2 step when every parameter had one)."""
        for handle in self._handles:
            handle.remove()
        counted: set[str] = set()
        for key in (ALL, *self.sync_at):
            buckets = self.buckets(key)
            for idx in _Sync(key, buckets, self.params).order.values():  # an axis's buckets, in order
                counted.update(n for i in idx[:-1] for n in buckets[i].names)
        self._counted = counted
        self._handles = [self.params[n].register_post_accumulate_grad_hook(self._on_grad) for n in sorted(counted)]


def final_backwards(
    actions, stages: dict[int, StageProgram], sync_at: dict[int, list[str]]
) -> dict[tuple[Kind, int, int], list[str]]:
    """(B or W, mb, stage) -> the synced parameters whose gradient that action of the rank's list
    ``actions`` finishes: its last backward action of a stage using the parameter."""
    last: dict[str, tuple[Kind, int, int]] = {}
    for a in actions:
        if a.kind in (Kind.B, Kind.W) and a.stage in stages:
            for n in stages[a.stage].param_names:
                last[n] = (a.kind, a.mb, a.stage)
    out: dict[tuple[Kind, int, int], list[str]] = {}
    for names in sync_at.values():
        for n in names:
            if n in last:
                out.setdefault(last[n], []).append(n)
    return out


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


def tie_groups(mesh, tied: dict[str, tuple[int, ...]], new_group=dist.new_group) -> dict[tuple[int, ...], Any]:
    """One process group per set of pipeline ranks sharing a tied parameter, per coordinate of the
    other axes of ``mesh`` (a DeviceMesh; every rank creates every group, in the same order, as
    ``new_group`` requires; the rank simulator's ``new_group`` and mesh stand in for torch's)."""
    names = mesh.mesh_dim_names
    pp_index = names.index(PIPELINE_AXIS)
    groups: dict[tuple[int, ...], Any] = {}
    me = mesh.get_rank()
    others = [range(mesh.size(i)) for i in range(len(names)) if i != pp_index]
    for holders in sorted(set(tied.values())):
        for rest in itertools.product(*others):
            ranks = []
            for p in holders:
                c = list(rest)
                c.insert(pp_index, p)
                ranks.append(int(mesh.mesh[tuple(c)]))
            g = new_group(ranks)
            if me in ranks:
                groups[holders] = g
    return groups


holds_groups(GradSync, lambda sync: sync.tie_groups.clear())

__all__ = ["ALL", "GradSync", "final_backwards", "reduction_points", "tie_groups"]
