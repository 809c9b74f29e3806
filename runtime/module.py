"""ParallelModule: one rank's share of a compiled model, the same class on every mesh.

A mesh without a pipeline axis is a one-stage pipeline run by the same code. The module is built from
two planned programs of the whole model (stages and transfers already in them): ``forward`` keeps
every output of the model, ``train`` only the loss (``None`` when the first output is no scalar
float). Both cut the model at the same places and share every parameter, so this rank materializes
each of its parameter shards once (``runtime/build/params.py``), registered under the user's names.

- ``forward(*args, **kwargs)`` returns the model's outputs. On one stage it runs with autograd (the
  user may call ``backward()``; gradients are synced at its end, ``runtime/grads/sync.py``), the batch
  cut into the microbatches and their outputs merged (``runtime/call/batch.py``). On a pipeline it runs
  forward only through the stages and broadcasts the outputs over the pipeline axis. ``eval()``
  turns dropout off.
- ``train_step(*args, **kwargs)`` runs the schedule (``runtime/execute/executor.py``): every microbatch's
  forward and backward, recomputation, sub-pipelined tensor parallelism, gradient reduction, clipping
  and the optimizer ``make_optimizer`` attached; it returns the step's loss on every rank.
- The batch is the global one, or this rank's data-parallel shard (``RuntimeOptions.batch``,
  ``runtime/call/inputs.py``); ``data_layout`` says which rows a rank takes.
- ZeRO-1/2 and MiCS through ``make_optimizer`` (``runtime/grads/optimizer.py``, ``runtime/grads/zero.py``), with
  parameter groups by the user's names; ZeRO-3 keeps only this rank's slices and gathers them one
  unit (a repeated block, or the root) at a time, with prefetch, in forward and backward
  (``runtime/grads/zero3.py``). ``clip_grad_norm_``:
  ``runtime/grads/clip.py``.
- ``full_state_dict()``: every key of the user's ``model.state_dict()``, whole, on every rank; it and
  the inspection properties (``stages``, ``trace``, ``measured()``) are in ``runtime/views.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from autopar.errors import BatchCouplingError, OptimizerError, PipelineError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import Program
from autopar.passes.batch_coupling import microbatching_refusal
from autopar.passes.describe import describe_plan
from autopar.passes.stage_program import StageProgram
from autopar.runtime.build.compiled import compile_rank, mesh_eager_parts
from autopar.runtime.build.params import LocalTensors, register
from autopar.runtime.build.precision import LossScaler, MixedPrecisionPolicy, cast_floats
from autopar.runtime.build.rng import DropoutRng
from autopar.runtime.build.stages import StageBuilder, forward_schedule, recompute_fractions
from autopar.runtime.call.batch import LossWeight, loss_scales, merge_outputs, step_loss, take_rows
from autopar.runtime.call.inputs import CallInputs, stage_reads
from autopar.runtime.call.loss_weight import program_weight
from autopar.runtime.call.outputs import batch_outputs, broadcast_outputs, broadcast_weights
from autopar.runtime.call.pipeline_guard import refuse_backward
from autopar.runtime.comm import watch
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.comm.lazy import Deferred, settle
from autopar.runtime.comm.teardown import holds_groups
from autopar.runtime.comm.watch import guarded
from autopar.runtime.execute.batch_tail import install_tail
from autopar.runtime.execute.executor import Executor
from autopar.runtime.execute.stage_runner import StageRunner
from autopar.runtime.grads import clip
from autopar.runtime.grads.node_gather import ranks_per_node
from autopar.runtime.grads.nonfinite import NonFinite
from autopar.runtime.grads.optimizer import ParamGroups, build_optimizer, resolve_groups, user_names
from autopar.runtime.grads.sync import GradSync
from autopar.runtime.grads.zero import ZeroOptimizer
from autopar.runtime.grads.zero3 import shard_zero3
from autopar.runtime.measure.metrics import StepMeter
from autopar.runtime.views import ModuleViews
from autopar.schedule.actions import Kind, Schedule, split_backwards
from autopar.solver.sharding.cost import TrainingSetup

MICROBATCH_SEMANTICS = ("exact", "per_microbatch")  # RuntimeOptions.microbatch_semantics


@dataclass(frozen=True)
class RuntimeOptions:
    """How the module runs (besides its programs, schedule and training setup)."""

    microbatches: int = 1
    timeout: float = 600.0  # seconds any transfer may take before the step fails with RuntimeCommError
    record: bool = True  # record every action's start and end in train_step
    # Merak's sub-pipelined tensor parallelism: each microbatch runs as two halves, one communicating
    # while the other computes; the stages are built for a half
    sub_pipeline_tp: bool = False
    batch: str = "global"  # "global": every rank is given the whole batch; "local": its data-parallel shard
    # each piece's weight in the step's loss: "auto" the divisor of a loss that is a mean over items of the
    # data (runtime/call/loss_weight.py), a function of the piece's inputs, or None (equal pieces)
    loss_weight: LossWeight | str | None = "auto"
    precision: MixedPrecisionPolicy | None = None  # mixed precision (runtime/build/precision.py); None: as captured
    # "exact": a loss that couples the batch (passes/batch_coupling.py) is refused more than one piece;
    # "per_microbatch": each piece is trained as its own batch
    microbatch_semantics: str = "exact"
    torch_compile: bool = False  # each program through torch.compile / Inductor (runtime/build/compiled.py)
    on_nonfinite: str = "warn_skip"  # a step with NaN/inf gradients: "warn_skip", "skip", "raise" (grads/nonfinite.py)
    # ranks each node runs (global ranks node by node): a ZeRO-3 group spanning nodes is gathered hierarchically
    # where the plan says so (setup.hierarchical_gather; runtime/grads/node_gather.py); None: torchrun's
    # LOCAL_WORLD_SIZE, else one node
    ranks_per_node: int | None = None

    @property
    def sub_microbatches(self) -> int:
        return 2 if self.sub_pipeline_tp else 1


class ParallelModule(ModuleViews, torch.nn.Module):
    """This rank's stages of the model: call it with the whole batch, as the original module."""

    def __init__(
        self,
        forward: Program,
        train: Program | None,
        schedule: Schedule,
        in_spec,
        out_spec,
        comm: Comm,
        get_value,
        device: torch.device | str,
        setup: TrainingSetup | None = None,
        options: RuntimeOptions | None = None,
        *,
        mesh=None,
        rng: DropoutRng | None = None,
        state: tuple[dict[str, str], dict[str, torch.Tensor]] | None = None,
        leaves: tuple[int, ...] | None = None,
    ):
        """``forward``/``train``: the planned programs (``stage=`` on every op, send/recv between
        stages); ``get_value(name)``: a parameter or buffer's whole value (only this rank's shard is
        kept); ``mesh``: the DeviceMesh, needed on a pipeline with parameters tied across its ranks;
        ``rng``: the keyed dropouts' state; ``state``: the user's state-dict keys -> program values and
        the whole values of keys no program reads (``runtime/build/params.state_keys``; default: the
        programs' own names); ``leaves``: where each input of the programs is among the call's
        flattened inputs (needed for local batches)."""
        super().__init__()
        self.setup = setup or TrainingSetup()
        self.options = options = options or RuntimeOptions()
        policy = options.precision
        if policy is not None:  # gradients reduced in reduce_dtype; fp16's loss scaling in train_step
            comm = dataclasses.replace(comm, grad_dtype=policy.reduce_dtype)
        self.loss_scaler = LossScaler(policy.scaling) if policy is not None and policy.scaling else None
        self.nonfinite = NonFinite(options.on_nonfinite)  # a NaN step never applied (runtime/grads/nonfinite.py)
        self.comm = comm
        self.model_config = None  # the model's transformers config, if any (compile sets it): save_pretrained's
        self.device_mesh = mesh  # the DeviceMesh it runs on (None on the rank simulator): as_dtensors' mesh
        self.device = torch.device(device)
        self.program, self.train_program = forward, train
        self.dropout_rng = rng
        self._schedule = schedule
        self._in_spec, self._out_spec = in_spec, out_spec
        self._values = {v.name: v for v in forward.inputs}
        self._pp_group = comm.groups.get(PIPELINE_AXIS)
        self._pp_rank = comm.coords.get(PIPELINE_AXIS, 0)
        self._optimizer = None
        self._clip: tuple[float, float] | None = None  # make_optimizer's (max_grad_norm, norm_type)
        self._output_dtype = policy.output_dtype if policy is not None else None
        self._stepped = False  # train_step stepped the attached optimizer since the last forward
        self._in_step = False  # train_step is stepping the attached optimizer (its NaN check already made)
        self._checked = False  # train_step checked the gradients for the caller's own optimizer since the forward
        self._covers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> over my parameters?
        self._sync = True  # backwards of forward's outputs sync gradients (no_sync turns it off)
        self._deferred: list[weakref.ref] = []  # the last forward's outputs still in flight (runtime/comm/lazy.py)
        self.grad_norm: torch.Tensor | None = None  # the total gradient norm the last clipping saw
        self.metrics: StepMeter | None = None  # times each train_step (runtime/measure/metrics.py); compile sets it
        mine = schedule.stages_of_rank(self._pp_rank)
        self._local = LocalTensors(self, get_value, forward.mesh, comm.coords, self.device)
        builder = StageBuilder(comm.coords, self._local, self.device, rng, comm.rank)
        # f fused with its matmuls (runtime/comm/column_linear.py) needs one backward through them, not cut or
        # split: the forward programs run whole (never sub-pipelined, backward by the user's own call)
        self.forward_runners, _ = builder.runners(forward, mine, {}, "forward")
        self.train_runners: dict[int, StageRunner] = {}
        self._stages: dict[int, StageProgram] = {}
        if train is not None:
            fractions = recompute_fractions(schedule, self._pp_rank)
            split = any(split_backwards(actions) for actions in schedule.actions)
            overlap_tp = not (options.sub_pipeline_tp or split)
            self.train_runners, self._stages = builder.runners(train, mine, fractions, "stage", overlap_tp)
        self._tail = None  # a coupled loss made exact over the step (runtime/execute/batch_tail.py)
        if train is not None and options.microbatch_semantics == "exact":
            runners, sub = self.train_runners, options.sub_microbatches
            self._tail = install_tail(builder, train, schedule, self._stages, runners, sub, overlap_tp)
        self._builder = builder
        self._setup_inputs(leaves)
        self._state = state
        # ZeRO-3: this rank's 1/k slices of the data-parallel-replicated parameters take their places
        params = self._local.params
        # hierarchical ZeRO-3 gathers across nodes only where the plan runs them (setup.hierarchical_gather)
        per_node = ranks_per_node(options.ranks_per_node) if self.setup.hierarchical_gather else None
        self.zero3 = shard_zero3(self.setup, forward, params, comm, builder.modules.values(), per_node, mesh)
        for n in self.zero3.names if self.zero3 is not None else ():
            params[n] = self.zero3.slice_of(n)
            register(self, n, params[n])
        self._params = params
        self._param_ids = {id(p) for p in params.values()}
        # any torch optimizer over these parameters stepped by the caller (the plain loop) checks them first
        hook = register_optimizer_step_pre_hook(_own_optimizer_hook(weakref.ref(self)))
        weakref.finalize(self, hook.remove)
        self._sync_axes = {n: list(self._values[n].attrs.get("grad_sync", ())) for n in params}  # partial-sum axes
        # where each gradient is reduced: its stage's REDUCE_GRADS, or STEP for tied parameters
        self._grads = GradSync.of(
            train or forward, schedule, self._pp_rank, self._stages, params, comm, self._skip_sync, mesh,
            self.setup.bucket_bytes,
        )  # fmt: skip
        self._grads.install_hooks()
        self.compile_log = None  # what torch_compile compiled and ran eagerly (runtime/build/compiled.py)
        if options.torch_compile:
            split = any(split_backwards(actions) for actions in schedule.actions)
            sub = options.sub_pipeline_tp
            buckets = self._graph_buckets(split)
            last = self._last_microbatches(buckets)
            notes = mesh_eager_parts(comm.sizes, self.setup.zero, sub, split, graph_buckets=bool(buckets))
            self.compile_log = compile_rank(
                self.forward_runners, self.train_runners, comm, sub, split, notes, buckets, last
            )  # fmt: skip
        context = (lambda _s: self.zero3.scope()) if self.zero3 is not None else None
        peer = self._peer_rank
        n = options.microbatches * options.sub_microbatches
        self._one_stage = schedule.num_stages == 1
        self._forward_executor = None
        if not self._one_stage:
            self._forward_executor = Executor(
                forward_schedule(schedule, n), self._pp_rank, self.forward_runners, peer, comm,
                _nothing, _nothing, timeout=options.timeout, record=False, device=self.device,
                keep_outputs=True, stage_context=context,
            )  # fmt: skip
        self._executor = None
        if train is not None:
            self._executor = Executor(
                schedule, self._pp_rank, self.train_runners, peer, comm, self._grads.reduce_stage, self._step,
                timeout=options.timeout, record=options.record, device=self.device,
                sub_microbatches=options.sub_microbatches, stage_context=context, arm=self._grads.arm,
            )  # fmt: skip

    # -- construction helpers --------------------------------------------------------------------
    def _graph_buckets(self, split: bool) -> dict[int, list[tuple[str, list[str]]]]:
        """Under ``torch_compile``: per stage, the gradient buckets its compiled backward all-reduces itself
        (start early, wait late: ``_BucketSync`` in runtime/build/compiled.py), taken from ``GradSync``: the
        backward of the stage's last microbatch of a step, the earlier microbatches' gradients added in
        (``_last_microbatches``). Only where that backward finishes every gradient of the stage in one graph:
        no split backward, no recomputation, no sub-pipelining or sub-microbatches, no ZeRO or MiCS (which
        reduce themselves) and no batch tail; elsewhere the buckets start from the accumulation hooks, after a
        compiled region's end."""
        o = self.options
        if split or o.sub_pipeline_tp or self._tail is not None or o.sub_microbatches != 1:
            return {}
        if self.setup.zero or self.setup.mics_group is not None:
            return {}
        out: dict[int, list[tuple[str, list[str]]]] = {}
        for s, runner in self.train_runners.items():
            if runner.variants:
                continue
            gm = runner.whole.module
            attrs: dict[str, str] = {}  # parameter name -> the attribute the stage's module reads it by
            by_id = {id(p): n for n, p in self._params.items()}
            for node in gm.graph.nodes:
                if node.op == "get_attr" and id(operator.attrgetter(node.target)(gm)) in by_id:
                    attrs[by_id[id(operator.attrgetter(node.target)(gm))]] = node.target
            handed = self._grads.hand_over(s, set(attrs))
            if handed:
                out[s] = [(b.axis, [attrs[n] for n in b.names]) for b in handed]
        return out

    def _last_microbatches(self, buckets: dict) -> dict[int, int]:
        """Per stage of ``buckets`` where a step runs several microbatches: the microbatch of its last backward on
        this rank (the one whose compiled program reduces the buckets; the ones before only accumulate)."""
        if self._schedule.num_microbatches == 1:
            return {}
        last = {a.stage: a.mb for a in self._schedule.actions[self._pp_rank] if a.kind is Kind.B}
        return {s: last[s] for s in buckets}

    def _peer_rank(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's pipeline."""
        return self.comm.peers.global_rank(self._pp_group, self._schedule.stage_to_rank[stage])

    def _skip_sync(self, name: str, axis: str) -> bool:
        """Whether ZeRO reduces ``name``'s gradient over ``axis`` itself."""
        if self.zero3 is not None and self.zero3.manages(name):
            return axis in self.zero3.zero_axes + self.zero3.replica_axes
        opt = self._optimizer
        return isinstance(opt, ZeroOptimizer) and opt.manages(name) and axis in opt.zero_axes + opt.replica_axes

    # -- the optimizer ---------------------------------------------------------------------------
    def make_optimizer(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        param_groups: ParamGroups | None = None,
        *,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer_cls(groups, **kwargs)`` over this rank's parameters as the plan's training setup
        says (``runtime/grads/optimizer.py``: ZeRO-1/2 and MiCS slices, ``param_groups`` by the user's names),
        attached to ``train_step``, which steps it after clipping the global gradient norm to
        ``max_grad_norm`` when given (``grad_norm`` then holds the norm). Unless ``kwargs`` choose an
        implementation (``fused``, ``foreach``), torch's fused kernel where the class has one
        (``runtime/grads/optimizer.py``: ``fused_by_default``). A ``torch.optim`` optimizer built by hand over
        ``parameters()`` trains the same numbers (but for the last bits, where its implementation
        rounds differently) but keeps whole states under ZeRO-1/2, and the caller steps it."""
        groups = resolve_groups(param_groups, *user_names(self.program, self._state))
        self._optimizer = build_optimizer(
            optimizer_cls, groups, self._params, self._sync_axes, self.setup, self.program, self.comm, **kwargs
        )
        self._clip = (max_grad_norm, norm_type) if max_grad_norm is not None else None
        if hasattr(self._optimizer, "_optimizer_step_pre_hooks"):  # on_nonfinite in the plain loop (not ZeRO-1/2)
            self._optimizer.register_step_pre_hook(self._check_before_step)
        self._grads.replan()  # ZeRO-1/2 reduce-scatter their gradients themselves
        return self._optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the gradients' global ``norm_type``
        norm (every element counted once across every mesh axis and ZeRO slice), scaled to at most
        ``max_norm``; returns the norm, on every rank. Call it between the backward (or a ``train_step``
        whose optimizer the caller steps) and the optimizer's step; collective over every rank."""
        if self._stepped:
            raise OptimizerError(
                "train_step already stepped the optimizer make_optimizer attached, so no gradient is left to clip: "
                "give make_optimizer(..., max_grad_norm=...) to clip inside train_step (model.grad_norm holds the norm)"
            )
        pieces = clip.grad_pieces(self._params, self.program, self.comm, self._optimizer, self.zero3, self._grads.tied)
        self.grad_norm = clip.clip_grad_norm_(pieces, max_norm, norm_type, self.comm)
        return self.grad_norm

    def _step(self) -> None:
        """STEP: tied gradients summed and synced, fp16's gradients unscaled (or, after an overflow on any
        rank, dropped: the step is skipped on every rank), then clipping and the attached optimizer's step."""
        self._grads.reduce_tied()
        if self.loss_scaler is not None and not self.loss_scaler.step_ok(self._params, self._optimizer, self.comm):
            return
        if self._optimizer is not None:
            norm = self.clip_grad_norm_(*self._clip) if self._clip is not None else None
            if norm is None and self.metrics is not None and self.metrics.wants_grad_norm:  # measured, not clipped
                pieces = clip.grad_pieces(
                    self._params, self.program, self.comm, self._optimizer, self.zero3, self._grads.tied
                )
                self.grad_norm = norm = clip.global_norm(pieces, 2.0, self.comm)
            if not self.nonfinite.step_ok(self._params, self._optimizer, norm, self._grads.world_identical()):
                return
            self._in_step = True  # checked just above: the optimizer's pre-hook need not agree again
            try:
                self._optimizer.step()
            finally:
                self._in_step = False
            self._optimizer.zero_grad()
        else:  # the caller steps an optimizer of their own next: NaN gradients dropped on every rank first
            self.nonfinite.step_ok(self._params, None, None, self._grads.world_identical())
            self._checked = True

    def _check_own_optimizer(self, optimizer) -> None:
        """A torch optimizer of the caller's over this module's parameters, stepped by the caller (the plain loop:
        ``loss.backward(); opt.step()``): its gradients checked first, agreed by every rank (one all-reduce of a
        flag), as ``make_optimizer``'s are; non-finite ones dropped, so the step changes nothing. Not again after
        ``train_step`` checked them, nor for ``make_optimizer``'s own (its pre-hook does)."""
        if optimizer is self._optimizer or self._in_step or self._checked:
            return
        covers = self._covers.get(optimizer)
        if covers is None:
            groups = getattr(optimizer, "param_groups", ())
            covers = self._covers[optimizer] = any(id(p) in self._param_ids for g in groups for p in g["params"])
        if covers:
            self.nonfinite.step_ok(self._params, optimizer, None, self._grads.world_identical())
            self._checked = True

    def _check_before_step(self, optimizer, _args, _kwargs) -> None:
        """The attached optimizer stepped by the caller (the plain loop: ``loss.backward(); opt.step()``): its
        gradients checked first, agreed by every rank; non-finite ones dropped, so the step changes nothing."""
        if not self._in_step:
            self.nonfinite.step_ok(self._params, optimizer, None, self._grads.world_identical())

    # -- inputs ----------------------------------------------------------------------------------
    def _setup_inputs(self, leaves: tuple[int, ...] | None) -> None:
        """Which inputs each program reads on this rank, who takes which rows, and how calls become pieces."""
        self._reads_forward, self._reads_train = stage_reads(self.forward_runners), stage_reads(self.train_runners)
        self._last = self._schedule.num_stages - 1 in self.forward_runners
        opts = self.options
        pieces, weight = opts.microbatches * opts.sub_microbatches, opts.loss_weight
        if weight == "auto":  # the loss's own divisor when it is a mean over the data's items
            weight = program_weight(self.program, self._builder.part, self.comm, pieces)
        if opts.microbatch_semantics == "exact" and self.train_program is not None:
            tail = self._tail is not None and weight is None  # a batch tail takes equal shares
            refusal = microbatching_refusal(
                self.train_program, pieces, weighed=opts.loss_weight != "auto", tail=tail, schedule=self._schedule.name
            )
            if refusal is not None:  # the same program on every rank: every rank raises it
                raise BatchCouplingError(refusal)
        self._call = CallInputs.of(
            self._in_spec, self.program, self.comm, self.device, pieces,
            leaves=leaves, local=opts.batch == "local", loss_weight=weight,
        )  # fmt: skip
        self.data_layout = self._call.layout_reading(self._reads_forward | self._reads_train)
        self._row_outputs = batch_outputs(self.program, self.data_layout.piece_rows)

    # -- calling ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The model's outputs for the batch (on a pipeline: forward only, on every rank). With local
        batches, outputs carrying the batch are this rank's rows; a loss is the whole batch's."""
        pieces, weights = self._call.pieces(args, kwargs, self._reads_forward, weigh=self._last)
        self._stepped = self._checked = False
        settle(t for ref in self._deferred if (t := ref()) is not None)  # the last call's loss, if unread
        if self._one_stage:
            self._grads.reset(enabled=self._sync)
            part = self.forward_runners[0].whole
            gathered = self.zero3.scope() if self.zero3 is not None else contextlib.nullcontext()
            outs = []
            watch.resumed()  # a failure this rank published at an earlier call is over
            with use_comm(self.comm), gathered:
                try:
                    for i, env in enumerate(pieces):
                        if self.dropout_rng is not None:
                            self.dropout_rng.microbatch = i
                        outs.append(part(env))
                except BaseException as e:  # the other ranks' collectives stop waiting for this one (comm/watch.py)
                    watch.publish(e, None)
                    raise
        else:
            with torch.no_grad():
                self._forward_executor.run(pieces)
            src = self._schedule.stage_to_rank[-1]  # the last stage's member of the pipeline group
            outs = broadcast_outputs(self.program, self._forward_executor.outputs, src, self._pp_group, self.device)
            if self._call.loss_weight is not None:
                weights = broadcast_weights(weights, len(outs), src, self._pp_group, self.device)
        if self.dropout_rng is not None and self.training:
            self.dropout_rng.step += 1
        merged = cast_floats(merge_outputs(outs, weights), self._output_dtype)
        if self._call.local:  # this rank's rows of the outputs carrying the batch
            merged = take_rows(merged, self.data_layout.data_rows(), self._row_outputs)
        if self._one_stage:
            self._grads.watch(merged)  # a backward through them syncs the gradients at its end
        elif self.training and torch.is_grad_enabled():  # only train_step trains a pipeline: a backward says so
            merged = refuse_backward(merged)
        self._deferred = [weakref.ref(t) for t in merged if isinstance(t, Deferred)]
        return pytree.tree_unflatten(merged, self._out_spec)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync``: the backwards of outputs computed inside accumulate gradients on each rank
        without syncing them; the first backward after it syncs what accumulated (a gradient
        accumulation loop: ``with m.no_sync(): m(**a).backward()``, then ``m(**b).backward()``).
        Without it every backward syncs the whole ``.grad``, so a gradient already synced would be
        summed again. ZeRO-3 still reduce-scatters each backward (sums of sums: the same result)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of every microbatch of the batch under the schedule, gradient reduction,
        and clipping and the optimizer step if ``make_optimizer`` attached one. Returns the step's loss:
        the microbatches' losses weighted by ``loss_weight`` (by default the whole batch's mean)."""
        if self._executor is None:
            raise PipelineError(
                "train_step needs the model's first output to be the scalar training loss (a Hugging Face "
                "model returns it first when given labels); call the module for its outputs instead"
            )
        if self.metrics is not None:
            self.metrics.start()
        pieces, weights = self._call.pieces(args, kwargs, self._reads_train, weigh=self._last)
        self._stepped = self._checked = False
        sub = self.options.sub_microbatches
        scales = loss_scales(weights, sub) if weights is not None else None
        seeds = self.loss_scaler.seeds(scales, len(pieces) // sub, sub) if self.loss_scaler is not None else scales
        self._grads.reset(enabled=False)  # the executor arms the last backwards and reduces at REDUCE_GRADS
        try:
            losses = self._executor.run([pieces[i : i + sub] for i in range(0, len(pieces), sub)], seeds)
        finally:
            self._grads.enabled = True
        if self.dropout_rng is not None and self.training:
            self.dropout_rng.step += 1
        # every pipeline rank needs the dtype to receive the broadcast: the loss's own, half types as float32
        loss_type = self.train_program.types()[self.train_program.outputs[0].name]
        dtype = torch.promote_types(loss_type.torch_dtype, torch.float32)
        loss = step_loss(losses, scales) if losses else torch.zeros((), device=self.device)
        loss = loss.detach().to(self.device, dtype).contiguous()
        if self._schedule.num_ranks > 1:
            src = self._schedule.stage_to_rank[-1]
            guarded(
                self._pp_group,
                "pp",
                "broadcast (the step's loss)",
                dist.broadcast,
                loss,
                group=self._pp_group,
                group_src=src,
            )
        self._stepped = self._optimizer is not None
        if self.metrics is not None:
            norm = self.grad_norm if self._optimizer is not None else None
            self.metrics.finish(loss, norm, pytree.tree_leaves((args, kwargs)))
        return loss

    def describe(self) -> str:
        """What the plan does on each mesh axis, with its predicted memory and step (``passes/describe.py``):
        what ``compile`` logs and this module's ``repr`` shows."""
        s, setup, prog = self._schedule, self.setup, self.program
        zero_axes = tuple(prog.mesh.names[i] for i in setup.shard_axes(prog.mesh))
        pipeline = f"{s.num_stages} stages on {s.num_ranks} ranks, {s.name} schedule, {s.num_microbatches} microbatches"
        return describe_plan(prog, setup.bucket_bytes, setup.zero, zero_axes, pipeline, s.num_ranks)

    def extra_repr(self) -> str:
        return self.describe()

    def train(self, mode: bool = True) -> ParallelModule:
        """Training mode (dropout draws masks) or, ``mode=False`` / ``eval()``, evaluation (dropout off)."""
        super().train(mode)
        if self.dropout_rng is not None:
            self.dropout_rng.training = mode
        return self


def _own_optimizer_hook(module: weakref.ref):
    """torch's global optimizer step pre-hook for ``module`` (held weakly): ``_check_own_optimizer``."""

    def hook(optimizer, _args, _kwargs) -> None:
        m = module()
        if m is not None:
            m._check_own_optimizer(optimizer)

    return hook


def _nothing(*_args) -> None:
    """REDUCE_GRADS and STEP of a forward-only run."""


holds_groups(ParallelModule, lambda m: setattr(m, "_pp_group", None))

__all__ = ["ParallelModule", "RuntimeOptions"]
