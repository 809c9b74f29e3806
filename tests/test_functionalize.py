"""passes/functionalize.py: in-place ops and writes through views become out-of-place SSA values."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from autopar.check.simtrain import SimCompiled
from autopar.errors import CaptureError, PlanError, SimulationError
from autopar.ir.core import MeshSpec, Op, Partial, Ref, Shard, TensorType, resolve_target
from autopar.passes.capture import capture
from autopar.passes.functionalize import _mutated_arg, functionalize
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions
from autopar.runtime.build.stages import require_whole_buffer_writes
from autopar.runtime.comm.shards import shard_tensor, unshard_tensor
from autopar.solver.sharding.strategies import op_strategies


class ShiftRight(torch.nn.Module):
    """Hugging Face's _shift_right (T5, BART): writes through a slice and a select, then in place."""

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 7
        shifted.masked_fill_(shifted == -100, 0)
        return shifted * 2


class Views(torch.nn.Module):
    """Views taken before a write are read after it; writes through a chain of views and a transpose;
    an in-place op's result used in place of its input; an in-place op that would promote the dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        row = y[1]  # a view taken before the writes below, read after them
        first, rest = y.split([1, 3], dim=0)  # pieces of a multi-output view, read after the writes
        y.view(2, 2, 5)[0, 1].add_(1.0)  # a write through a chain of views
        y.t()[2].mul_(3.0)  # a write through a transpose
        z = y.unsqueeze(0).sub_(0.5)  # the in-place result (a view of y) is used below
        w = torch.zeros(4, 5, dtype=torch.float32)
        w.add_(x.double())  # stays float32, as in-place ops keep their input's dtype
        return row * 10 + z.sum(0) + w + first.sum() + rest.mean(0)


def _run(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.fx.GraphModule]:
    """The functionalized captured graph of ``module`` (no parameters) run on ``inputs``."""
    ep = capture(module, inputs).exported
    gm = functionalize(ep.graph_module)
    users = iter(inputs)
    flat = [ep.constants[s.target] if s.target in ep.constants else next(users) for s in ep.graph_signature.input_specs]
    return gm(*flat)[0], gm


@pytest.mark.parametrize(
    "module,inputs",
    [
        (ShiftRight(), (torch.tensor([[5, -100, 3, 4], [-100, 9, 2, -100]]),)),
        (Views(), (torch.randn(4, 5, generator=torch.Generator().manual_seed(0)),)),
    ],
)
def test_functionalized_graph_computes_the_model_without_mutation(module, inputs):
    assert any(_mutated_arg(n) is not None for n in capture(module, inputs).exported.graph_module.graph.nodes)
    out, gm = _run(module, *inputs)
    assert not [n.target for n in gm.graph.nodes if _mutated_arg(n) is not None]
    expected = module(*(x.clone() for x in inputs))
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_graph_without_mutation_is_unchanged():
    class Pure(torch.nn.Module):
        def forward(self, x):
            return x.view(2, -1).t() * 2

    gm = capture(Pure(), (torch.randn(4, 3),)).exported.graph_module
    assert functionalize(gm) is gm


def test_write_through_an_unsupported_view_is_a_clear_error():
    class Diagonal(torch.nn.Module):
        def forward(self, x):
            y = x.clone()
            y.unfold(0, 2, 2).zero_()
            return y

    gm = capture(Diagonal(), (torch.randn(4, 4),)).exported.graph_module
    with pytest.raises(CaptureError, match="writes through a view made by aten.unfold"):
        functionalize(gm)


@pytest.mark.parametrize(
    "target,shapes,extra",
    [
        ("aten.slice_scatter", [(4, 6, 4), (4, 2, 4)], (1, 2, 6, 2)),
        ("aten.select_scatter", [(4, 6, 4), (4, 4)], (1, 3)),
        ("aten.copy", [(4, 6), (6,)], ()),
        ("aten.fill.Tensor", [(4, 6), ()], ()),
    ],
)
def test_rules_of_functionalized_ops_compute_the_whole_op(target, shapes, extra):
    """Every strategy of the ops functionalization emits, on an axis of 2: each rank's op on its shards,
    unsharded, equals the op on whole tensors."""
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    fn = resolve_target(target)
    expected = fn(*whole, *extra)
    types = {f"x{i}": TensorType("f64", tuple(s), (Shard(0),)) for i, s in enumerate(shapes)}
    op = Op(("y",), (TensorType("f64", tuple(expected.shape), (Shard(0),)),), target, (Ref("x0"), Ref("x1"), *extra))
    strategies, ruled = op_strategies(op, types, MeshSpec((("tp", 2),)), (1,))
    assert ruled and len(strategies) > 1
    for s in strategies:
        assert not any(isinstance(p[0], Partial) for p in s.outputs)  # none offered: nothing to sum
        outs = []
        for rank in range(2):
            local = [shard_tensor(x, p[0].dim, p[0].chunks, 2, rank) if isinstance(p[0], Shard) else x
                     for x, p in zip(whole, s.inputs)]  # fmt: skip
            outs.append(fn(*local, *extra))
        p = s.outputs[0][0]
        got = unshard_tensor(outs, p.dim, p.chunks) if isinstance(p, Shard) else outs[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=s.label())


class _Running(torch.nn.Module):
    """Updates its buffers in place in forward: a running sum of the batch (at the top level) and a decayed
    average under no_grad (a chain of in-place ops), read after the update."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        h = self.fc(x)
        self.seen += x.abs().sum(0)
        with torch.no_grad():
            self.avg.mul_(0.5).add_(h.mean(0))
        return ((h - self.avg) ** 2).mean()


def test_buffers_updated_in_place_keep_their_update_on_every_rank():
    """The in-place writes to a buffer stay in place on the rank's buffer (functionalized, the new values
    were dropped: ``seen`` stayed zero), so two forwards on dp=2 x tp=2 simulated ranks leave the buffers
    and the loss the model's two forwards do (float64: they differ only by the order of sums)."""
    torch.manual_seed(0)
    model, x = _Running().double(), torch.randn(4, 8, dtype=torch.float64)
    sim = SimCompiled.of(copy.deepcopy(model), MeshSpec((("dp", 2), ("tp", 2))), (x,), options=ShardOptions("memory"))
    losses = [sim(x)[0] for _ in range(2)]
    expected = [model(x) for _ in range(2)]
    full = sim.full_state_dict()
    for key in ("seen", "avg"):
        torch.testing.assert_close(full[key], getattr(model, key), rtol=1e-12, atol=0)
    torch.testing.assert_close(losses[1], expected[1].detach(), rtol=1e-12, atol=0)


def test_write_through_a_view_of_a_buffer_is_a_clear_error():
    class RowWrite(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rows", torch.zeros(4, 3))

        def forward(self, x):
            self.rows[0] = x.sum(0)
            return (x * self.rows[1]).sum()

    with pytest.raises(CaptureError, match="writes to buffer .* through the view"):
        lower(capture(RowWrite(), (torch.randn(2, 3),)))


def test_recomputing_a_forward_that_updates_a_buffer_is_refused():
    """Recomputation would run the in-place update again (the buffer got it twice, silently; batch norm's
    running statistics alike): a schedule with recompute is refused, the same schedule without it trains."""
    torch.manual_seed(0)
    model, x = _Running().double(), torch.randn(4, 8, dtype=torch.float64)
    mesh = MeshSpec((("pp", 2),))
    with pytest.raises(SimulationError, match="ScheduleError: the schedule recomputes forwards"):
        SimCompiled.of(copy.deepcopy(model), mesh, (x,), schedule_options={"recompute": 1})
    sim = SimCompiled.of(copy.deepcopy(model), mesh, (x,))
    sim.train_step(x)
    model(x)
    torch.testing.assert_close(sim.full_state_dict()["seen"], model.seen, rtol=1e-12, atol=0)


def test_a_plan_that_splits_a_buffer_updated_in_place_is_refused():
    """The update writes the rank's buffer itself: a buffer stored split (a copy is gathered for the write)
    would lose it, so building the stages refuses such a plan; stored replicated it passes."""
    prog = lower(capture(_Running(), (torch.randn(4, 8),)), MeshSpec((("tp", 2),)))
    require_whole_buffer_writes(prog)
    split = tuple(
        replace(v, type=replace(v.type, placements=(Shard(0),))) if v.name == "seen" else v for v in prog.inputs
    )
    with pytest.raises(PlanError, match=r"updates buffer %seen .* in place"):
        require_whole_buffer_writes(prog.with_(inputs=split))


def test_a_parameter_updated_in_place_in_forward_is_a_clear_error():
    """nn.Embedding(max_norm=...) renormalizes its weight in place in forward: functionalized, the ranks used the
    renormalized rows in the step but never stored them (emb.weight 57% off the model's after three steps)."""
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8, max_norm=1.0), torch.nn.Linear(8, 3))
    with pytest.raises(CaptureError, match=r"updates the parameter 0.weight in place in forward"):
        lower(capture(model, (torch.randint(0, 20, (4, 5)),)))
