"""Megatron's f fused with the matmuls that read it (runtime/comm/column_linear.py): the same outputs and gradients as
the separate ops in float64, the weight gradients computed while f's all-reduce is in flight, and codegen fusing
exactly the f's that only matmuls read (their weights read through a transpose included). The multi-process
equality with one process, Megatron's layout on tp=2, is tests/test_equivalence.py (it checks the fused call ran)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec, Op, Program, R, Ref, Shard, TensorType, Value
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.runtime.build.codegen import codegen
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm import pending as inflight
from autopar.runtime.comm.column_linear import column_linears
from autopar.runtime.comm.context import use_comm
from autopar.solver.sharding.baselines import megatron_options
from tests.exactness import TOL

F64 = torch.float64


READERS = {  # kind, weight shape, with a bias, frozen weight
    "2d": [("linear", (6, 8), True, False), ("mm", (8, 3), True, True), ("mm", (8, 5), False, False)],
    "3d": [("linear", (6, 8), True, False), ("linear", (4, 8), False, False)],
}


def _separate(f: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str) -> torch.Tensor:
    if kind == "mm":
        return torch.mm(f, w) if b is None else torch.addmm(b, f, w)
    return torch.nn.functional.linear(f, w, b)


@pytest.mark.parametrize("case", sorted(READERS))
def test_fused_equals_separate_ops_in_outputs_and_gradients(one_rank_tp, case):
    """One f read by every reader: biased and plain ``linear`` and ``mm``, a frozen weight (its gradient stays
    None); 2-D and 3-D inputs."""
    torch.manual_seed(0)
    readers = READERS[case]
    x = torch.randn(*((2, 5) if case == "3d" else (10,)), 8, dtype=F64)
    ws = [torch.randn(shape, dtype=F64) for _, shape, _, _ in readers]
    bs = [torch.randn(shape[0] if kind == "linear" else shape[1], dtype=F64) if bias else None
          for kind, shape, bias, _ in readers]  # fmt: skip
    grads = None
    results = []
    for fused in (False, True):
        leaf = x.clone().requires_grad_(True)
        w = [t.clone().requires_grad_(not frozen) for t, (*_, frozen) in zip(ws, readers)]
        b = [t.clone().requires_grad_(True) if t is not None else None for t in bs]
        kinds = tuple(kind for kind, *_ in readers)
        with use_comm(one_rank_tp):
            if fused:
                ys = column_linears(leaf, tuple(w), tuple(b), kinds, "tp")
            else:
                f = coll.grad_all_reduce(leaf, "tp")
                ys = tuple(_separate(f, wi, bi, k) for wi, bi, k in zip(w, b, kinds))
            grads = grads or [torch.randn_like(y) for y in ys]
            torch.autograd.backward(list(ys), grads)
        results.append((ys, leaf.grad, [t.grad for t in w + b if t is not None]))
    (want, want_gx, want_gw), (got, got_gx, got_gw) = results
    for a, e in zip(got, want):
        assert torch.equal(a, e)  # the forward is the same call
    torch.testing.assert_close(got_gx, want_gx, rtol=TOL, atol=0)
    for a, e in zip(got_gw, want_gw):
        assert (a is None) == (e is None)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=TOL, atol=0)
    assert [g is None for g in got_gw[: len(readers)]] == [frozen for *_, frozen in readers]


def test_a_reader_the_loss_does_not_use_gets_no_gradient(one_rank_tp):
    """As with the separate ops, whose node never runs: the unused reader's weight and bias keep no gradient (an
    optimizer skips them; a zero gradient would decay and move them), the used one's gradients are the same."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=F64)
    ws, b2 = [torch.randn(6, 8, dtype=F64), torch.randn(5, 8, dtype=F64)], torch.randn(5, dtype=F64)
    grads = []
    for fused in (False, True):
        leaf = x.clone().requires_grad_(True)
        w = [t.clone().requires_grad_(True) for t in ws]
        b = b2.clone().requires_grad_(True)
        with use_comm(one_rank_tp):
            if fused:
                y1, _ = column_linears(leaf, tuple(w), (None, b), ("linear", "linear"), "tp")
            else:
                f = coll.grad_all_reduce(leaf, "tp")
                y1, _ = torch.nn.functional.linear(f, w[0]), torch.nn.functional.linear(f, w[1], b)
            y1.sum().backward()
        grads.append((leaf.grad, w[0].grad, w[1].grad, b.grad))
    (gx, gw1, gw2, gb), (fx, fw1, fw2, fb) = grads
    assert gw2 is None and gb is None and fw2 is None and fb is None
    torch.testing.assert_close(fx, gx, rtol=TOL, atol=0)
    torch.testing.assert_close(fw1, gw1, rtol=TOL, atol=0)


def test_fused_only_where_the_backward_runs_whole():
    """A pp=2 x tp=2 GPT-2 with Megatron's layout on simulated ranks: the training stages fuse their f's under 1F1B,
    not under ZB-H1 (its split backward's W would re-enter the fused node and all-reduce again) nor with
    sub-pipelined TP (which cuts at f); the forward programs (the user's own backward) fuse in every case."""
    spec = build("gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=32,batch=4,seq=16", device="cpu", seed=0)
    prog = lower(capture(spec.model, spec.args, spec.kwargs), MeshSpec((("tp", 2),)))
    opts = megatron_options(prog)
    mesh = MeshSpec((("pp", 2), ("tp", 2)))
    counts = {}
    for schedule, sub in (("1f1b", False), ("zb-h1", False), ("1f1b", True)):
        sim = SimCompiled.of(
            spec.model, mesh, spec.args, spec.kwargs, options=opts, microbatches=2, schedule=schedule,
            sub_pipeline_tp=sub,
        )  # fmt: skip
        modules = sim.modules[0].stage_modules.items()
        counts[schedule, sub] = {k: sum(n.target is column_linears for n in gm.graph.nodes) for k, gm in modules}
    assert counts["1f1b", False]["stage0"] > 0 and counts["1f1b", False]["forward0"] > 0, counts
    assert counts["zb-h1", False]["stage0"] == 0 and counts["1f1b", True]["stage0"] == 0, counts
    assert counts["zb-h1", False]["forward0"] == counts["1f1b", True]["forward0"] == counts["1f1b", False]["forward0"]


class _Log(TorchDispatchMode):
    """Names the matmuls dispatched, beside the events the patched all-reduce writes."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.events.append("matmul")
        return func(*args, **(kwargs or {}))


def _in_flight(events: list[str]) -> int:
    """Matmuls run between the all-reduce's issue and its wait."""
    return events[events.index("issue") + 1 : events.index("wait")].count("matmul")


def test_weight_gradients_are_computed_while_the_all_reduce_is_in_flight(one_rank_tp, monkeypatch):
    """The fused backward issues f's all-reduce after the input gradients and waits after the weight gradients
    (two readers: two weight gradients in flight); the separate ops have none in flight, which is the point."""
    events: list[str] = []
    start = inflight.bwd_grad_all_reduce

    def logged(c, g, axis):
        events.append("issue")
        p = start(c, g, axis)
        finish = p.finish
        p.finish = lambda: (events.append("wait"), finish())[1]
        return p

    monkeypatch.setattr(inflight, "bwd_grad_all_reduce", logged)
    torch.manual_seed(0)
    x = torch.randn(10, 8, dtype=F64, requires_grad=True)
    w = [torch.randn(6, 8, dtype=F64, requires_grad=True), torch.randn(4, 8, dtype=F64, requires_grad=True)]
    counts = []
    for fused in (True, False):
        events.clear()
        with use_comm(one_rank_tp):
            if fused:
                ys = column_linears(x, tuple(w), (None, None), ("linear", "linear"), "tp")
            else:
                f = coll.grad_all_reduce(x, "tp")
                ys = tuple(torch.nn.functional.linear(f, wi) for wi in w)
            with _Log(events):
                torch.autograd.backward(list(ys), [torch.ones_like(y) for y in ys])
        counts.append(_in_flight(events))
    assert counts == [2, 0], events


def _program() -> Program:
    """tp=2, column-parallel readers of one f: a ``linear``, an ``mm`` with its bias add, an ``mm`` reading its
    weight through a transpose computed after f (hoisted ahead of it); a second f read by a ``relu`` and a third by
    a ``linear`` with a 1-D weight (neither fused)."""
    t = TensorType
    s0, s1 = (Shard(0),), (Shard(1),)
    inputs = (
        Value("x", "input", t("f64", (10, 8), (R,))),
        Value("w1", "param", t("f64", (6, 8), s0)),
        Value("w2", "param", t("f64", (8, 4), s1)),
        Value("b2", "param", t("f64", (4,), s0)),
        Value("w3", "param", t("f64", (6, 8), s0)),
        Value("v", "param", t("f64", (8,), (R,))),
    )
    ops = (
        Op(("f",), (t("f64", (10, 8), (R,)),), "grad_all_reduce", (Ref("x"),), {"axis": "tp"}),
        Op(("y1",), (t("f64", (10, 6), s1),), "aten.linear", (Ref("f"), Ref("w1"))),
        Op(("m2",), (t("f64", (10, 4), s1),), "aten.mm", (Ref("f"), Ref("w2"))),
        Op(("y2",), (t("f64", (10, 4), s1),), "aten.add.Tensor", (Ref("m2"), Ref("b2"))),
        Op(("t3",), (t("f64", (8, 6), s1),), "aten.t", (Ref("w3"),)),
        Op(("y3",), (t("f64", (10, 6), s1),), "aten.mm", (Ref("f"), Ref("t3"))),
        Op(("g",), (t("f64", (10, 8), (R,)),), "grad_all_reduce", (Ref("x"),), {"axis": "tp"}),
        Op(("r",), (t("f64", (10, 8), (R,)),), "aten.relu", (Ref("g"),)),
        Op(("h",), (t("f64", (10, 8), (R,)),), "grad_all_reduce", (Ref("x"),), {"axis": "tp"}),
        Op(("d",), (t("f64", (10,), (R,)),), "aten.linear", (Ref("h"), Ref("v"))),
    )
    return Program(MeshSpec((("tp", 2),)), inputs, ops, tuple(Ref(n) for n in ("y1", "y2", "y3", "r", "d")))


def test_codegen_fuses_each_f_only_matmuls_read(one_rank_tp):
    """The f read by three matmuls becomes one fused call (the transpose of its third weight moved ahead of it,
    the bias add inside it); the f a ``relu`` reads stays. Run on the rank's shards, the fused module computes
    what the unfused one does, outputs and gradients."""
    prog = _program()
    torch.manual_seed(0)
    whole = {v.name: torch.randn(v.type.shape, dtype=F64) for v in prog.inputs if v.kind == "param"}
    mods = {fuse: codegen(prog, {"tp": 0}, whole.__getitem__, overlap_tp=fuse) for fuse in (True, False)}
    order = {fuse: [n.target for n in gm.graph.nodes if n.op == "call_function"] for fuse, gm in mods.items()}
    assert order[True].count(column_linears) == 1 and order[True].count(coll.grad_all_reduce) == 2, order[True]
    assert order[True].index(torch.ops.aten.t.default) < order[True].index(column_linears)
    assert column_linears not in order[False] and order[False].count(coll.grad_all_reduce) == 3
    x = torch.randn(10, 8, dtype=F64)
    results = []
    for gm in mods.values():
        leaf = x.clone().requires_grad_(True)
        with use_comm(one_rank_tp):
            outs = gm(leaf)
            torch.manual_seed(1)
            torch.autograd.backward(list(outs), [torch.randn_like(o) for o in outs])
        results.append((outs, leaf.grad, {n: p.grad for n, p in gm.named_parameters()}))
    (got, got_gx, got_gp), (want, want_gx, want_gp) = results
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    torch.testing.assert_close(got_gx, want_gx, rtol=TOL, atol=0)
    assert got_gp.keys() == want_gp.keys() == {"w1", "w2", "b2", "w3", "v"}
    for n in want_gp:
        torch.testing.assert_close(got_gp[n], want_gp[n], rtol=TOL, atol=0)
