"""Zero-bubble schedules compiled: each stage's backward as two Inductor graphs, B (input gradients) and W
(weight gradients: runtime/build/compiled_split.py), B run at the schedule's ``B`` and W at its ``W``.

One spawn of 4 gloo ranks trains the tiny MLP (``tiny-mlp``) in float64 on pp=2 x tp=2 (its parameters split
over tp: the all-reduces functional collectives inside the compiled graphs) with 1F1B and with ZB-V (two
stages per rank, every backward split), each compiled and eagerly: losses and parameters equal one process to
1e-10 relative, and the compiled runs equal the eager ones. What proves the split ran compiled (so that a
silent fallback to eager fails the test): dynamo compiled graphs, Inductor compiled two more graphs per split
backward than it has dynamo graphs, the compile log lists each stage's backward as B and W with outputs on
both sides, each B handed its W over and each W ran later, and nothing ran eagerly or failed.
"""

from __future__ import annotations

import os

import pytest
import torch

from autopar.solver.sharding.options import ShardOptions
from tests._dist import run_distributed
from tests.equivalence import compare_jobs
from tests.exactness import TOL

EAGER, COMPILED = {"torch_compile": False}, {"torch_compile": True}
RUNS = [(s, {}, c) for s in ("1f1b", "zbv") for c in (EAGER, COMPILED)]
JOB = {
    "name": "pp2tp2",
    "axes": {"pp": 2, "tp": 2},
    "runs": RUNS,
    "compile_kwargs": {"options": ShardOptions(objective="memory")},  # splits the MLP's parameters on tp
    "check_forward": False,  # the forward programs compiled are tests/test_torch_compile_small.py's
}


def _ranks(rank: int, world: int, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    common = {"model_name": "tiny-mlp", "steps": 2, "microbatches": 2, "batch": 4}
    return compare_jobs(rank, world, [{**common, **JOB}])


@pytest.mark.multiproc
@pytest.mark.heavy  # 222-387 s cold at load 12-22 on 2 cores (4 ranks compiling): more than `make test` may spend
@pytest.mark.timeout(900)
def test_compiled_zero_bubble_splits_each_backward_into_b_and_w_graphs_and_equals_one_process(tmp_path):
    results = run_distributed(_ranks, 4, str(tmp_path / "inductor"), timeout=880)  # cold: a fresh cache
    for rank, res in enumerate(results):
        out = res["pp2tp2"]
        for key, r in out.items():
            at = f"{key}, rank {rank}"
            assert r["loss_rel"] < TOL, (at, r["loss_rel"])
            assert r["param_rel"] < TOL, (at, r["worst_param"], r["param_rel"])
            assert not r["missing"], at
            assert r["local_numel"] < r["full_numel"], f"{at}: the plan keeps whole parameters"
            log = r["compile_log"]
            if "torch_compile=True" not in key:
                assert log is None and r["graphs"] == 0, at
                continue
            assert r["graphs"] > 0, f"{at}: dynamo compiled no graph"
            assert not log["failed"] and not log["eager"], (at, log["failed"], log["eager"])
            stages = [f"stage{s}" for s in r["stages"].tolist()]
            assert set(stages) <= set(log["compiled"]), (at, log["compiled"])
            eager = out[key.replace("torch_compile=True", "torch_compile=False")]
            rel = ((r["losses"] - eager["losses"]).abs() / eager["losses"].abs()).max().item()
            assert rel < TOL, f"{at}: compiled and eager losses differ by {rel:.2e}"
            if key.startswith("1f1b"):
                assert not log["split"], (at, log["split"])  # no split backward: compiled whole
                continue
            _check_split(log, stages, r, at)


def _check_split(log: dict, stages: list[str], r: dict, at: str) -> None:
    """ZB-V: each stage's backward compiled as a B graph and a W graph, B handing W over and W run later."""
    split = log["split"]
    assert set(stages) <= set(split), f"{at}: stages {stages} without a split backward: {split}"
    halves = 0
    for label in stages:
        s = split[label]
        assert s["graphs"], f"{at}: {label}'s backward was not split"
        for g in s["graphs"]:
            assert g["W"] > 0, (at, label, g)  # the weight gradients in a graph of their own
        if all(g["B"] == 0 for g in s["graphs"]):  # the first stage: no input gradient, its backward is all W
            assert s["calls"]["whole"] > 0 and s["calls"]["split"] == 0, (at, label, s["calls"])
        else:  # each B computes the input gradients, hands its W over (fed from B: boundary tensors), W runs later
            assert all(g["boundary"] > 0 and g["compiled"] == 2 for g in s["graphs"]), (at, label, s["graphs"])
            assert s["calls"]["split"] > 0 and s["calls"]["W"] == s["calls"]["split"], (at, label, s["calls"])
        halves += sum(g["compiled"] - 1 for g in s["graphs"])
    # Inductor compiled a forward and a backward per dynamo graph, and a second backward graph per split one
    # whose halves both compute (the first stage's B computes nothing: its W is its whole backward)
    assert r["inductor_graphs"] == 2 * r["graphs"] + halves, (at, r["inductor_graphs"], r["graphs"], halves)


# -- one process, no Inductor (fast): the split itself ------------------------------------------------------
class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(4, 8, generator=g, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(8, generator=g, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.randn(8, 4, generator=g, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(x @ self.w1 + self.b)
        return (h @ self.w2).sum(0), h.mean()


def _split_backend(log, graphs: list):
    """A dynamo back end splitting each backward into B and W (``split_inner_compile``), each half run as the FX
    graph it is (no Inductor: fast) and kept in ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from autopar.runtime.build.compiled_split import split_inner_compile, weight_side

    def inner(gm, examples, **_kwargs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, examples):
        split = split_inner_compile({i for i, x in enumerate(examples) if weight_side(x)}, log, inner)
        fw = lambda g, e: split(g, e, is_backward=False)  # noqa: E731
        bw = lambda g, e: split(g, e, is_backward=True)  # noqa: E731
        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, examples)

    return backend


def test_a_split_backward_graph_computes_input_gradients_in_b_and_weight_gradients_in_w():
    """B returns the input's gradient and no weight's (each of its matmuls is a dX), hands W over, and W (the
    two dW matmuls, fed the output gradients B computed) gives every weight its gradient exactly as an eager
    backward does; an unsplit backward of the same compiled program runs both halves at once."""
    import torch._functorch.config as functorch_config

    from autopar.runtime.build.compiled_split import SplitLog
    from autopar.runtime.execute.split_backward import input_gradients

    torch._dynamo.reset()
    m = _TwoLayers()
    x0 = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seeds = [torch.ones(4, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)]
    x = x0.clone().requires_grad_()
    torch.autograd.backward(list(m(x)), seeds)
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    want_x = x.grad.clone()
    m.zero_grad(set_to_none=True)
    log, graphs = SplitLog(), []
    compiled = torch.compile(m, backend=_split_backend(log, graphs), dynamic=False)
    with functorch_config.patch(donated_buffer=False, enable_autograd_cache=False):  # B retains the graph
        for _ in range(2):
            x = x0.clone().requires_grad_()
            y, z = compiled(x)
            assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"
            weights = input_gradients([(y, seeds[0]), (z, seeds[1])])
            assert all(p.grad is None for p in m.parameters())  # B: no weight gradient yet
            assert torch.equal(x.grad, want_x)
            weights.run()
            for n, p in m.named_parameters():
                assert torch.equal(p.grad, want[n]), n
            m.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.autograd.backward(list(compiled(x)), seeds)  # unsplit: both halves at once
    assert torch.equal(x.grad, want_x) and all(torch.equal(p.grad, want[n]) for n, p in m.named_parameters())
    assert log.graphs == [{"B": 1, "W": 3, "boundary": 2, "compiled": 2}], log.graphs
    assert log.calls == {"split": 2, "whole": 1, "W": 2}, log.calls
    _fw, b, w = graphs  # the forward, then the backward's two halves

    def mms(gm):
        return sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)

    assert mms(b) == 2 and mms(w) == 2  # dX through both matmuls in B; dW1, dW2 in W: none computed twice
