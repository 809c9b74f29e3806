"""The mesh axis roles of ir/axes.py: pp is the pipeline axis, dp* data-parallel, tp* tensor-parallel. Cost: < 1 s."""

from __future__ import annotations

from autopar.ir.axes import (
    PIPELINE_AXIS,
    data_axes,
    is_data_axis,
    is_pipeline_axis,
    is_tensor_axis,
    tensor_axes,
)
from autopar.ir.core import MeshSpec
from autopar.solver.sharding.cost import TrainingSetup

MESH = MeshSpec((("pp", 2), ("dpr", 2), ("dp", 2), ("ep", 2), ("tp", 2), ("tp2", 3)))


def test_roles_follow_the_names() -> None:
    assert PIPELINE_AXIS == "pp" and is_pipeline_axis("pp")
    assert [n for n in MESH.names if is_pipeline_axis(n)] == ["pp"]
    assert [n for n in MESH.names if is_data_axis(n)] == ["dpr", "dp"] == list(data_axes(MESH.names))
    assert [n for n in MESH.names if is_tensor_axis(n)] == ["tp", "tp2"] == list(tensor_axes(MESH.names))
    # an axis of no role is none of them
    assert not (is_pipeline_axis("ep") or is_data_axis("ep") or is_tensor_axis("ep"))


def test_mesh_without_pipeline() -> None:
    inner = MESH.without_pipeline()
    assert inner.axes == MESH.axes[1:] and MESH.pipeline_size == 2
    assert inner.without_pipeline() == inner and inner.pipeline_size == 1
    assert MeshSpec().without_pipeline() == MeshSpec() and MeshSpec().pipeline_size == 1


def test_zero_shards_over_the_data_axes_by_default() -> None:
    """The memory model's default ZeRO axes are the dp* axes (indices into the mesh), in mesh order."""
    inner = MESH.without_pipeline()
    assert TrainingSetup(zero=1).shard_axes(inner) == (inner.index("dpr"), inner.index("dp"))
    assert TrainingSetup(zero=1).shard_axes(MeshSpec((("a", 2), ("tp", 2)))) == ()
