"""Planning defaults a real cluster needs (solver/cluster/spec.py): a memory reserve per device, H100, H200 and
B200 presets from NVIDIA's published figures, overrides on a spec file as on a preset, and one precision
default for ``autopar plan --mesh`` and the search. Spec arithmetic and one small plan: a few seconds."""

from __future__ import annotations

import argparse

import pytest

from autopar.errors import ClusterSpecError
from autopar.passes.shard import ShardOptions, planning_options
from autopar.solver.cluster.spec import ClusterSpec, default_memory_reserve

GiB, GB = 2**30, 10**9


def test_plans_leave_a_documented_reserve_per_device():
    """Before, the budget was the whole device (the best plans filled 79.04 of 80 GiB): now 1 GiB (the CUDA
    context and NCCL's buffers) plus 5% (fragmentation) is left, 5 GiB of 80, unless the spec sets its own."""
    dgx = ClusterSpec.load("dgx-a100")
    assert dgx.reserve_bytes == default_memory_reserve(80 * GiB) == 5 * GiB
    assert planning_options(ShardOptions(), dgx).budget_bytes == 75 * GiB
    assert ClusterSpec.load("dgx-a100:memory_reserve=0").plan_memory == 80 * GiB
    assert ClusterSpec.load("dgx-a100:memory_reserve=2GiB").plan_memory == 78 * GiB
    small = dgx.replace(device_memory="1GiB")
    assert small.reserve_bytes == GiB // 2  # at most half the device
    assert ClusterSpec.from_dict(dgx.to_dict()) == dgx  # the default reserve is not written


def test_h100_h200_b200_presets_carry_the_published_figures():
    h100, h200, b200 = (ClusterSpec.load(f"dgx-{g}:nodes=4") for g in ("h100", "h200", "b200"))
    assert (h100.nodes, h100.devices_per_node, h100.world_size) == (4, 8, 32)
    assert h100.peak("bf16") == 989e12 and h100.device_memory == 80 * GiB
    assert h100.inter_node_bandwidth == pytest.approx(0.92 * 400e9 / 8, rel=0.01)  # 400 Gb/s NDR per GPU
    assert h100.intra_node_bandwidth == pytest.approx(0.8 * 450e9)  # NVLink4's 450 GB/s per direction
    assert h200.device_memory == 141 * GB and h200.peak("bf16") == 989e12
    assert b200.device_memory == 180 * GB and b200.peak("bf16") == 2250e12
    assert all(c.notes.get("source") for c in (h100, h200, b200))


def test_a_spec_file_takes_overrides_as_a_preset_does(tmp_path):
    path = tmp_path / "my.yaml"
    ClusterSpec.load("dgx-h100").save(path)
    spec = ClusterSpec.load(f"{path}:nodes=128,peak_flops.bf16=900e12")
    assert (spec.nodes, spec.peak("bf16")) == (128, 900e12)
    assert ClusterSpec.load(str(path)) == ClusterSpec.load("dgx-h100")
    with pytest.raises(ClusterSpecError, match="does not exist"):
        ClusterSpec.load(f"{tmp_path / 'missing.yaml'}:nodes=2")


def test_plan_with_a_mesh_and_the_search_default_to_one_precision():
    """``autopar plan --mesh`` priced fp32 while the search priced bf16: both now take the cluster's default."""
    from autopar.cli import build_parser
    from autopar.cli.plan import plan_config

    parser = build_parser()
    args = parser.parse_args(["plan", "gpt2", "--mesh", "dp=2"])
    assert plan_config(args).precision == "bf16" == ClusterSpec.load("dgx-a100").default_precision()
    gloo = parser.parse_args(["plan", "gpt2", "--mesh", "dp=2", "--cluster", "local-cpu"])
    assert plan_config(gloo).precision == "fp32"
    asked = parser.parse_args(["plan", "gpt2", "--mesh", "dp=2", "--precision", "fp32"])
    assert plan_config(asked).precision == "fp32"
    assert isinstance(args, argparse.Namespace)
