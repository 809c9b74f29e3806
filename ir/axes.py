"""Mesh axis roles, read from the axis names: the one naming convention every layer of autopar follows.

A mesh axis is named by the user (``autopar.init_mesh(pp=2, dp=2, tp=2)``) and its name says its role:

- ``pp`` (``PIPELINE_AXIS``) is the pipeline axis: the stages are spread over it. The intra-op plan
  (the ILP) is made for the mesh without it (``MeshSpec.without_pipeline``), and a mesh without it
  is a one-stage pipeline.
- an axis whose name starts with ``dp`` (``dp``, ``dpr``, ``dp_outer``) is data-parallel: ZeRO and
  MiCS shard the optimizer state, gradients and (ZeRO-3) parameters over these axes, the search
  splits the batch over them, and the stage balance counts them as data parallelism. With MiCS,
  ``dpr`` holds the replicas of a partition group laid out on ``dp``.
- an axis whose name starts with ``tp`` is tensor-parallel: the Megatron baseline shards the weights
  over it, and a pipeline's ``scatter_gather`` cuts the tensors sent between stages over the first one.
- an axis whose name starts with ``ep`` is an expert axis: the ILP may split a mixture of experts' expert
  tables over it and send each token to the rank holding its expert (``solver/sharding/experts.py``); on
  every other axis that split is not offered.
- ``cp`` (context parallel) is a known name, torchtitan's, with no fixed layout yet: the ILP places
  tensors on it by cost.
- any other name (``a``) has no role of its own: accepted only with ``roles="auto"``, where the ILP places
  tensors on it as on any axis.

By default (``TrainConfig.roles="name"``, ``solver/sharding/roles.py``) the plan follows the names: the
``dp*`` axes split the batch with the weights replicated (gradients all-reduced; ZeRO when asked), the
``tp*`` axes lay the weights out as Megatron does; a name that is none of the above is a ``MeshError``
(``check_axis_names``). With ``roles="auto"`` the ILP chooses every placement by cost on every axis but
``pp``, and any name is accepted: the roles then only choose what is shared or assumed around it (ZeRO's
shards, baselines, search constraints, stage costs).
"""

from __future__ import annotations

from collections.abc import Iterable

from autopar.errors import MeshError

PIPELINE_AXIS = "pp"
DATA_AXIS_PREFIX = "dp"
TENSOR_AXIS_PREFIX = "tp"
EXPERT_AXIS_PREFIX = "ep"
CONTEXT_AXIS = "cp"
# what check_axis_names accepts, as its error lists them
KNOWN_AXES = ("dp", "dp_replicate", "dp_shard", "dp*", "tp", "tp*", PIPELINE_AXIS, CONTEXT_AXIS, "ep", "ep*")


def is_pipeline_axis(name: str) -> bool:
    """Whether the axis named ``name`` is the pipeline axis (``pp``)."""
    return name == PIPELINE_AXIS


def is_data_axis(name: str) -> bool:
    """Whether the axis named ``name`` is data-parallel (its name starts with ``dp``)."""
    return name.startswith(DATA_AXIS_PREFIX)


def is_tensor_axis(name: str) -> bool:
    """Whether the axis named ``name`` is tensor-parallel (its name starts with ``tp``)."""
    return name.startswith(TENSOR_AXIS_PREFIX)


def is_expert_axis(name: str) -> bool:
    """Whether the axis named ``name`` is an expert axis (its name starts with ``ep``)."""
    return name.startswith(EXPERT_AXIS_PREFIX)


def data_axes(names: Iterable[str]) -> tuple[str, ...]:
    """The data-parallel axes among ``names``, in their order."""
    return tuple(n for n in names if is_data_axis(n))


def tensor_axes(names: Iterable[str]) -> tuple[str, ...]:
    """The tensor-parallel axes among ``names``, in their order."""
    return tuple(n for n in names if is_tensor_axis(n))


def is_known_axis(name: str) -> bool:
    """Whether ``name`` is one of the axis names whose role autopar knows (``KNOWN_AXES``)."""
    roles = (is_data_axis, is_tensor_axis, is_pipeline_axis, is_expert_axis)
    return name == CONTEXT_AXIS or any(role(name) for role in roles)


def check_axis_names(names: Iterable[str]) -> None:
    """A ``MeshError`` naming the first axis whose name has no known role (roles by name need one)."""
    for n in names:
        if not is_known_axis(n):
            raise MeshError(
                f"mesh axis {n!r} has no known role; name each axis by its role: {', '.join(KNOWN_AXES)} "
                "(dp*: data parallel, tp*: tensor parallel, pp: pipeline, cp: context, ep*: expert), "
                "or plan with roles='auto' to let the ILP choose every axis's placements by cost"
            )
