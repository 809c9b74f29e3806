"""The flow (passes/flow.py): one ordered pass list, every pass dumped and verified, forward and training
programs cut at the same stages, a plan's own stages kept. Planning only (meta device), ~15 s."""

from __future__ import annotations

import math
import re

import pytest
import torch

from autopar.api import parse_mesh
from autopar.errors import PipelineError, StageMemoryError
from autopar.ir.parser import parse
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.flow import FLOW, FlowOptions, flow_index, plan_program
from autopar.passes.lower import lower
from autopar.passes.manager import PASSES
from autopar.passes.shard import ShardOptions
from autopar.solver.sharding.solve import smallest_budget

GPT2 = "gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,batch=4,seq=8"


@pytest.fixture(scope="module")
def captured():
    m = build(GPT2)
    return capture(m.model, m.args, m.kwargs)


def test_every_ir_pass_of_the_flow_is_registered():
    ir_passes = FLOW[FLOW.index("shard") : FLOW.index("codegen")]
    assert set(ir_passes) <= set(PASSES), set(ir_passes) - set(PASSES)
    assert FLOW[0] == "capture" and FLOW[-1] == "codegen"


def test_pipeline_flow_dumps_and_verifies_every_pass(captured, tmp_path):
    planned = plan_program(captured, parse_mesh("pp=2,tp=2"), FlowOptions(shard=ShardOptions()), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    want = [f"{flow_index(n):02d}-{n}" for n in FLOW[:-1]]
    stems = [re.sub(r"\.(ir|py)$", "", n) for n in names]
    assert [s for s in stems if not s.endswith(".forward")] == want, names
    assert "08-insert-transfers.forward.ir" in names
    for name in names:
        if name.endswith(".ir"):
            verify(parse((tmp_path / name).read_text()))
    assert planned.num_stages == 2 and planned.stage_plan is not None
    # forward keeps every output, training the loss; both are cut at the same ops and place parameters alike
    assert len(planned.train.outputs) == 1 and len(planned.forward.outputs) == len(planned.sharded.outputs) > 1
    fwd_stage = {op.result: op.attrs["stage"] for op in planned.forward.ops}
    assert all(fwd_stage[op.result] == op.attrs["stage"] for op in planned.train.ops if op.result in fwd_stage)
    assert {v.name: v.type for v in planned.train.inputs if v.kind == "param"}.items() <= {
        v.name: v.type for v in planned.forward.inputs
    }.items()
    sends = [op for op in planned.train.ops if op.target == "send"]
    assert sends and all(op.attrs["stage"] == 0 for op in sends)


def test_budget_is_per_device_and_the_stage_budget_its_own(captured):
    """The memory budget is per device. The shard pass solves the whole program before the split, a device
    holds 1/pp of it: the least memory the whole program needs does not fit one budget but fits pp of them.
    assign-stages holds each rank's stages to the budget, or to ``FlowOptions.stage_budget_bytes``."""
    mesh = parse_mesh("pp=2,tp=2")
    least = smallest_budget(lower(captured, mesh.without_pipeline()), ShardOptions())
    opts = ShardOptions(budget_bytes=0.75 * least)
    planned = plan_program(captured, mesh, FlowOptions(shard=opts, stage_budget_bytes=math.inf, cache=False))
    assert planned.shard_result.how == "as asked" and planned.shard_result.memory_bytes <= 1.5 * least
    assert planned.stage_plan.budget_bytes == math.inf
    with pytest.raises(StageMemoryError):
        plan_program(captured, mesh, FlowOptions(shard=opts, stage_budget_bytes=1.0, cache=False))


def test_mesh_without_pipeline_is_one_stage(captured):
    planned = plan_program(captured, parse_mesh("dp=2"))
    assert planned.num_stages == 1 and planned.stage_plan is None
    assert {op.attrs["stage"] for op in planned.forward.ops} == {0}
    assert not any(op.target in ("send", "recv") for op in planned.forward.ops)
    assert planned.train is not None and planned.require_train() is planned.train


def test_planned_stages_are_kept_and_a_wrong_placement_refused(captured):
    mesh = parse_mesh("pp=2,tp=2")
    first = plan_program(captured, mesh, FlowOptions(cache=False))
    again = plan_program(captured, mesh, sharded=first.staged)
    assert again.stage_plan is None  # the plan's stages, not a new split
    assert [op.attrs["stage"] for op in again.train.ops] == [op.attrs["stage"] for op in first.train.ops]
    with pytest.raises(PipelineError, match="places stages on ranks"):
        plan_program(captured, mesh, FlowOptions(stage_to_rank=(1, 0)), sharded=first.sharded)


def test_training_needs_a_scalar_loss_first():
    model = torch.nn.Linear(8, 4, device="meta")  # returns activations, not a loss
    planned = plan_program(capture(model, (torch.empty(4, 8, device="meta"),)), parse_mesh("dp=2"))
    assert planned.train is None
    with pytest.raises(PipelineError, match="first output to be the scalar training loss"):
        planned.require_train()


def test_the_flow_is_one_pass_manager_over_flow(captured, tmp_path, monkeypatch):
    """plan_program makes one PassManager, over FLOW itself, and every dump of the flow is numbered by it."""
    from autopar.passes import flow

    made: list[flow.PassManager] = []

    class Counted(flow.PassManager):
        def __post_init__(self):
            super().__post_init__()
            made.append(self)

    monkeypatch.setattr(flow, "PassManager", Counted)
    plan_program(captured, parse_mesh("dp=2"), FlowOptions(shard=ShardOptions()), dump_dir=tmp_path)
    assert len(made) == 1 and made[0].pipeline == list(FLOW)
    assert set(made[0].outputs) == set(FLOW[FLOW.index("lower") : FLOW.index("codegen")])
    stems = {re.sub(r"(\.forward)?\.(ir|py)$", "", p.name) for p in tmp_path.iterdir()}
    assert stems == {f"{made[0].number(n):02d}-{n}" for n in FLOW[:-1]}, stems


def test_a_pass_added_to_flow_runs_in_its_place_and_renumbers_the_dumps(captured, tmp_path, monkeypatch):
    """Adding a pass to the flow is one registration and one entry in FLOW: plan_program runs it after the pass
    before it, its dump carries its place and the passes after it move one number on. Without the entry the
    registered pass does not run."""
    from autopar.passes import flow
    from autopar.passes.manager import register_pass

    seen: list[str] = []

    @register_pass("mark-for-test")
    def _mark(prog, opts):
        seen.append(prog.attrs.get("ilp_status", "unsolved"))
        return prog

    try:
        plan_program(captured, parse_mesh("dp=2"), dump_dir=tmp_path / "without")
        assert seen == [] and not any("mark" in p.name for p in (tmp_path / "without").iterdir())
        monkeypatch.setattr(flow, "FLOW", (*FLOW[:3], "mark-for-test", *FLOW[3:]))
        planned = plan_program(captured, parse_mesh("dp=2"), dump_dir=tmp_path / "with")
    finally:
        PASSES.pop("mark-for-test")
    assert seen == ["optimal"]  # on the shard pass's output
    stems = sorted(re.sub(r"\.(ir|py)$", "", p.name) for p in (tmp_path / "with").iterdir())
    assert stems[2:5] == ["03-shard", "04-mark-for-test", "05-insert-collectives"], stems
    assert stems[-2:] == ["09-insert-transfers", "09-insert-transfers.forward"], stems
    assert "mark-for-test" in planned.timings


def test_a_plan_file_takes_the_flow_up_at_a_later_pass(captured, tmp_path):
    """A plan's program enters the same flow later: with its own stages at prune-outputs, without them at split;
    the dumps keep the flow's numbers and only the passes that ran are dumped (and the capture)."""
    mesh = parse_mesh("pp=2,tp=2")
    first = plan_program(captured, mesh)
    for name, sharded, ran in (("own", first.staged, FLOW[6:8]), ("none", first.sharded, FLOW[4:8])):
        planned = plan_program(captured, mesh, dump_dir=tmp_path / name, sharded=sharded)
        stems = {re.sub(r"(\.forward)?\.(ir|py)$", "", p.name) for p in (tmp_path / name).iterdir()}
        assert stems == {"01-capture"} | {f"{flow_index(n):02d}-{n}" for n in ran}, (name, stems)
        assert planned.lowered is None and planned.shard_result is None and set(planned.timings) == set(ran)
        assert planned.forward == first.forward and planned.train == first.train
    assert (tmp_path / "own" / "08-insert-transfers.ir").read_text() == (
        tmp_path / "none" / "08-insert-transfers.ir"
    ).read_text()


def test_compile_dumps_each_ranks_codegen_by_the_manager(tmp_path):
    """autopar.compile with dump_dir on one process: every pass of the flow dumped, numbered, codegen's by the
    PassManager that generated the rank's modules (``09-codegen.rank0.LABEL.py``, each its module's code),
    beside the training stage's local IR and the schedule."""
    import torch.distributed as dist

    import autopar

    spec = build("tiny-mlp", device="cpu", seed=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = autopar.compile(
            spec.model, autopar.init_mesh("cpu", dp=1), args=spec.args, kwargs=spec.kwargs, dump_dir=str(tmp_path)
        )
    finally:
        dist.destroy_process_group()
    names = sorted(p.name for p in tmp_path.iterdir())
    stems = {re.sub(r"(\.forward)?\.(ir|py)$", "", n).split(".rank")[0] for n in names if n != "schedule.txt"}
    assert stems == {f"{flow_index(n):02d}-{n}" for n in FLOW}, names
    codegen = [n for n in names if n.startswith("09-codegen") and n.endswith(".py")]
    assert codegen == [f"09-codegen.rank0.{label}.py" for label in sorted(module.stage_modules)] and codegen
    for label, gm in module.stage_modules.items():
        assert (tmp_path / f"09-codegen.rank0.{label}.py").read_text() == gm.code
    assert set(module.passes.timings) == {"codegen"} and module.passes.pipeline == list(FLOW)
    assert {"09-codegen.rank0.stage0.local.ir", "schedule.txt"} <= set(names)
