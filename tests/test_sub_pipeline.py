"""Sub-pipelined tensor parallelism (Merak 5.3) in one process: the interleaved interpreter computes
what the module computes in float64 (outputs and every gradient, within 1e-10 relative), it
interleaves the sub-microbatches at the collectives in both directions, Merak's cost formula, and the
refusals. The multi-process equality with a single-process run is in tests/test_pipeline_training.py."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.fx as fx

from autopar.errors import SubPipelineError
from autopar.ir.core import MeshSpec
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.context import use_comm
from autopar.runtime.execute.subpipeline import Interleaved, record_events
from autopar.schedule.formulas import sub_pipelined_tp, sub_pipelined_tp_phases
from tests.equivalence import overlapped_issues
from tests.exactness import TOL


def _block_module() -> fx.GraphModule:
    """Two Megatron-style blocks (f, matmuls, g, residual) plus a reduce-scatter/all-gather pair and a
    local shard: every kind of cut, a residual stream live across each cut, a loss and a second output."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    h = x
    for i in range(2):
        for n in ("a", "b"):
            root.register_parameter(f"{n}{i}", torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64) / 3))
        f = g.call_function(coll.grad_all_reduce, (h,), {"axis": "tp"})
        t = g.call_function(torch.tanh, (g.call_function(torch.matmul, (f, g.get_attr(f"a{i}"))),))
        r = g.call_function(coll.all_reduce, (g.call_function(torch.matmul, (t, g.get_attr(f"b{i}"))),), {"axis": "tp"})
        h = g.call_function(torch.add, (h, r))
    rs = g.call_function(coll.reduce_scatter, (h,), {"axis": "tp", "op": "sum", "dim": 0})
    ag = g.call_function(coll.all_gather, (g.call_function(torch.sin, (rs,)),), {"axis": "tp", "dim": 0})
    ls = g.call_function(coll.local_shard, (ag,), {"axis": "tp", "dim": 1})
    loss = g.call_function(torch.sum, (g.call_function(torch.mul, (ls, ls)),))
    g.output((loss, h))
    return fx.GraphModule(root, g)


def test_interleaved_equals_the_module_in_outputs_and_gradients(one_rank_tp):
    gm = _block_module()
    xs = [torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)]
    gh = torch.randn(4, 8, dtype=torch.float64)
    half = torch.tensor(0.5, dtype=torch.float64)
    with use_comm(one_rank_tp):
        want, want_grads = [], []
        for x in xs:
            leaf = x.clone().requires_grad_(True)
            out = gm(leaf)
            torch.autograd.backward([out[0], out[1]], [half, gh])
            want.append(out)
            want_grads.append(leaf.grad)
        want_params = {n: p.grad.clone() for n, p in gm.named_parameters()}
        gm.zero_grad()
        leaves = [x.clone().requires_grad_(True) for x in xs]
        with record_events() as events:
            outs, tape = Interleaved(gm)([[leaf] for leaf in leaves])
            tape.backward([[(o[0], half), (o[1], gh)] for o in outs])
    for got, exp in zip(outs, want):
        for a, b in zip(got, exp):
            torch.testing.assert_close(a, b, rtol=TOL, atol=0)
    for leaf, exp in zip(leaves, want_grads):
        torch.testing.assert_close(leaf.grad, exp, rtol=TOL, atol=0)
    for n, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want_params[n], rtol=TOL, atol=0)
    # forward: g (all_reduce) x2, reduce_scatter, all_gather; backward cuts: f x2, reduce_scatter, local_shard
    issued = overlapped_issues(events)
    assert sorted(len(v) for v in issued.values()) == [8, 8]
    assert all(ok for v in issued.values() for _label, _h, ok in v), issued


def test_merak_sub_pipelined_cost():
    tm, ta = Fraction(3), Fraction(2)
    for k in (1, 4, 24):
        default, sub = sub_pipelined_tp(tm, ta, k)
        assert default == (3 * tm + 2 * ta) * k
        fwd, bwd = sub_pipelined_tp_phases(tm, ta, k)
        assert fwd + bwd == sub  # the paper's sum of its forward and backward forms
        q = Fraction(1, 4)
        assert sub == 3 * q * tm + 2 * q * ta + (k - q) * max(3 * tm, 2 * tm + ta, 2 * ta)
    # no communication or no computation: nothing to overlap, both costs agree
    assert sub_pipelined_tp(Fraction(2), Fraction(0), 5) == (30, 30)
    assert sub_pipelined_tp(Fraction(0), Fraction(2), 5) == (20, 20)
    # T_m = T_a, K = 24 (Merak's 6.4.3 model depth): 120 vs 72.5, a 1.66x bound beside its 1.46-1.57x
    default, sub = sub_pipelined_tp(Fraction(1), Fraction(1), 24)
    assert (default, sub) == (120, Fraction(145, 2))
    assert sub_pipelined_tp(1.0, 1.0, 24) == pytest.approx((120.0, 72.5))


def test_sub_pipelining_refuses_an_odd_microbatch_and_a_plan_without_tp_collectives():
    from autopar.api import _check_sub_pipeline
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.runtime.call.batch import sub_microbatch

    x = torch.zeros(12, 4)
    with pytest.raises(SubPipelineError, match="multiple of 8"):
        sub_microbatch((x,), {}, 4, 2)
    (half,), _ = sub_microbatch((torch.zeros(16, 4),), {}, 4, 2)
    assert half.shape == (2, 4)
    spec = build("tiny-gpt2", device="meta")
    kw = {k: v[:1] for k, v in spec.kwargs.items()}
    prog = lower(capture(spec.model, (), kw), MeshSpec((("dp", 2),)))
    with pytest.raises(SubPipelineError, match="tensor-parallel axis"):
        _check_sub_pipeline(prog, MeshSpec((("pp", 2), ("dp", 2))))


def test_a_plan_files_pipeline_section_can_ask_for_sub_pipelining():
    from autopar.plan import Plan
    from autopar.search import launch_options

    pipeline = {"pp": 2, "mesh": {"pp": 2, "tp": 2}, "schedule": "1f1b", "microbatches": 4}
    plan = Plan(fingerprint="x", mesh={"tp": 2}, program="", pipeline=pipeline)
    assert "sub_pipeline_tp" not in launch_options(plan)[1]
    plan.pipeline = {**pipeline, "sub_pipeline_tp": True}
    assert launch_options(plan)[1]["sub_pipeline_tp"] is True
