"""Pipeline-parallel training on a mesh with a ``pp`` axis (combined with any data/tensor-parallel axes).

    mesh = autopar.init_mesh(pp=2, dp=2, tp=2)
    pipe = autopar.compile(model, mesh, kwargs=batch, microbatches=4, schedule="interleaved",
                           schedule_options={"chunks": 2})
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)   # ZeRO-2 / MiCS when the plan says so
    for batch in data:
        loss = pipe.train_step(**batch)     # every microbatch forward and backward, gradient sync, step

The user passes the *global* batch (as example inputs and to ``train_step``) and the number of
microbatches M; the batch dim (dim 0 of every tensor input) is cut into M equal microbatches. The
model is captured with the inputs of one microbatch, so every shape in the IR is a microbatch's.
The first output of the model is the training loss (a Hugging Face model given ``labels`` returns it
first); the step's loss is the mean of the microbatch losses, which for a mean-reduced loss over
equal microbatches is the loss of the whole batch. ``train_step`` returns it on every rank.

Flow (docs/runtime.md): capture one microbatch -> lower and plan (``shard`` + ``insert-collectives``)
on the mesh without ``pp`` (rank 0, broadcast) -> keep only the loss output -> ``plan_pipeline``
(Merak's split, balanced stages, chunks/waves as the schedule places them) -> ``insert_transfers``
(send/recv ops; Megatron's scatter/gather with ``scatter_gather=True``) -> per stage of this rank,
a GraphModule holding only this rank's parameter shards -> ``Executor`` running the schedule.

With ``sub_pipeline_tp=True`` (Merak's sub-pipelined tensor parallelism) the model is captured and
planned for half a microbatch, and each ``F``/``B`` runs the two halves of its microbatch interleaved
at their tensor-parallel collectives (``autopar.runtime.subpipeline``).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.errors import CaptureError, MeshError, PipelineError, PlanError, SubPipelineError
from autopar.ir.core import MeshSpec, Program, Shard, Value
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.passes.capture import Captured, capture, flatten_inputs
from autopar.passes.prune import prune_outputs
from autopar.passes.shard import ShardOptions
from autopar.passes.stage_program import StageProgram, recompute_cut, split_for_recompute, stage_program
from autopar.passes.transfers import insert_transfers
from autopar.runtime import collectives as coll
from autopar.runtime.actions import Kind, Schedule
from autopar.runtime.codegen import codegen, shard_param
from autopar.runtime.executor import Buffer, Executor, Part, StageRunner, TraceEvent, measured_result
from autopar.runtime.rng import rng_for
from autopar.runtime.schedules import make_schedule
from autopar.runtime.timeline import SimResult


@dataclass(frozen=True)
class PipelineOptions:
    """How the pipeline is built and run (besides the mesh and the sharding options)."""

    microbatches: int = 1
    schedule: str = "1f1b"  # any name of autopar.runtime.schedules.SCHEDULES
    schedule_options: dict[str, Any] = field(default_factory=dict)  # chunks=, waves=, alpha1=, recompute=
    scatter_gather: bool = False  # Megatron: send 1/t of tp-replicated boundary tensors, all-gather on receipt
    pp_axis: str = "pp"
    seed: int = 0  # initialization seed of a meta-device model (autopar.runtime.init)
    timeout: float = 600.0  # seconds any transfer may take before the step fails with RuntimeCommError
    record: bool = True  # record every action's start and end (a barrier starts each step)
    # Merak's sub-pipelined tensor parallelism: each microbatch runs as two halves, one communicating
    # (tp collectives, forward and backward) while the other computes; the stages are built for a half
    sub_pipeline_tp: bool = False

    @property
    def sub_microbatches(self) -> int:
        return 2 if self.sub_pipeline_tp else 1


def split_batch(args: tuple, kwargs: dict, microbatches: int) -> list[tuple[tuple, dict]]:
    """Cut dim 0 of every tensor in ``(args, kwargs)`` into ``microbatches`` equal parts."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sizes = {x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise CaptureError(
            "every tensor input needs the batch as dim 0 (one size) to be cut into microbatches; "
            f"found sizes {sorted(sizes)}"
        )
    (batch,) = sizes
    if batch % microbatches:
        raise CaptureError(f"a batch of {batch} cannot be cut into {microbatches} equal microbatches")
    parts = [
        [x.chunk(microbatches, 0)[i] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in flat]
        for i in range(microbatches)
    ]
    return [pytree.tree_unflatten(p, spec) for p in parts]


def plan_pipeline_program(
    captured: Captured,
    inner: MeshSpec,
    pp: int,
    schedule: Schedule,
    options: ShardOptions | None = None,
    sharded: Program | None = None,
    *,
    pp_axis: str = "pp",
    scatter_gather: bool = False,
    dump_dir: str | None = None,
) -> Program:
    """The whole pipelined program: sharded, pruned to the loss, staged, with send/recv ops."""
    from autopar.api import plan_program
    from autopar.solver.stages import plan_pipeline

    prog = sharded if sharded is not None else plan_program(captured, inner, options, dump_dir=dump_dir)
    loss_t = prog.types().get(getattr(prog.outputs[0], "name", ""), None) if prog.outputs else None
    if loss_t is None or loss_t.shape != () or not loss_t.is_float:
        raise PipelineError(
            "pipeline training needs the model's first output to be the scalar training loss (a Hugging "
            f"Face model returns it first when given labels); the first output here is {loss_t}"
        )
    prog = prune_outputs(prog)
    if _planned_stages(prog) == schedule.num_stages:  # a plan file's stages (autopar plan): kept as planned
        annotated = _complete_stages(prog)
    else:
        waves = dict(schedule.options).get("waves") if schedule.name == "wave" else None
        chunks = schedule.num_stages // pp if waves is None else 1
        mbs = schedule.num_microbatches
        annotated, plan, _ = plan_pipeline(prog, pp, chunks=chunks, waves=waves, microbatches=mbs)
        if tuple(plan.stage_to_rank) != tuple(schedule.stage_to_rank):
            raise PipelineError(
                f"the {schedule.name} schedule places stages on ranks {list(schedule.stage_to_rank)} but the "
                f"stage plan on {list(plan.stage_to_rank)}"
            )
    out = insert_transfers(annotated, scatter_gather=scatter_gather)
    verify(out)
    return out


def _planned_stages(prog: Program) -> int | None:
    """The number of stages a program was already cut into (``stage=`` on its computing ops), if any."""
    staged = [op.attrs["stage"] for op in prog.ops if "stage" in op.attrs]
    computing = [op for op in prog.ops if op.target.startswith("aten.")]
    if not staged or any("stage" not in op.attrs for op in computing):
        return None
    return int(prog.attrs.get("pipeline_stages", max(staged) + 1))


def _complete_stages(prog: Program) -> Program:
    """Give ops inserted after the stages were chosen (collectives) the stage of the next staged op in
    program order, their consumer: stages stay contiguous, and a value crossing to that stage is sent as
    it was produced and redistributed where it is used."""
    ops = list(prog.ops)
    last = max(op.attrs["stage"] for op in ops if "stage" in op.attrs)
    nxt = last
    for i in range(len(ops) - 1, -1, -1):
        if "stage" in ops[i].attrs:
            nxt = ops[i].attrs["stage"]
        else:
            ops[i] = ops[i].with_(attrs=dict(ops[i].attrs, stage=nxt))
    return prog.with_(ops=tuple(ops), attrs=dict(prog.attrs, pipeline_stages=last + 1))


class PipelineModule(torch.nn.Module):
    """This rank's pipeline stages. Parameters are registered under the user's names (local shards)."""

    def __init__(
        self,
        program: Program,
        schedule: Schedule,
        captured: Captured,
        mesh,
        get_value: Callable[[str], torch.Tensor],
        device: torch.device,
        opts: PipelineOptions,
        zero: int = 0,
        zero_axes: tuple[str, ...] = (),
        replica_axes: tuple[str, ...] = (),
    ):
        super().__init__()
        names = mesh.mesh_dim_names
        self._opts = opts
        self._program = program
        self._loss_dtype = program.types()[program.outputs[0].name].torch_dtype
        self._schedule = schedule
        self._mesh = mesh
        self._device = device
        self._in_spec = captured.in_spec
        self._inner = program.mesh
        self._comm = coll.Comm.from_device_mesh(mesh)
        self._pp_axis = opts.pp_axis
        self._pp_rank = self._comm.coords[opts.pp_axis]
        self._pp_group = self._comm.groups[opts.pp_axis]
        self._zero, self._zero_axes, self._replica_axes = zero, zero_axes, replica_axes
        self._optimizer = None
        coords = list(mesh.get_coordinate())
        self._coords = dict(zip(names, coords))
        pp_index = names.index(opts.pp_axis)

        def global_rank(pp_coord: int) -> int:
            c = list(coords)
            c[pp_index] = pp_coord
            return int(mesh.mesh[tuple(c)])

        self._global_rank = global_rank
        num_stages = int(program.attrs["pipeline_stages"])
        all_stages = [stage_program(program, s) for s in range(num_stages)]
        mine = schedule.stages_of_rank(self._pp_rank)
        self._stage_programs = {s: all_stages[s] for s in mine}
        values = {v.name: v for v in program.inputs}

        # parameters and buffers: each materialized once per rank, shared by this rank's stages
        cache: dict[str, torch.Tensor] = {}

        def local_tensor(v: Value) -> torch.Tensor:
            if v.name not in cache:
                full = get_value(v.name)
                local = shard_param(full, v.type.placements, self._inner.names, self._inner.sizes, self._comm.coords)
                local = local.detach().to(device).clone().contiguous()
                del full
                if v.kind == "param":
                    cache[v.name] = torch.nn.Parameter(local, requires_grad=v.type.is_float)
                    _register(self, v.name, cache[v.name], param=True)
                else:
                    cache[v.name] = local
                    _register(self, v.name, local, param=False)
            return cache[v.name]

        # keyed dropout (runtime/rng.py): shared by this rank's stages; the executor sets the microbatch
        self._rng = rng_for(program.ops, schedule.num_microbatches * opts.sub_microbatches)
        fractions: dict[int, set[Fraction]] = {s: set() for s in mine}
        for a in schedule.actions[self._pp_rank]:
            if a.kind is Kind.F and a.recompute:
                fractions[a.stage].add(a.recompute)
        self._runners: dict[int, StageRunner] = {}
        self._stage_gms: dict[str, torch.fx.GraphModule] = {}
        for s in mine:
            sp = all_stages[s]
            whole = self._build(sp.program, local_tensor, f"stage{s}")
            runner = StageRunner(
                s,
                whole,
                [self._buffer(v) for v in sp.recv],
                [self._buffer(v) for v in sp.send],
                sp.is_last,
            )
            for x in sorted(fractions[s]):
                cut = recompute_cut(sp, x)
                if cut >= len(sp.program.ops):
                    runner.variants[x] = (whole, None)
                else:
                    head, rest = split_for_recompute(sp.program, cut)
                    runner.variants[x] = (
                        self._build(head, local_tensor, f"stage{s}.head{x}"),
                        self._build(rest, local_tensor, f"stage{s}.rest{x}"),
                    )
            self._runners[s] = runner
        self._inputs = [v for v in program.inputs if v.kind == "input"]

        # gradient reductions: data-parallel (grad_sync attrs), tied parameters across pipeline ranks
        self._local_params = {n: t for n, t in cache.items() if isinstance(t, torch.nn.Parameter)}
        holders: dict[str, set[int]] = {}
        for sp in all_stages:
            for n in sp.param_names:
                holders.setdefault(n, set()).add(schedule.stage_to_rank[sp.index])
        self._tied = {n: tuple(sorted(r)) for n, r in holders.items() if len(r) > 1}
        self._tie_groups = self._make_tie_groups(mesh, names, pp_index)
        reduce_order = [a.stage for a in schedule.actions[self._pp_rank] if a.kind is Kind.REDUCE_GRADS]
        last_user: dict[str, int] = {}
        for s in reduce_order:
            for n in self._stage_programs[s].param_names:
                last_user[n] = s
        self._sync_at: dict[int, list[str]] = {s: [] for s in mine}
        for n in sorted(self._local_params):
            if values[n].attrs.get("grad_sync") and n not in self._tied:
                self._sync_at[last_user[n]].append(n)
        self._values = values
        barrier = _barrier(opts.timeout) if opts.record else None
        self._executor = Executor(
            schedule,
            self._pp_rank,
            self._runners,
            lambda s: global_rank(schedule.stage_to_rank[s]),
            self._comm,
            self._reduce_grads,
            self._step,
            timeout=opts.timeout,
            record=opts.record,
            barrier=barrier,
            device=device,
            sub_microbatches=opts.sub_microbatches,
        )

    # -- construction helpers --------------------------------------------------------------------
    def _build(self, prog: Program, local_tensor, label: str) -> Part:
        gm = codegen(prog, self._comm.coords, _no_whole, self._device, local_tensor=local_tensor, rng=self._rng)
        self._stage_gms[label] = gm
        return Part.of(gm, prog)

    def _buffer(self, v: Value) -> Buffer:
        t = v.type
        return Buffer(v.name, t.local_shape(self._inner), t.torch_dtype, bool(v.attrs.get("grad")))

    def _make_tie_groups(self, mesh, names, pp_index: int) -> dict[tuple[int, ...], Any]:
        """One process group per set of pipeline ranks sharing a tied parameter, per coordinate of the
        other axes (every rank creates every group, in the same order, as new_group requires)."""
        groups: dict[tuple[int, ...], Any] = {}
        me = dist.get_rank()
        others = [range(mesh.size(i)) for i in range(len(names)) if i != pp_index]
        for holders in sorted(set(self._tied.values())):
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

    # -- gradient reduction and the optimizer ----------------------------------------------------
    def _zero_managed(self, name: str) -> bool:
        from autopar.runtime.zero import ZeroOptimizer

        return isinstance(self._optimizer, ZeroOptimizer) and self._optimizer.manages(name)

    def _sync(self, names: list[str]) -> None:
        by_axis: dict[str, list[torch.nn.Parameter]] = {}
        for n in names:
            for axis in self._values[n].attrs.get("grad_sync", []):
                if self._zero_managed(n) and axis in self._zero_axes + self._replica_axes:
                    continue  # the ZeRO optimizer reduce-scatters these
                by_axis.setdefault(axis, []).append(self._local_params[n])
        coll.sync_grads(by_axis)

    def _reduce_grads(self, stage: int) -> None:
        self._sync(self._sync_at[stage])

    def _step(self) -> None:
        """STEP: sum tied parameters' gradients over the pipeline ranks holding them (Megatron's
        embedding group), sync them over data parallelism, then run the attached optimizer."""
        tied = sorted(n for n in self._tied if n in self._local_params)
        for holders in sorted({self._tied[n] for n in tied}):
            params = [self._local_params[n] for n in tied if self._tied[n] == holders]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._tie_groups[holders])
            for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
                p.grad = chunk.view_as(p).clone()
        self._sync(tied)
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad()

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        """The optimizer ``train_step`` runs at ``STEP``: ZeRO-2 sharded over the data-parallel axes when
        the plan's training setup says ``zero >= 1`` (MiCS 2-hop when ``mics_group`` is set), else
        ``optimizer_cls`` over this rank's parameters."""
        if self._zero and self._zero_axes:
            from autopar.runtime.zero import ZeroOptimizer, whole_gradient_params

            self._optimizer = ZeroOptimizer(
                self._local_params,
                {n: self._values[n].attrs.get("grad_sync", []) for n in self._local_params},
                optimizer_cls,
                self._comm,
                self._zero_axes,
                self._replica_axes,
                whole_gradient_params(self._program, self._zero_axes + self._replica_axes),
                **kwargs,
            )
        else:
            self._optimizer = optimizer_cls(list(self._local_params.values()), **kwargs)
        return self._optimizer

    # -- training --------------------------------------------------------------------------------
    def _microbatch_inputs(self, args: tuple, kwargs: dict) -> list[list[dict[str, torch.Tensor]]]:
        """Each microbatch's local user inputs by name, as its sub-microbatches (one without
        sub-pipelining), dim 0 cut in order."""
        n = self._opts.sub_microbatches
        out = []
        for a, kw in split_batch(args, kwargs, self._schedule.num_microbatches * n):
            flat = flatten_inputs(self._in_spec, a, kw)
            local = coll.local_inputs(
                self._inputs, flat, self._comm, self._inner.names, self._device, "microbatch shape"
            )
            env = {v.name: t for v, t in zip(self._inputs, local)}
            out.append(env)
        return [out[i : i + n] for i in range(0, len(out), n)]

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of every microbatch of the global batch under the schedule, gradient
        reduction, and the optimizer step if ``make_optimizer`` attached one. Returns the mean loss."""
        mbs = self._microbatch_inputs(args, kwargs)
        losses = self._executor.run(mbs)
        if self._rng is not None:
            self._rng.step += 1
        last = self._schedule.stage_to_rank[-1]
        # every pp rank needs the dtype to receive the broadcast: the loss's own, half types as float32
        dtype = torch.promote_types(self._loss_dtype, torch.float32)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self._device)
        loss = loss.detach().to(self._device, dtype).contiguous()
        dist.broadcast(loss, src=self._global_rank(last), group=self._pp_group)
        return loss

    def forward(self, *args, **kwargs):
        raise PipelineError(
            "a pipelined model runs forward and backward together: call train_step(**batch) (it returns "
            "the loss), not the module"
        )

    # -- inspection ------------------------------------------------------------------------------
    @property
    def optimizer(self):
        """The optimizer ``make_optimizer`` attached (``None`` if the caller steps its own)."""
        return self._optimizer

    @property
    def pp_axis(self) -> str:
        return self._pp_axis

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def program(self) -> Program:
        return self._program

    @property
    def stages(self) -> dict[int, StageProgram]:
        """This rank's stage programs."""
        return dict(self._stage_programs)

    @property
    def stage_modules(self) -> dict[str, torch.fx.GraphModule]:
        """Generated GraphModules of this rank: ``stage{s}``, and recompute parts ``stage{s}.head{x}``."""
        return dict(self._stage_gms)

    @property
    def trace(self) -> list[TraceEvent]:
        """Start and end of every action of this rank's last step (seconds since the step began)."""
        return list(self._executor.trace)

    @property
    def peak_stash(self) -> int:
        """Most microbatch-stages whose activations this rank held at once in the last step."""
        return self._executor.peak_stash

    def measured(self) -> SimResult:
        """The last step as a SimResult (chart, bubble ratios) from every pipeline rank's trace.
        Collective over the pipeline axis."""
        traces: list[Any] = [None] * self._schedule.num_ranks
        dist.all_gather_object(traces, self.trace, group=self._pp_group)
        return measured_result(self._schedule, traces)

    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers gathered whole over the non-pipeline axes (collective
        over them), keyed as in the user's model. ``grads=True``: the parameters' gradients instead
        (zeros where there is none)."""
        out = {}
        with coll.use_comm(self._comm):
            for v in self._program.inputs:
                if v.kind == "input" or not _has(self, v.name) or (grads and v.kind != "param"):
                    continue
                t = _get(self, v.name)
                x = (t.grad if t.grad is not None else torch.zeros_like(t)) if grads else t.detach()
                for p, name in reversed(list(zip(v.type.placements, self._inner.names))):
                    if isinstance(p, Shard):
                        x = coll._gather(self._comm, x, name, p.dim, p.chunks)
                out[v.name] = x
        return out

    def local_keys(self) -> dict[str, str]:
        """Name -> a key unique to this shard: the name plus the coordinates of the axes it is sharded
        over (``wte.weight|tp=1/2``); replicas share the key (what checkpoints are keyed by)."""
        out = {}
        for v in self._program.inputs:
            if v.kind == "input" or not _has(self, v.name):
                continue
            parts = [
                f"{a}={self._comm.coords[a]}/{n}"
                for p, (a, n) in zip(v.type.placements, self._inner.axes)
                if isinstance(p, Shard) and n > 1
            ]
            out[v.name] = v.name + ("|" + ",".join(parts) if parts else "")
        return out


def _no_whole(name: str) -> torch.Tensor:
    raise AssertionError(f"{name} should come from local_tensor")


def _register(root: torch.nn.Module, qualname: str, t: torch.Tensor, param: bool) -> None:
    *path, attr = qualname.split(".")
    mod = root
    for p in path:
        if p not in mod._modules:
            mod.add_module(p, torch.nn.Module())
        mod = mod._modules[p]
    if param:
        mod.register_parameter(attr, t)
    else:
        mod.register_buffer(attr, t)


def _has(root: torch.nn.Module, qualname: str) -> bool:
    try:
        _get(root, qualname)
        return True
    except (AttributeError, KeyError):
        return False


def _get(root: torch.nn.Module, qualname: str) -> torch.Tensor:
    *path, attr = qualname.split(".")
    mod = root
    for p in path:
        mod = mod._modules[p]
    if attr in mod._parameters:
        return mod._parameters[attr]
    return mod._buffers[attr]


def _barrier(timeout: float):
    import datetime

    td = datetime.timedelta(seconds=timeout)

    def barrier() -> None:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=td)
        else:
            dist.barrier()

    return barrier


def compile_pipeline(
    model: torch.nn.Module,
    mesh,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    microbatches: int = 1,
    schedule: str = "1f1b",
    schedule_options: dict[str, Any] | None = None,
    options: ShardOptions | None = None,
    plan: str | os.PathLike | None = None,
    dump_dir: str | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    scatter_gather: bool = False,
    timeout: float = 600.0,
    record: bool = True,
    sub_pipeline_tp: bool = False,
) -> PipelineModule:
    """``autopar.compile`` for meshes with a ``pp`` axis: see the module docstring."""
    from autopar.api import _default_device, mesh_spec

    spec = mesh_spec(mesh)
    opts = PipelineOptions(
        microbatches,
        schedule,
        dict(schedule_options or {}),
        scatter_gather,
        "pp",
        seed,
        timeout,
        record,
        sub_pipeline_tp=sub_pipeline_tp,
    )
    if opts.pp_axis not in spec.names:
        raise MeshError(f"the mesh {spec} has no {opts.pp_axis} axis; use autopar.compile for meshes without one")
    pp = spec.axis_size(opts.pp_axis)
    inner = MeshSpec(tuple((n, s) for n, s in spec.axes if n != opts.pp_axis))
    kwargs = dict(kwargs or {})
    mb_args, mb_kwargs = _sub_microbatch(args, kwargs, opts)
    captured = _capture(model, mb_args, mb_kwargs)
    sched = make_schedule(schedule, pp, microbatches, **opts.schedule_options)
    text: list[str | None] = [None]
    sharded = None
    if plan is not None:  # every rank reads and checks it, so a refused plan stops all of them
        from autopar.plan import Plan
        from autopar.planner import options_from_dict

        loaded = Plan.load(plan)
        try:
            loaded.check(captured, spec)
        except PlanError as e:
            if not sub_pipeline_tp:
                raise
            raise PlanError(
                f"{e} (with sub_pipeline_tp=True the stages run half a microbatch: the plan must be made "
                "for that half, or compile without sub_pipeline_tp)"
            ) from None
        sharded = parse(loaded.program)
        if options is None and loaded.options:  # the plan's training setup (ZeRO, MiCS) unless overridden
            options = options_from_dict(loaded.options)
    if dist.get_rank() == 0:
        prog = plan_pipeline_program(
            captured,
            inner,
            pp,
            sched,
            options,
            sharded,
            pp_axis=opts.pp_axis,
            scatter_gather=scatter_gather,
            dump_dir=dump_dir or os.environ.get("AUTOPAR_DUMP_DIR"),
        )
        text = [print_program(prog)]
    dist.broadcast_object_list(text, src=0)
    program = parse(text[0])
    if sub_pipeline_tp:
        _check_sub_pipeline(program, spec)
    dev = torch.device(device) if device is not None else _default_device(mesh)
    get_value = _value_source(model, captured, seed)
    setup = (options or ShardOptions()).setup
    zero_axes: tuple[str, ...] = ()
    replica_axes: tuple[str, ...] = ()
    if setup.zero:
        from autopar.runtime.zero import zero_axes_of

        if setup.zero >= 3:
            raise PipelineError("the pipeline runtime implements ZeRO-1/2 (and MiCS); ZeRO-3 is not supported")
        zero_axes, replica_axes = zero_axes_of(setup, inner)
    pipe = PipelineModule(program, sched, captured, mesh, get_value, dev, opts, setup.zero, zero_axes, replica_axes)
    dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR")
    if dump_dir:
        _dump(Path(dump_dir), pipe)
    return pipe


def _sub_microbatch(args: tuple, kwargs: dict, opts: PipelineOptions) -> tuple[tuple, dict]:
    """The inputs the stages are built for: one microbatch, or half of one with sub-pipelined tp."""
    first = split_batch(args, kwargs, opts.microbatches)[0]
    n = opts.sub_microbatches
    if n == 1:
        return first
    try:
        return split_batch(*first, n)[0]
    except CaptureError:
        sizes = {x.shape[0] for x in pytree.tree_leaves(first) if isinstance(x, torch.Tensor) and x.dim() > 0}
        raise SubPipelineError(
            f"sub-pipelined tensor parallelism runs each microbatch as {n} equal halves, but a microbatch has "
            f"{sorted(sizes)[0]} samples; make the batch a multiple of {n * opts.microbatches} ({n} x "
            f"microbatches={opts.microbatches}), use fewer microbatches, or compile without sub_pipeline_tp"
        ) from None


_SUB_PIPELINED = {name for name, fn in coll.FUNCTIONS.items() if fn in coll.ASYNC}


def _check_sub_pipeline(program: Program, mesh: MeshSpec) -> None:
    """Refuse sub-pipelining where no stage has a tensor-parallel collective: nothing would overlap."""
    if not any(op.target in _SUB_PIPELINED for op in program.ops):
        raise SubPipelineError(
            "sub_pipeline_tp=True overlaps the tensor-parallel collectives inside the stages with computation, "
            f"but no stage of this plan has one (mesh {mesh}): add a tensor-parallel axis (e.g. tp=2) to the "
            "mesh, or compile without sub_pipeline_tp"
        )


_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
    """``capture``, remembered per model object and input signature (treespec, shapes, dtypes): compiling
    one model for several schedules or meshes exports it once. Changing the model's code or config in
    place between compiles is not seen; build a new model object instead."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    key = (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat))
    per_model = _CAPTURES.setdefault(model, {})
    if key not in per_model:
        per_model[key] = capture(model, args, kwargs)
    return per_model[key]


def _value_source(model: torch.nn.Module, captured: Captured, seed: int) -> Callable[[str], torch.Tensor]:
    """name -> whole value: the model's own tensor, or for a meta-device model its deterministic init."""
    from autopar.runtime.init import init_value

    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    constants = dict(captured.exported.constants.items())

    def get(name: str) -> torch.Tensor:
        t = named.get(name)
        if t is None:
            t = constants.get(name)
            if t is None:
                raise PipelineError(f"the program reads {name}, which the model does not have")
            if t.device.type == "meta":
                raise PipelineError(f"the constant {name} was captured on the meta device; build the model on the CPU")
            return t
        if t.device.type == "meta":
            return init_value(model, name, seed)
        return t

    return get


def _dump(d: Path, pipe: PipelineModule) -> None:
    """``pipeline.ir`` (the whole program with send/recv), and per stage of this rank its code and IR."""
    d.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    if rank == 0:
        (d / "pipeline.ir").write_text(print_program(pipe.program))
        (d / "schedule.txt").write_text(pipe.schedule.to_text())
    for label, gm in pipe.stage_modules.items():
        (d / f"rank{rank}.{label}.py").write_text(gm.code)
    for s, sp in pipe.stages.items():
        (d / f"rank{rank}.stage{s}.local.ir").write_text(print_program(sp.program, local=True))


__all__ = ["PipelineModule", "PipelineOptions", "compile_pipeline", "split_batch"]
