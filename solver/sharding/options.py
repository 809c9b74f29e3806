"""What the sharding solve is asked for (ShardOptions: objective, memory budget, ILP back end, constraints)
and the options a user-facing entry point plans with.

Objectives: ``time`` (the default) is the least predicted step time, communication plus computation
seconds on the cluster spec, within the memory budget (``planning_options`` sets the budget to the
cluster's device memory less its reserve, ``ClusterSpec.plan_memory``); ``comm`` is the same objective under
Alpa's name, kept for old plan files;
``memory`` is the minimal-memory-redundancy paper's: redundant bytes + alpha * communication bytes.

``data_parallel``, ``batch`` and ``fallbacks`` are read by the `shard` pass (passes/shard.py), which turns them into
``constrain`` entries (solver/sharding/baselines.py:data_parallel_constraints) and retries; the solver itself
(solver/sharding/solve.py) reads ``constrain`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autopar.errors import SolverError
from autopar.ir.core import MeshSpec
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import TrainingSetup, zero_gathers_pay

OBJECTIVES = ("time", "memory", "comm")
CONTEXT_ATTENTION = ("auto", "ring", "all-gather", "ulysses")  # "comm": "time" under Alpa's name
DATA_PARALLEL = (None, "inputs", "activations")
BATCH = ("global", "local")


@dataclass
class ShardOptions:
    objective: str = "time"  # "time": step time within the budget; "memory": redundancy + alpha * comm bytes
    alpha: float = 1.0
    budget_bytes: float | None = None  # per-device memory budget (None: none; see planning_options)
    time_limit: float | None = 60.0
    backend: str = "cbc"
    setup: TrainingSetup = field(default_factory=TrainingSetup)
    cluster: ClusterSpec | None = None
    shard_inputs: bool = True
    collapse: bool = True
    reuse_layers: bool = True  # solve identical repeated layers once
    eliminate: bool = True  # solve series-parallel parts exactly before the ILP (solver/sharding/eliminate.py)
    # restrict candidates (baselines): name of a value / op result -> predicate on its placements
    constrain: dict | None = None
    # a constrained value is read where it is stored, never moved by a collective: a hand-written layout
    # such as Megatron's computes with each weight shard in place (without this the cheapest execution of
    # Megatron's storage may gather the weights, ZeRO-3 style)
    pin_constrained: bool = False
    # these values too are read where they are stored (roles by name pin the parameters: passes/shard.py)
    pin: frozenset[str] = frozenset()
    # "auto": the ILP chooses every axis's placements by cost; "name": each axis does what its name says
    # (dp* data parallel, tp* Megatron's tensor parallelism: solver/sharding/roles.py), which the `shard`
    # pass turns into ``constrain`` entries. TrainConfig's default is "name"; this type's is the ILP's freedom
    roles: str = "auto"
    # the mesh axes named dp* are data parallel (the search's meaning of its dp): "inputs": parameters and
    # buffers replicated on them, user inputs split on the batch (dim 0); "activations": also every
    # activation that carries the batch (without it a model too small for its compute to matter is computed
    # whole on every dp rank, which communicates least); None: the ILP places everything by cost
    data_parallel: str | None = None
    # when nothing fits: retry with the least memory and no budget, then (data_parallel="activations")
    # with the inputs constrained only, and each of those with the least memory; ShardResult.how says which
    fallbacks: bool = False
    # a mixture of experts' expert capacity factor (GShard, Switch): each expert keeps ceil(factor x rows / experts)
    # of its grouped matmuls' rows, in their sorted order, the rest dropped (passes/experts.py set_capacity, written
    # by the shard pass); None: dropless. Priced: ``setup.capacity_factor`` is set from it (the busiest expert rank's
    # rows capped at factor x the mean, solver/sharding/experts.py)
    capacity_factor: float | None = None
    # how the batch is passed (compile(batch=...)): "global", every rank is given all of it, so an integer input
    # is recomputable (held whole, sliced for free); "local", each data-parallel rank is given only its rows:
    # the `shard` pass fixes the user inputs split on dim 0 over the dp* axes as they are dealt
    # (solver/sharding/baselines.py:local_batch_constraints), and moving one (all-gathering token ids) is priced
    batch: str = "global"
    # the form attention takes on a mesh axis named cp (Megatron-Core's cp_comm_type): "auto", whatever the ILP
    # prices cheapest (the sequence split in some form, or not split there at all); "ring", every attention's
    # sequence split over cp as ring attention (key/value blocks passed around the ring); "all-gather", every
    # attention's queries split over cp against all-gathered keys and values; "ulysses", every attention split on
    # its heads over cp, the sequence-split activations moved to heads and back by all-to-alls
    # (solver/sharding/rules/context.py)
    context_attention: str = "auto"

    def __post_init__(self) -> None:
        if self.setup.capacity_factor != self.capacity_factor:  # the cost model prices the capacity set here
            self.setup = replace(self.setup, capacity_factor=self.capacity_factor)
        if self.objective not in OBJECTIVES:
            raise SolverError(f"unknown objective {self.objective!r}; choose time (fastest within the memory "
                              "budget) or memory (least memory)")  # fmt: skip
        if self.batch not in BATCH:
            raise SolverError(f"unknown batch {self.batch!r}; choose global (every rank is given the whole batch) "
                              "or local (each data-parallel rank its rows)")  # fmt: skip
        if self.roles not in ("name", "auto"):
            raise SolverError(f"unknown roles {self.roles!r}; choose name (each mesh axis does what its name says: "
                              "dp* data parallel, tp* tensor parallel) or auto (the ILP chooses by cost)")  # fmt: skip
        if self.context_attention not in CONTEXT_ATTENTION:
            raise SolverError(f"unknown context_attention {self.context_attention!r}; choose auto (the ILP prices the "
                              "forms), ring (ring attention), all-gather (keys and values all-gathered) or ulysses "
                              "(all-to-all to heads)")  # fmt: skip
        if self.data_parallel not in DATA_PARALLEL:
            raise SolverError(f"unknown data_parallel {self.data_parallel!r}; choose None (the ILP decides), "
                              '"inputs" (weights replicated and inputs split over the dp* axes) or "activations" '
                              "(also every batch-carrying activation split)")  # fmt: skip

    def pinned(self, name: str) -> bool:
        """Whether value ``name`` is read where it is stored, never moved by a collective."""
        return name in self.pin or (self.pin_constrained and name in (self.constrain or {}))


def planning_options(opts: ShardOptions | None, cluster: ClusterSpec) -> ShardOptions:
    """What a user-facing entry point plans with: ``opts`` (default: the fastest plan) priced on
    ``cluster`` when they name none, and for the time objective a budget of the cluster's device
    memory less its reserve (``ClusterSpec.plan_memory``) when they set none."""
    opts = opts or ShardOptions()
    if opts.cluster is None:
        opts = replace(opts, cluster=cluster)
    if opts.objective != "memory" and opts.budget_bytes is None:
        opts = replace(opts, budget_bytes=opts.cluster.plan_memory)
    return opts


def decide_gathers(opts: ShardOptions, mesh: MeshSpec, pinned: bool | None = None) -> ShardOptions:
    """``opts`` with ``setup.hierarchical_gather`` decided where a plan is made: ``pinned`` (``TrainConfig``'s, or a
    plan file's), else whether the two-step gathers pay for the ZeRO group on ``mesh`` on ``opts.cluster``
    (``cost.zero_gathers_pay``, ``ClusterSpec.hierarchical_pays``; no cluster: flat)."""
    hier = pinned if pinned is not None else zero_gathers_pay(opts.setup, mesh, opts.cluster)
    if hier == opts.setup.hierarchical_gather:
        return opts
    return replace(opts, setup=replace(opts.setup, hierarchical_gather=hier))
