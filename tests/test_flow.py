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
