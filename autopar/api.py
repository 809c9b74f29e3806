"""autopar's facade: compile a model over a DeviceMesh, and the mesh helpers.

mesh = autopar.init_mesh(dp=2, tp=2)               # a DeviceMesh with named axes (pp=2 for a pipeline)
model = autopar.compile(model, mesh, kwargs={"input_ids": x, "labels": y})  # , zero=2, microbatches=4, ...
opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)  # this rank's shards (ZeRO when planned)
out = model(input_ids=x, labels=y)                 # the whole batch; each rank takes its shard
out.loss.backward(); opt.step(); opt.zero_grad()   # or: loss = model.train_step(input_ids=x, labels=y)

``compile`` captures the model, plans it on rank 0 (``plan_programs``, ``autopar/build.py``: the one place
the planned programs come from), broadcasts the programs and builds this rank's
``autopar.runtime.module.ParallelModule``.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.build import ModuleParts, build_module, plan_programs
from autopar.check.step import check_before_training
from autopar.config import TrainConfig, resolve
from autopar.errors import CheckError, MeshError, PlanError, PrecisionError, SubPipelineError
from autopar.ir.core import MeshSpec, Program
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.metrics import step_meter
from autopar.passes.capture import Captured, capture
from autopar.passes.flow import flow_index
from autopar.passes.shard import planning_options
from autopar.passes.split_cache import cache_dir
from autopar.plan import Plan
from autopar.runtime.build.precision import MixedPrecisionPolicy, cast_floats, compute_copy
from autopar.runtime.build.rng import rng_for
from autopar.runtime.call.batch import sub_microbatch
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.agree import from_rank0
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.teardown import shutdown_at_exit
from autopar.runtime.comm.watch import device_mesh
from autopar.runtime.module import ParallelModule
from autopar.schedule.generators import make_schedule
from autopar.solver.cluster.spec import ClusterSpec, local_cluster
from autopar.solver.sharding.options import decide_gathers

DEFAULT_PIPELINE = ["shard", "insert-collectives"]  # what `autopar ir` runs after lower (autopar/cli/ir.py)


def check_restartable() -> None:
    """Refuse a restartable torchrun job whose restarts would fail: torchrun keeps one store for the job (its
    agent's) unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and a restarted group then reads the addresses
    the lost group left there and cannot connect (gloo and NCCL; pytorch issue 135712). ``init_mesh`` checks."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise MeshError(
            f"torchrun --max-restarts {restarts} shares one store between the attempts, so a restarted group "
            "would read the lost group's addresses and fail to connect: launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (every node), or without restarts"
        )


def init_mesh(device_type: str | None = None, *, timeout: float | None = None, **axes: int):
    """A DeviceMesh with named axes (``init_mesh(dp=2, tp=2)``), checked against the world size (and, under
    torchrun restarts, against a store its restarts cannot use: ``check_restartable``). Its process groups
    are destroyed and freed at exit, before the interpreter finalizes (``autopar.runtime.comm.teardown``).
    ``timeout``: the seconds any collective on the mesh's axes may wait (default: the world group's, from
    ``init_process_group(timeout=)``); a stuck peer then raises ``RuntimeCommError`` on every rank waiting
    for it, naming the axis, the op and the ranks that did not arrive (``runtime/comm/watch.py``)."""
    check_restartable()
    if not axes:
        raise MeshError("give the mesh axes and sizes, e.g. init_mesh(dp=2, tp=2)")
    size = 1
    for n in axes.values():
        size *= n
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if size != world:
        raise MeshError(
            f"the mesh {axes} has {size} devices but the world has {world} processes; launch "
            f"{size} processes (torchrun --nproc-per-node {size}) or change the axis sizes"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    shutdown_at_exit()  # the groups destroyed and freed before the interpreter finalizes (runtime/comm/teardown.py)
    return device_mesh(device_type, axes, timeout)  # every sub-group with the job's timeout


def parse_mesh(text: str) -> MeshSpec:
    """'dp=2,tp=4' -> MeshSpec; axis names are any identifiers, sizes positive integers."""
    axes = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, size = item.partition("=")
        if not sep or not name.isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(f"bad mesh axis {item!r} in {text!r}: write axes as name=size, e.g. dp=2,tp=4")
        if name in dict(axes):
            raise MeshError(f"mesh axis {name!r} appears twice in {text!r}")
        axes.append((name, int(size)))
    return MeshSpec(tuple(axes))


def mesh_spec(mesh) -> MeshSpec:
    names = mesh.mesh_dim_names
    if not names:
        raise MeshError("the DeviceMesh needs named axes: init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    return MeshSpec(tuple((n, mesh.size(i)) for i, n in enumerate(names)))


def calibration_dir() -> Path:
    """Where ``autopar calibrate --save`` writes this machine's spec: autopar's cache directory."""
    return cache_dir() or Path.home() / ".cache" / "autopar" / "plans"


def local_cluster_spec(device_type: str | None = None, world: int | None = None) -> ClusterSpec:
    """The cluster this machine is for ``world`` processes: NCCL on CUDA, else gloo; the calibration
    saved in the cache directory when there is one (``autopar calibrate --save``), else the
    ``local-gpu`` / ``local-cpu`` preset. A GPU's device memory is read from CUDA."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    memory = None
    if device_type == "cuda":
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    backend = "nccl" if device_type == "cuda" else "gloo"
    return local_cluster(backend, world, calibration_dir(), memory)


def compile(  # noqa: A001
    model: torch.nn.Module,
    mesh,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    config: TrainConfig | None = None,
    plan: str | os.PathLike | None = None,
    dump_dir: str | None = None,
    device: str | torch.device | None = None,
    **choices,
) -> ParallelModule:
    """Capture ``model(*args, **kwargs)``, solve its sharding over ``mesh``, build this rank's module.

    ``mesh`` is a torch DeviceMesh with named axes. How it trains is one ``autopar.TrainConfig``: ``config``,
    or the keyword ``choices``, which are its fields (``compile(model, mesh, kwargs=batch, zero=2,
    microbatches=8)``), or both (the choices change the config's fields). By default the plan is the fastest
    that fits the device memory (``objective="time"``; least memory with ``objective="memory"``), priced on
    the config's ``cluster`` or else on this machine (``local_cluster_spec``: the saved ``autopar calibrate``
    spec when there is one). Rank 0 plans and broadcasts the planned IR, so every rank runs the same program.
    With ``plan=`` (a file from ``autopar plan -o``) nothing is solved: the plan is checked against this
    model's graph and this mesh and used as it is, and its config is the default (its schedule, microbatches,
    ZeRO, precision), which ``config`` or the choices override. The model's weights are sliced into this
    rank's shards; the module keeps no whole copy. A model built on the meta device is initialized shard by
    shard from ``seed`` (``autopar.runtime.build.init_weights``).

    The result is a ``ParallelModule`` on every mesh (``autopar.runtime.module``); a mesh without a
    ``pp`` axis is a one-stage pipeline. The inputs are the global batch, cut into ``microbatches``
    (the model is captured with one microbatch's inputs); calling the module returns the model's
    outputs, ``train_step(**batch)`` runs ``schedule`` (any registered one: gpipe, 1f1b, interleaved, wave,
    scp, zb-h1, zb-h2, zbv, dualpipev) with ``schedule_options`` (chunks=, waves=, alpha1=) and returns the
    loss. ``TrainConfig``'s docstring and comments say what every field does: ``batch="local"`` (each rank
    passes its data-parallel rows, ``autopar.data``), ``loss_weight`` (how the microbatches' losses make the
    step's: by default each piece weighs the count its mean divides by, read from the program, so the step's
    loss and gradient are the whole batch's mean, as on one device), ``precision`` (``"bf16"``, ``"fp16"``,
    a dtype or a ``MixedPrecisionPolicy``: computed in that dtype with fp32 master weights; fp16 scales the
    loss), ``scatter_gather``, ``sub_pipeline_tp``, ``timeout``, ``record``.

    ``check=True`` runs, before building this rank's module, one float64 training step of every rank of
    the plan on the single-process rank simulator against the model (``autopar check``; on rank 0, the
    verdict broadcast; on a pipeline, one microbatch through the stages) and raises ``CheckError`` naming
    the first op whose output or gradient differs. A model above ``autopar.check.step.CHECK_MAX_PARAMS``
    parameters (or on the meta device) is checked on a copy rebuilt small from its config that carries
    the plan's ops and placements (``autopar/check/scale.py``), so the check stays cheap at any size.

    Before TrainConfig: ``options=ShardOptions(...)`` and ``mixed_precision=`` still work, with a
    DeprecationWarning, for one release.
    """
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"mesh must be a torch DeviceMesh with named axes, not {type(mesh).__name__}; "
            "use autopar.init_mesh(dp=2, tp=2)"
        )
    spec = mesh_spec(mesh)
    pp = spec.pipeline_size
    loaded = Plan.load(plan) if plan is not None else None
    cfg, legacy = resolve(config, choices, TrainConfig.from_plan(loaded) if loaded is not None else None)
    policy = cfg.policy()
    if loaded is not None:
        _check_plan_precision(loaded, policy)
        options = cfg.shard_options(base=legacy)
    else:  # priced on this machine: the fastest plan within its device memory by default
        options = planning_options(cfg.shard_options(base=legacy), local_cluster_spec(mesh.device_type, mesh.size()))
    options = decide_gathers(options, spec, cfg.hierarchical_gather)  # ZeRO-3's across nodes: the config's, the plan's
    run = cfg.runtime_options()
    example = sub_microbatch(args, dict(kwargs or {}), cfg.microbatches, run.sub_microbatches)
    captured = _capture(model, *example, policy)
    sched = make_schedule(cfg.schedule, pp, cfg.microbatches, **cfg.schedule_kwargs())
    sharded = None
    if loaded is not None:  # every rank reads and checks it, so a refused plan stops all of them
        try:
            sharded = loaded.program_for(captured, spec)  # refuses ops the model's lowering never emits
        except PlanError as e:
            if not cfg.sub_pipeline_tp:
                raise
            raise PlanError(
                f"{e} (with sub_pipeline_tp=True the stages run half a microbatch: the plan must be made "
                "for that half, or compile without sub_pipeline_tp)"
            ) from None
    dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR")

    def plan() -> list[str | None]:
        fwd, train = plan_programs(
            captured, spec, sched, options, sharded, scatter_gather=cfg.scatter_gather, dump_dir=dump_dir,
            sub_pipeline_tp=cfg.sub_pipeline_tp, torch_compile=cfg.torch_compile,
        )  # fmt: skip
        return [print_program(fwd), print_program(train) if train is not None else None]

    text: list[str | None] = from_rank0(plan) or [None, None]  # a planning error is raised on every rank
    dist.broadcast_object_list(text, src=0)
    forward = parse(text[0])
    train = parse(text[1]) if text[1] is not None else None
    if cfg.sub_pipeline_tp:
        _check_sub_pipeline(forward, spec)
    if cfg.check:
        _check_before_training(forward, train, model, captured, example, spec, sched.stage_to_rank)
    device = torch.device(device) if device is not None else _default_device(mesh)
    parts = ModuleParts(model, captured, example, forward, train, sched, options, run, cfg.seed)
    rng = rng_for(forward.ops, cfg.microbatches * run.sub_microbatches)
    module = build_module(parts, Comm.from_device_mesh(mesh), device, mesh, rng)
    if dump_dir:
        _dump_module(dump_dir, dist.get_rank(), module)
    module.model_config = getattr(model, "config", None)  # save_pretrained's config.json (a transformers model's)
    module.metrics = step_meter(module, model, cfg, options.cluster, dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        logging.getLogger("autopar").info("%s", module.describe())
    return module


def _check_plan_precision(plan: Plan, policy: MixedPrecisionPolicy | None) -> None:
    """Refuse computing a plan in another dtype than it was planned (captured) in."""
    planned = plan.options.get("setup", {}).get("precision", "fp32")
    wanted = policy.name if policy is not None else "fp32"
    if planned != wanted:
        raise PrecisionError(
            f"the plan was made for {planned} compute, but precision asks for {wanted}: its program is "
            f"typed {planned}; plan again with `autopar plan ... --precision {wanted}`, or compile without "
            "precision (the plan's applies)"
        )


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


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, policy: MixedPrecisionPolicy | None = None) -> Captured:
    """``capture``, remembered per model object, input signature (treespec, shapes, dtypes) and compute
    dtype: compiling one model for several schedules or meshes exports it once. With a mixed-precision
    policy the model is captured from its compute-dtype copy (``precision.compute_copy``). Changing the
    model's code or config in place between compiles is not seen; build a new model object instead."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    key = (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat))
    key += (repr(policy.param_dtype), policy.cast_forward_inputs) if policy is not None else ()
    per_model = _CAPTURES.setdefault(model, {})
    if key not in per_model:
        if policy is None:
            per_model[key] = capture(model, args, kwargs)
        else:
            inputs = (
                (args, kwargs) if not policy.cast_forward_inputs else cast_floats((args, kwargs), policy.param_dtype)
            )
            per_model[key] = capture(compute_copy(model, policy.param_dtype), *inputs)
    return per_model[key]


def _check_before_training(
    forward: Program, train: Program | None, model, captured: Captured, example: tuple, mesh: MeshSpec, s2r
) -> None:
    """compile's ``check=True``: rank 0 checks the plan on simulated ranks (one microbatch, ``example``; a
    large model on a scaled-down copy); every rank raises its verdict."""

    verdict: list[str | None] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            check_before_training(forward, train, model, captured, *example, mesh, tuple(s2r))
        except Exception as e:  # every rank must leave the broadcast below
            failure, verdict = e, [str(e) if isinstance(e, CheckError) else f"check=True failed on rank 0: {e!r}"]
    dist.broadcast_object_list(verdict, src=0)
    if failure is not None:
        raise failure
    if verdict[0] is not None:
        raise CheckError(verdict[0])


def _dump_module(dump_dir: str | os.PathLike, rank: int, module: ParallelModule) -> None:
    """The flow's last pass, ``codegen``, dumped beside the others (``passes/flow.py``): the PassManager that
    generated rank N's modules writes each as Python (``09-codegen.rankN.LABEL.py``, LABEL being ``forward{s}``,
    ``stage{s}``, a recompute part or ``loss_weight``); beside them its training stages' IR with local shapes
    (``.local.ir``) and, from rank 0, the schedule (``schedule.txt``)."""
    module.passes.dump_into(dump_dir)
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    n = flow_index("codegen")
    if rank == 0:
        (d / "schedule.txt").write_text(module.schedule.to_text())
    for s, sp in module.stages.items():
        (d / f"{n:02d}-codegen.rank{rank}.stage{s}.local.ir").write_text(print_program(sp.program, local=True))


def dump_rank_code(dump_dir: str | os.PathLike, rank: int, program: Program) -> None:
    """Beside rank N's generated Python (``09-codegen.rankN.py``, the codegen pass's dump), its IR with local
    shapes (``09-codegen.rankN.local.ir``) (``autopar ir --dump-dir``)."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{flow_index('codegen'):02d}-codegen.rank{rank}.local.ir").write_text(print_program(program, local=True))


def _default_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
