"""TrainConfig: the one configuration of training on a mesh, and the internal option types derived from it.

    config = autopar.TrainConfig(zero=2, schedule="interleaved", schedule_options={"chunks": 2}, microbatches=8)
    model = autopar.compile(model, mesh, kwargs=batch, config=config)     # or compile(..., zero=2, ...)
    autopar plan gpt2 --mesh pp=2,dp=2 --config train.yaml -o plan.json  # the same fields in YAML or JSON

``compile``, ``autopar plan`` and plan files take it: a plan file keeps the config it was made with
(``Plan.config``), and ``compile(plan=...)`` starts from it. The planner, the stage balance and the runtime
read their own option types (``ShardOptions``, ``TrainingSetup``, ``MixedPrecisionPolicy``,
``RuntimeOptions``, ``PipelinePlanOptions``), all made here, in one place, from one config, so no choice is
carried twice. The spellings before it (``compile(options=ShardOptions(...), mixed_precision=...)``) keep
working for one release with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import yaml

from autopar.errors import AutoparError, BatchError, ConfigError, ScheduleError
from autopar.passes.shard import ShardOptions
from autopar.plan import Plan
from autopar.planner import options_from_dict
from autopar.runtime.build.precision import (
    LossScaling,
    MixedPrecisionPolicy,
    dtype_name,
    dtype_of,
    policy_of,
    policy_of_setup,
    setup_dtypes,
)
from autopar.runtime.call.batch import token_count
from autopar.runtime.module import MICROBATCH_SEMANTICS, RuntimeOptions
from autopar.schedule.generators import SCHEDULES, schedule_kind
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.cluster.units import parse_bytes
from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.options import BATCH, CONTEXT_ATTENTION, DATA_PARALLEL, OBJECTIVES
from autopar.solver.sharding.roles import ROLES


@dataclass(frozen=True)
class TrainConfig:
    """How a model trains on a mesh: what the plan optimizes, how optimizer states and gradients are kept,
    the pipeline schedule, precision, and how the compiled module runs. Every field has the default a plain
    ``autopar.compile(model, mesh)`` uses."""

    # -- the plan: what the ILP minimizes, within which memory, priced on which cluster --------------------
    objective: str = "time"  # "time": the fastest plan within the budget; "memory": least redundant memory
    alpha: float = 1.0  # the memory objective's weight of communication bytes (the ILP paper's alpha)
    budget: int | float | str | None = None  # per-device bytes ("70GiB" or a number); None: the device's memory
    cluster: str | ClusterSpec | None = None  # a preset or spec file; None: this machine (compile) or dgx-a100 (plan)
    solver: str = "cbc"  # the ILP back end: "cbc" (ships with PuLP) or "highs"
    time_limit: float | None = 60.0  # seconds the ILP may take (a time-limited feasible plan is reported as such)
    # -- optimizer states and gradients ------------------------------------------------------------------
    optimizer: str = "adam"  # what the memory model prices: "adam" (two fp32 moments) or "sgd" (none)
    zero: int = 0  # ZeRO stage over the data-parallel axes: 0, 1 (optimizer states), 2 (+ gradients), 3 (+ weights)
    zero_axes: tuple[str, ...] | None = None  # the axes ZeRO shards over; None: the data-parallel (dp*) axes
    mics_group: int | None = None  # MiCS: shard inside partition groups of this many ranks (None: the whole dp)
    bucket_cap_mb: float = 25.0  # gradients are all-reduced in flat buckets of this size (DDP's bucket_cap_mb)
    # a mixture of experts on an ep axis: the busiest expert rank's rows over the mean that the plan's all-to-alls
    # and expert compute are priced at (1: uniform routing, what a load-balancing loss aims at; at least 1)
    router_imbalance: float = 1.0
    # -- the pipeline (a mesh with a pp axis; without one, microbatches accumulate gradients) ---------------
    schedule: str = "1f1b"  # any registered schedule: gpipe, 1f1b, interleaved, wave, scp, zb-h1, zb-h2, zbv, ...
    schedule_options: Mapping[str, int | Fraction] = field(default_factory=dict)  # chunks=, waves=, alpha1=, ...
    microbatches: int = 1  # pieces each call's batch is cut into
    recompute: bool = False  # recompute each stage's forward in its backward (schedules taking recompute=)
    # -- precision -----------------------------------------------------------------------------------------
    # "fp32", "bf16", "fp16", a torch dtype or a MixedPrecisionPolicy (FSDP2's fields): bf16/fp16 capture and
    # compute in that dtype with fp32 master weights; fp16 scales the loss dynamically
    precision: str | torch.dtype | MixedPrecisionPolicy = "fp32"
    # -- the mesh ------------------------------------------------------------------------------------------
    # "name": each axis does what its name says (dp* data parallel: batch split, gradients all-reduced; tp*
    # tensor parallel as Megatron lays the weights out; pp pipeline; cp, ep placed by the ILP) and an unknown
    # name is a MeshError; "auto": the ILP chooses every placement on every axis by cost, any name accepted
    roles: str = "name"
    # None: the ILP places everything by cost; "inputs": weights replicated and inputs split over the dp* axes;
    # "activations": also every activation that carries the batch
    data_parallel: str | None = None
    # the form of attention on a cp axis: "auto" (the ILP's choice), "ring", "all-gather" or "ulysses"
    context_attention: str = "auto"
    scatter_gather: bool = False  # send 1/tp of each tensor-parallel-replicated stage boundary (Megatron)
    sub_pipeline_tp: bool = False  # Merak's sub-pipelined tensor parallelism: two halves overlap their collectives
    # a mixture of experts' capacity factor (GShard, Switch): each expert keeps ceil(factor x tokens x top-k / experts)
    # of the batch's rows routed to it, in their sorted order, and drops the rest (their result zero); None: dropless
    capacity_factor: float | None = None
    # -- the call and the run ------------------------------------------------------------------------------
    batch: str = "global"  # "global": every rank is given the whole batch; "local": each dp rank its rows
    # each piece's weight in the step's loss: "auto" (a mean's own divisor), "tokens", None (equal pieces), or a
    # function of a piece's inputs by name
    loss_weight: str | Callable | None = "auto"
    seed: int = 0  # a model built on the meta device is initialized shard by shard from this seed
    timeout: float = 600.0  # seconds any transfer may take before the step fails
    record: bool = True  # record the start and end of every action of a train_step (model.trace)
    check: bool = False  # check one float64 step of the plan on simulated ranks before training
    # a model whose loss couples the batch (contrastive logits, MoE load-balancing statistics, batch norm:
    # passes/batch_coupling.py) is refused more than one microbatch ("exact"), or runs each microbatch as its
    # own batch ("per_microbatch", what Megatron's and torch's pipelines do silently)
    microbatch_semantics: str = "exact"
    torch_compile: bool = False  # compile each rank's programs with torch.compile (Inductor), collectives included
    # called with each train_step's StepMetrics (runtime/measure/metrics.py) on every rank; not written to files
    on_metrics: Callable | None = None
    log_every: int = 1  # rank 0 logs a train_step's metrics on logger "autopar" every this many steps (0: never)
    # a step whose gradients are NaN or infinite (agreed by every rank): "warn_skip" (skipped, with a warning),
    # "skip" (silently), "raise" (NonFiniteError); with max_grad_norm, a NaN norm (runtime/grads/nonfinite.py)
    on_nonfinite: str = "warn_skip"
    # ranks each node runs (global ranks numbered node by node), for ZeRO-3's hierarchical gathers across nodes
    # (runtime/grads/node_gather.py) where the plan runs them; None: torchrun's LOCAL_WORLD_SIZE, else one node
    ranks_per_node: int | None = None
    # ZeRO-3's unit gathers over a group spanning nodes in two steps, across the nodes then inside each (MiCS Sec.
    # 3.3): None, where the cluster prices them below one flat ring (ClusterSpec.hierarchical_pays: MiCS's p3dn yes,
    # a DGX's fast rails no); True/False pin it (a plan file's is its own)
    hierarchical_gather: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("objective", self.objective, OBJECTIVES)
        _check_choice("on_nonfinite", self.on_nonfinite, ("warn_skip", "skip", "raise"))
        _check_choice("solver", self.solver, ("cbc", "highs"))
        _check_choice("optimizer", self.optimizer, ("adam", "sgd"))
        _check_choice("zero", self.zero, (0, 1, 2, 3))
        _check_choice("data_parallel", self.data_parallel, DATA_PARALLEL)
        _check_choice("roles", self.roles, ROLES)
        _check_choice("context_attention", self.context_attention, CONTEXT_ATTENTION)
        if self.batch not in BATCH:
            raise BatchError(
                f"batch must be 'global' (every rank passes the whole batch) or 'local' (its shard), not {self.batch!r}"
            )
        for name in ("microbatches", "mics_group", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"TrainConfig.{name} must be a positive integer, not {value!r}")
        kind = schedule_kind(self.schedule)  # ScheduleError naming the registered ones
        unknown = sorted(set(self.schedule_options) - set(kind.options()))
        if unknown:
            raise ScheduleError(
                f"the {self.schedule} schedule takes no option {', '.join(unknown)}; it takes "
                f"{', '.join(kind.options()) or 'none'}"
            )
        if self.recompute and "recompute" not in kind.options():
            takes = sorted(k.name for k in SCHEDULES.values() if "recompute" in k.options())
            raise ScheduleError(
                f"recompute=True needs a schedule that recomputes ({', '.join(takes)}; scp recomputes by its alpha1), "
                f"not {self.schedule}"
            )
        if self.hierarchical_gather is not None and not isinstance(self.hierarchical_gather, bool):
            raise ConfigError(
                f"TrainConfig.hierarchical_gather must be True, False or None (the cluster decides), "
                f"not {self.hierarchical_gather!r}"
            )
        ri = self.router_imbalance
        if isinstance(ri, bool) or not isinstance(ri, (int, float)) or not ri >= 1:
            raise ConfigError(
                f"TrainConfig.router_imbalance must be a number of at least 1 (the busiest expert rank's rows over "
                f"the mean; 1: uniform routing), not {ri!r}"
            )
        if not isinstance(self.log_every, int) or isinstance(self.log_every, bool) or self.log_every < 0:
            raise ConfigError(f"TrainConfig.log_every must be a non-negative integer, not {self.log_every!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ConfigError(f"TrainConfig.capacity_factor must be a positive number or None (dropless), not {cf!r}")
        if self.on_metrics is not None and not callable(self.on_metrics):
            raise ConfigError(f"TrainConfig.on_metrics must be a function of StepMetrics, not {self.on_metrics!r}")
        if not (self.loss_weight in (None, "auto", "tokens") or callable(self.loss_weight)):
            raise BatchError(
                "loss_weight must be 'auto', 'tokens', None or a function of a piece's inputs, "
                f"not {self.loss_weight!r}"
            )
        _check_choice("microbatch_semantics", self.microbatch_semantics, MICROBATCH_SEMANTICS)
        self.policy()  # a precision that names no dtype fails here
        if self.zero_axes is not None:
            object.__setattr__(self, "zero_axes", tuple(self.zero_axes))
        object.__setattr__(self, "schedule_options", dict(self.schedule_options))
        self.budget_bytes  # noqa: B018 - an unreadable budget fails here

    # -- what each layer reads -------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> float | None:
        if self.budget is None:
            return None
        try:
            return float(parse_bytes(self.budget) if isinstance(self.budget, str) else self.budget)
        except (AutoparError, ValueError, TypeError) as e:
            raise ConfigError(f"TrainConfig.budget: {e}") from None

    def cluster_spec(self, default: ClusterSpec | None = None) -> ClusterSpec | None:
        """The cluster priced on: the config's (a preset name, a spec file, or a spec), else ``default``."""
        if isinstance(self.cluster, str):
            return ClusterSpec.load(self.cluster)
        return self.cluster if self.cluster is not None else default

    def policy(self) -> MixedPrecisionPolicy | None:
        """The mixed-precision policy the runtime applies (None: fp32); PrecisionError for one it cannot."""
        return policy_of(self.precision)

    def training_setup(self, overlap_tp: bool = True) -> TrainingSetup:
        """What the cost model assumes about training (``solver/sharding/cost.py``)."""
        precision, reduce = setup_dtypes(self.policy())
        return TrainingSetup(
            optimizer=self.optimizer,
            precision=precision,
            reduce_dtype=reduce,
            zero=self.zero,
            zero_axes=self.zero_axes,
            mics_group=self.mics_group,
            bucket_cap_mb=self.bucket_cap_mb,
            overlap_tp=overlap_tp,
            router_imbalance=self.router_imbalance,
            hierarchical_gather=bool(self.hierarchical_gather),  # None: decided on the mesh (options.decide_gathers)
        )

    def shard_options(self, cluster: ClusterSpec | None = None, base: ShardOptions | None = None) -> ShardOptions:
        """The sharding solve's options (``passes/shard.py``), priced on the config's cluster or ``cluster``.
        ``base``: a ShardOptions whose internal fields (constraints, presolve switches) are kept."""
        fields = dict(
            objective=self.objective,
            alpha=self.alpha,
            budget_bytes=self.budget_bytes,
            time_limit=self.time_limit,
            backend=self.solver,
            setup=self.training_setup(base.setup.overlap_tp if base is not None else True),
            cluster=self.cluster_spec(cluster),
            data_parallel=self.data_parallel,
            batch=self.batch,
            roles=self.roles,
            context_attention=self.context_attention,
            capacity_factor=self.capacity_factor,
        )
        return dataclasses.replace(base, **fields) if base is not None else ShardOptions(**fields)

    def schedule_kwargs(self) -> dict[str, Any]:
        """The keyword options of ``make_schedule(self.schedule, ...)``."""
        return dict(self.schedule_options) | ({"recompute": 1} if self.recompute else {})

    def runtime_options(self) -> RuntimeOptions:
        """How the compiled module runs (``runtime/module.py``)."""
        weight = token_count() if self.loss_weight == "tokens" else self.loss_weight
        return RuntimeOptions(
            self.microbatches, self.timeout, self.record, self.sub_pipeline_tp, self.batch, weight, self.policy(),
            microbatch_semantics=self.microbatch_semantics,
            torch_compile=self.torch_compile,
            on_nonfinite=self.on_nonfinite,
            ranks_per_node=self.ranks_per_node,
        )  # fmt: skip

    # -- files ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The config as JSON/YAML data (what a plan file keeps)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "loss_weight" and callable(value):
                raise ConfigError(
                    "a loss_weight function cannot be written to a file: give it to compile(loss_weight=...)"
                )
            if f.name == "on_metrics":  # a function of the run, not file data
                value = None
            if f.name == "cluster" and isinstance(value, ClusterSpec):
                value = value.to_dict()
            if f.name == "precision":
                value = _precision_dict(value)
            if f.name == "schedule_options":
                value = {k: str(v) if isinstance(v, Fraction) else v for k, v in value.items()}
            if f.name == "zero_axes" and value is not None:
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "the config") -> TrainConfig:
        """A config from JSON/YAML data; unknown fields are refused by name."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source} must be a mapping of TrainConfig fields, not {type(data).__name__}")
        names = field_names()
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{source} has unknown fields {unknown}; TrainConfig's fields: {', '.join(names)}")
        values = dict(data)
        if isinstance(values.get("cluster"), Mapping):
            values["cluster"] = ClusterSpec.from_dict(values["cluster"])
        if isinstance(values.get("precision"), Mapping):
            values["precision"] = _precision_of_dict(values["precision"])
        if "schedule_options" in values:
            values["schedule_options"] = {
                k: Fraction(v) if isinstance(v, str) else v for k, v in (values["schedule_options"] or {}).items()
            }
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """A config from a YAML or JSON file of its fields."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        try:
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: {e}") from None
        return cls.from_dict(data or {}, source=str(path))

    def save(self, path: str | Path) -> None:
        text = json.dumps(self.to_dict(), indent=1) if str(path).endswith(".json") else yaml.safe_dump(self.to_dict())
        Path(path).write_text(text)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (TrainConfig fields), each checked as in the constructor."""
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields {unknown}; its fields: {', '.join(field_names())}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_plan(cls, plan: Plan) -> TrainConfig:
        """The config ``compile(plan=...)`` starts from: what the plan's sharding was solved with (its objective,
        budget, ZeRO, precision, read from the plan's options as before TrainConfig) and the rest of the config
        it was made with (its schedule and microbatches), when the plan keeps one. The cluster is not re-read:
        nothing is priced again."""
        options = options_from_dict(plan.options) if plan.options else ShardOptions()
        rest = {}
        if plan.config:
            made = cls.from_dict(plan.config, source="the plan's config")
            rest = {name: getattr(made, name) for name in NOT_SHARDING}
        return cls.from_shard_options(options, **rest)

    # -- the spellings before it -------------------------------------------------------------------------------
    @classmethod
    def from_shard_options(cls, options: ShardOptions, **fields: Any) -> TrainConfig:
        """The config a ``ShardOptions`` (and its ``TrainingSetup``) describes, with ``fields`` besides."""
        s = options.setup
        return cls(
            objective=options.objective,
            alpha=options.alpha,
            budget=options.budget_bytes,
            cluster=options.cluster,
            solver=options.backend,
            time_limit=options.time_limit,
            optimizer=s.optimizer,
            zero=s.zero,
            zero_axes=s.zero_axes,
            mics_group=s.mics_group,
            bucket_cap_mb=s.bucket_cap_mb,
            router_imbalance=s.router_imbalance,
            hierarchical_gather=s.hierarchical_gather,
            precision=policy_of_setup(s) or "fp32",
            data_parallel=options.data_parallel,
            batch=options.batch,
            context_attention=options.context_attention,
            capacity_factor=options.capacity_factor,
            **fields,
        )


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def resolve(
    config: TrainConfig | None, choices: Mapping[str, Any], base: TrainConfig | None = None
) -> tuple[TrainConfig, ShardOptions | None]:
    """``compile``'s configuration: ``config``, else ``base`` (a plan file's), then the keyword ``choices``
    (TrainConfig fields). The spellings before TrainConfig, ``options=ShardOptions(...)`` and
    ``mixed_precision=``, are read with a DeprecationWarning: the ShardOptions sets the plan's fields (its
    precision included, as before), and comes back too, so its internal fields (constraints, presolve
    switches) reach the solver."""
    choices = dict(choices)
    options = choices.pop("options", None)
    if "mixed_precision" in choices:
        _deprecated("compile(mixed_precision=...)", "compile(precision=...) or TrainConfig(precision=...)")
        if (mp := choices.pop("mixed_precision")) is not None:
            choices["precision"] = mp
    cfg = config if config is not None else (base or TrainConfig())
    if options is not None:
        if not isinstance(options, ShardOptions):
            raise ConfigError(f"options must be a ShardOptions, not {type(options).__name__}; use config=TrainConfig()")
        _deprecated("compile(options=ShardOptions(...))", "compile(config=autopar.TrainConfig(...)) or its fields")
        rest = {f: getattr(cfg, f) for f in NOT_SHARDING}
        cfg = TrainConfig.from_shard_options(options, **rest)
    try:
        return cfg.replace(**choices), options
    except ConfigError as e:
        raise ConfigError(f"compile(): {e}") from None


# the fields a ShardOptions (and its TrainingSetup) holds; NOT_SHARDING the rest
_SHARD_FIELDS = {
    "objective", "alpha", "budget", "cluster", "solver", "time_limit", "optimizer", "zero", "zero_axes",
    "mics_group", "bucket_cap_mb", "data_parallel", "batch", "precision", "context_attention",
    "capacity_factor", "router_imbalance", "hierarchical_gather",
}  # fmt: skip
NOT_SHARDING = tuple(f for f in field_names() if f not in _SHARD_FIELDS)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new}", DeprecationWarning, stacklevel=4)


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[-1], bool):
        raise ConfigError(f"TrainConfig.{name} must be one of {', '.join(map(repr, allowed))}, not {value!r}")


def _precision_dict(value: Any) -> str | dict[str, Any]:
    """A precision as file data: its name, or a policy's fields with dtypes by name."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if not isinstance(value, MixedPrecisionPolicy):
        return value
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if isinstance(v, torch.dtype):
            v = dtype_name(v)
        elif f.name == "loss_scaling" and not isinstance(v, (bool, type(None))):
            v = dataclasses.asdict(v)
        out[f.name] = v
    return out


def _precision_of_dict(data: Mapping[str, Any]) -> MixedPrecisionPolicy:
    values = dict(data)
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        if isinstance(values.get(name), str):
            values[name] = dtype_of(values[name])
    if isinstance(values.get("loss_scaling"), Mapping):
        values["loss_scaling"] = LossScaling(**values["loss_scaling"])
    return MixedPrecisionPolicy(**values)


__all__ = ["NOT_SHARDING", "TrainConfig", "field_names", "resolve"]
