"""Axis roles by name (TrainConfig's default, solver/sharding/roles.py) and what a plan says it does per axis
(passes/describe.py): planning only, on the meta device or a small MLP, a few seconds.

Before roles by name a dp=2 x tp=2 mesh planned a small model 4-way data parallel (or fully replicated), every
parameter ``{R,R}``, and said nothing; unknown axis names were accepted silently. Training on dp=2 x tp=2 with
the default roles is proven exact in tests/test_equivalence.py, which also asserts the axes' use there.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autopar.api import parse_mesh
from autopar.config import TrainConfig
from autopar.errors import ConfigError, MeshError
from autopar.ir.axes import KNOWN_AXES, check_axis_names
from autopar.ir.core import R, Shard
from autopar.passes.capture import capture
from autopar.passes.describe import describe_plan
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.shard import planning_options
from autopar.solver.cluster.spec import ClusterSpec


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.norm(x + self.down(torch.relu(self.up(x)))), target)


def _plan(mesh: str, **config):
    torch.manual_seed(0)
    captured = capture(MLP(), (), {"x": torch.randn(8, 16), "target": torch.randn(8, 16)})
    cfg = TrainConfig(**config)
    opts = planning_options(cfg.shard_options(), ClusterSpec.load("dgx-a100"))
    return plan_program(captured, parse_mesh(mesh), FlowOptions(shard=opts, cache=False)).forward


def _placements(prog) -> dict[str, tuple]:
    return {v.name: v.type.placements for v in prog.inputs}


def test_roles_by_name_make_tp_tensor_parallel_and_dp_data_parallel():
    """The default: on dp=2 x tp=2 the MLP's up projection is column-parallel on tp (weight and bias split on
    the output features), the down projection row-parallel (weight split on the input features), the norm
    replicated; the batch is split on dp and replicated on tp; every weight is whole on dp."""
    prog = _plan("dp=2,tp=2")
    p = _placements(prog)
    assert p["up.weight"] == (R, Shard(0)) and p["up.bias"] == (R, Shard(0))
    assert p["down.weight"] == (R, Shard(1)) and p["norm.weight"] == (R, R)
    assert p["x"] == (Shard(0), R) and p["target"] == (Shard(0), R)
    assert prog.attrs["roles"] == "name"
    text = describe_plan(prog)
    assert "(roles by name)" in text
    assert "tp=2: tensor parallel (Megatron): column/row on 1/1 matmuls, 3 of 6 parameters sharded" in text
    assert "dp=2: data parallel: batch split, weights replicated; gradients of 6 parameters all-reduced" in text
    assert "predicted:" in text


def test_roles_auto_is_the_ilps_free_choice_and_says_so():
    """``roles="auto"``: at this size communication costs more than it saves, so the ILP replicates everything
    on dgx-a100 (what every dp x tp mesh did before roles by name), and the description says the axes are unused."""
    prog = _plan("dp=2,tp=2", roles="auto")
    assert all(pl == (R, R) for pl in _placements(prog).values())
    text = describe_plan(prog, zero=1, zero_axes=("dp",))
    assert "(roles chosen by the ILP)" in text
    assert "tp=2: unused: every rank of it computes the same" in text
    assert "dp=2: unused: every rank of it computes the same (everything replicated); ZeRO-1 shards" in text


def test_unknown_axis_name_is_a_mesh_error_listing_the_known_ones():
    for name in ("dp", "dp_replicate", "dp_shard", "dpr", "tp", "pp", "cp", "ep"):
        check_axis_names([name])
    with pytest.raises(MeshError) as e:
        check_axis_names(["dp", "fsdp"])
    assert "'fsdp'" in str(e.value) and all(k in str(e.value) for k in KNOWN_AXES) and "roles='auto'" in str(e.value)
    with pytest.raises(MeshError, match="'fsdp' has no known role"):
        _plan("fsdp=2")
    prog = _plan("fsdp=2", roles="auto")  # the ILP's free choice takes any name
    assert prog.mesh.names == ("fsdp",)
    with pytest.raises(ConfigError, match="roles"):
        TrainConfig(roles="megatron")


def test_an_impossible_megatron_layout_falls_back_and_says_so():
    """The equivalence tests' CNN (a strided patch conv and a residual conv block) has no Megatron layout the
    plan can compute in place: the tp axis is placed by cost, and the description names the fallback instead
    of the plan being refused."""
    from tests.equivalence import tiny_cnn

    model, batches = tiny_cnn()
    opts = planning_options(TrainConfig().shard_options(), ClusterSpec.load("dgx-a100"))
    prog = plan_program(capture(model, (), batches[0]), parse_mesh("tp=2"), FlowOptions(shard=opts, cache=False))
    text = describe_plan(prog.forward)
    assert prog.forward.attrs["roles"] == "name"
    assert "(roles by name; Megatron's layout impossible on the tp axes: placed there by cost" in text


def test_compile_logs_the_plan_and_repr_shows_it(caplog):
    """One process (a 1-rank gloo group): compile logs the plan's block on logger "autopar", and the module's
    repr is the same block."""
    import os

    import torch.distributed as dist

    import autopar

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = autopar.init_mesh("cpu", dp=1)
        torch.manual_seed(0)
        with caplog.at_level(logging.INFO, logger="autopar"):
            model = autopar.compile(MLP(), mesh, kwargs={"x": torch.randn(8, 16), "target": torch.randn(8, 16)})
        logged = [r.getMessage() for r in caplog.records if r.name == "autopar"]
        assert any(m.startswith("plan on mesh [dp=1] (roles by name)") and "dp=1: unused (size 1)" in m for m in logged)
        shown = [line.strip() for line in repr(model).splitlines()]
        assert all(line.strip() in shown for line in model.describe().splitlines()) and "predicted:" in repr(model)
    finally:
        if started:
            dist.destroy_process_group()


def test_autopar_plan_says_which_roles_it_used(tmp_path, capsys):
    """``autopar plan`` prints the plan's block, whose first line names the roles: by name (the default), or the
    ILP's free choice with ``--roles auto``."""
    from autopar.cli import main

    for flags, said in (([], "(roles by name)"), (["--roles", "auto"], "(roles chosen by the ILP)")):
        path = tmp_path / "plan.json"
        assert main(["plan", "tiny-mlp", "--mesh", "dp=2,tp=2", "--no-baselines", "-o", str(path), *flags]) == 0
        text = capsys.readouterr().out
        assert f"plan on mesh [dp=2, tp=2] {said}" in text, text
