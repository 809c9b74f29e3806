"""`autopar plan --mesh` from the command line on every mesh of Table 2, and baselines that cannot run on a mesh.

A baseline whose layout cannot exist on a mesh (data parallelism splitting a batch of 2 over 4 devices)
is reported as n/a with the reason; autopar's own plan is still printed and written. The expected
availability is computed here from the batch and the mesh, independently of solver/sharding/baselines.py.

Cost (in-process through ``autopar.cli.main``, measured on the shared 2-core machine): 0.2 to 6 s per mesh,
44 s wall and 28 s of CPU for the whole file.
"""

from __future__ import annotations

import json
import math

import pytest

from autopar.cli import main
from autopar.ir.axes import is_tensor_axis
from autopar.ir.core import R, Shard
from bench.table2 import meshes

# Every mesh of Table 2 (bench/table2.py: 2, 4 and 8 devices) with mmr-bert-large, whose batch of 2 makes
# the data-parallel baselines impossible on 4 and 8 devices; each larger preset on the meshes of one size
# (meshes of one size share a model, so every mesh runs twice and every preset once).
TABLE2 = [("mmr-bert-large", m) for n in (2, 4, 8) for m in meshes(n)]
TABLE2 += [(model, m) for model, n in (("mmr-1.7b", 2), ("mmr-3.6b", 4), ("mmr-7.5b", 8)) for m in meshes(n)]


def _axes(mesh: str) -> dict[str, int]:
    return {k: int(v) for k, v in (a.split("=") for a in mesh.split(","))}


def expected_reason(baseline: str, batch: int, axes: dict[str, int]) -> str | None:
    """Why a baseline cannot run, as the user should read it; None where it can. dp and ZeRO split the
    batch over every axis, Megatron over the axes not named tp*, the comm baseline fixes nothing."""
    if baseline == "comm":
        return None
    split = {a: n for a, n in axes.items() if baseline != "megatron" or not is_tensor_axis(a)}
    devices = math.prod(split.values())
    if batch % devices == 0:
        return None
    return f"batch {batch} does not divide over {devices} devices ({','.join(f'{a}={n}' for a, n in split.items())})"


@pytest.mark.parametrize(("model", "mesh"), TABLE2, ids=[f"{m}-{s}" for m, s in TABLE2])
def test_plan_every_table2_mesh(model, mesh, tmp_path, capsys):
    from autopar.plan import Plan

    path = tmp_path / "plan.json"
    # the paper's Table 2: the ILP's free choice on every axis (its meshes name free axes a0, a1, a2)
    assert main(["plan", model, "--mesh", mesh, "--roles", "auto", "--json", "-o", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = Plan.load(path)
    assert plan.stats["status"] == "optimal" and plan.stats["memory_per_device_bytes"] > 0
    (batch,) = {v.type.shape[0] for v in plan.parsed().inputs if v.kind == "input"}
    assert set(out["baselines"]) == {"megatron", "dp", "zero2", "zero3", "comm"}
    assert out["baselines_detail"] == plan.baselines
    for name, detail in plan.baselines.items():
        reason = expected_reason(name, batch, _axes(mesh))
        if reason is None:
            assert out["baselines"][name] > 0 and "unavailable" not in detail, (name, detail)
        else:
            assert out["baselines"][name] is None and detail == {"unavailable": reason}, (name, detail)


def test_plan_text_shows_unavailable_baselines_and_autopars_plan(tmp_path, capsys):
    """The issue's commands: mmr-bert-large (batch 2) on tp=4, and gpt2 on tp=3, where neither the batch
    (8) nor the vocabulary (50,257) divides by 3: autopar plans it and shards other dims."""
    path = tmp_path / "plan.json"
    assert main(["plan", "mmr-bert-large", "--mesh", "tp=4", "-o", str(path)]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()}
    assert rows["autopar"].split()[1] != "n/a" and rows["megatron"].split()[1] != "n/a"
    for name in ("dp", "zero2", "zero3"):
        assert rows[name].split(None, 1)[1].strip() == "n/a  batch 2 does not divide over 4 devices (tp=4)"
    assert f"plan written to {path}" in text and path.exists()
    assert "constraint" not in text.replace("ILP constraints", "").replace(" constraints,", "")

    assert main(["plan", "gpt2:n_layer=2", "--mesh", "tp=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "optimal"
    assert out["baselines"]["dp"] is None
    assert out["baselines_detail"]["dp"]["unavailable"] == "batch 8 does not divide over 3 devices (tp=3)"
    assert out["baselines"]["megatron"] > 0  # Megatron keeps the batch whole on tp


def test_unavailable_reason_names_the_dim_that_does_not_divide():
    """The reason comes from the placement that is not valid, for any dim, not only the batch."""
    from autopar.api import parse_mesh
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.solver.sharding.baselines import Exactly, data_parallel_constraints, unavailable_reason

    m = build("tiny-mlp")  # batch 4; its parameters have 16 and 32 features
    prog = lower(capture(m.model, m.args, m.kwargs), parse_mesh("dp=3"))
    assert unavailable_reason(prog, data_parallel_constraints(prog)) == "batch 4 does not divide over 3 devices (dp=3)"
    param = next(v for v in prog.params if len(v.type.shape) == 2)
    reason = unavailable_reason(prog, {param.name: Exactly((Shard(0),))})
    assert reason == f"dim 0 of param {param.name} (size {param.type.shape[0]}) does not divide over 3 devices (dp=3)"
    assert unavailable_reason(prog, {param.name: Exactly((R,))}) is None
    prog2 = lower(capture(m.model, m.args, m.kwargs), parse_mesh("dp=2"))
    assert unavailable_reason(prog2, data_parallel_constraints(prog2)) is None


def test_impossible_constraint_error_says_what_is_wrong():
    """shard() given a fixed placement that cannot exist names the value and the mesh; errors never tell a user
    to relax constraints, and an unconstrained program is never reported as constrained."""
    from autopar.api import parse_mesh
    from autopar.errors import InfeasibleError
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.shard import ShardOptions, shard
    from autopar.solver.sharding.baselines import Exactly

    m = build("tiny-mlp")
    prog = lower(capture(m.model, m.args, m.kwargs), parse_mesh("dp=3"))
    (x, *_) = [v for v in prog.inputs if v.kind == "input"]
    with pytest.raises(InfeasibleError) as err:
        shard(prog, ShardOptions(constrain={x.name: Exactly((Shard(0),))}))
    assert f"%{x.name}" in str(err.value) and "[dp=3]" in str(err.value) and "relax" not in str(err.value)
    assert shard(prog, ShardOptions()).memory_bytes > 0


def test_plan_for_a_zero_bubble_schedule_lays_out_its_v(tmp_path, capsys):
    """``--schedule zbv`` plans the schedule's own placement (two stages per rank in a V) and balances
    them with its stash points; without a pipeline axis the flag is refused."""
    path = tmp_path / "plan.json"
    args = ["plan", "tiny-gpt2", "--mesh", "pp=2", "--schedule", "zbv", "--microbatches", "4", "--no-baselines"]
    assert main([*args, "-o", str(path)]) == 0
    pipeline = json.loads(path.read_text())["pipeline"]
    assert pipeline["schedule"] == "zbv" and pipeline["waves"] == 1
    assert [s["rank"] for s in pipeline["stage_plan"]["stages"]] == [0, 1, 1, 0]
    capsys.readouterr()
    assert main(["plan", "tiny-gpt2", "--mesh", "dp=2", "--schedule", "zbv"]) != 0
    assert "--schedule need a pipeline axis" in capsys.readouterr().err


def test_plan_refuses_a_microbatch_count_the_batch_does_not_divide(capsys):
    """`autopar plan` names the counts that fit, as compile does (it planned batch 5 in 2 microbatches, which
    compile then refused)."""
    assert main(["plan", "tiny-gpt2:batch=5", "--mesh", "pp=2", "--microbatches", "2", "--no-baselines"]) == 2
    assert "a batch of 5 cannot be cut into 2 equal microbatches" in capsys.readouterr().err
