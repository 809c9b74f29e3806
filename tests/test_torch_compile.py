"""``torch_compile=True`` (runtime/build/compiled.py): the rank programs compiled with Inductor train the same
numbers as one process and as autopar eager (float64, 1e-10 relative) on dp x tp, pp x tp with 1F1B and ZB-V
(the split backward, each stage's backward compiled as a B graph and a W graph) and ZeRO-3, with dropout's
keyed masks and in bf16; and dynamo really compiled them.

One spawn of 4 gloo ranks runs every mesh (compiling is the expensive part: Inductor's cache is a temporary
folder the ranks share, or ``TORCHINDUCTOR_CACHE_DIR`` when set, which a second run then reads). Each
compiled run is checked to have compiled graphs (dynamo's counters) and to have run every training program
through its compiled call with no compile failure and no call left eager but ZeRO-3's gathers, so a silent
fallback to eager fails the test.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.options import ShardOptions
from tests._dist import run_distributed
from tests.equivalence import compare_jobs
from tests.exactness import TOL

EAGER, COMPILED = {"torch_compile": False}, {"torch_compile": True}
SHARDED = ShardOptions(objective="memory")  # splits the tiny model's parameters on tp (the time objective would not)
ZERO3 = ShardOptions(setup=TrainingSetup(zero=3))


def _both(schedule: str, opts: dict | None = None) -> list[tuple]:
    return [(schedule, opts or {}, EAGER), (schedule, opts or {}, COMPILED)]


JOBS = [
    {"name": "dp2tp2", "axes": {"dp": 2, "tp": 2}, "runs": _both("1f1b"), "compile_kwargs": {"options": SHARDED}},
    {
        "name": "pp2tp2",
        "axes": {"pp": 2, "tp": 2},
        "runs": _both("1f1b") + _both("zbv"),  # ZB-V: two stages per rank, B and W apart
        "compile_kwargs": {"options": SHARDED},
        "check_forward": False,  # the forward programs are compiled and checked on dp2tp2 (compiling costs)
    },
    {
        "name": "dp4-zero3",
        "axes": {"dp": 4},
        "runs": _both("1f1b"),
        "compile_kwargs": {"options": ZERO3},
        "make_optimizer": True,
        "check_forward": False,
    },
]
# what each job's plan must really use: tp splits parameters; ZeRO-3 keeps slices of them
SHARDS_PARAMS = {"dp2tp2", "pp2tp2", "dp4-zero3"}


def _ranks(rank: int, world: int, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    common = {"model_name": "gpt2", "steps": 2, "microbatches": 2, "batch": 4}
    out = compare_jobs(rank, world, [{**common, **job} for job in JOBS])
    out["dropout-bf16"] = _dropout_and_bf16(rank)
    return out


@pytest.mark.multiproc
@pytest.mark.heavy  # `make test-heavy`: a cold Inductor cache costs 5-15 minutes here, more than `make test` may
@pytest.mark.timeout(1800)  # Inductor compiles about 20 programs on every rank: minutes on 2 shared cores
def test_compiled_programs_equal_one_process_and_eager_on_dp_tp_pp_zbv_zero3(tmp_path):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path / "inductor")  # one folder for every rank
    results = run_distributed(_ranks, 4, cache, timeout=1700)
    for rank, res in enumerate(results):
        for job in JOBS:
            name = job["name"]
            out = res[name]
            for key, r in out.items():
                at = f"{name} {key}, rank {rank}"
                assert r["loss_rel"] < TOL and r["forward_rel"] < TOL, (at, r["loss_rel"], r["forward_rel"])
                assert r["param_rel"] < TOL, (at, r["worst_param"], r["param_rel"])
                assert not r["missing"], at
                if name in SHARDS_PARAMS:
                    assert r["local_numel"] < r["full_numel"], f"{at}: the plan keeps whole parameters"
                log = r["compile_log"]
                if "torch_compile=True" not in key:
                    assert log is None and r["graphs"] == 0, at
                    continue
                assert r["graphs"] > 0, f"{at}: dynamo compiled no graph"
                assert not log["failed"], (at, log["failed"])
                # the collectives are in the compiled graphs: the only calls left eager are ZeRO-3's gathers
                for label, calls in log["eager"].items():
                    assert all(c.startswith("Zero3Params.") for c in calls), (at, label, calls)
                stages = [f"stage{s}" for s in r["stages"].tolist()]
                assert set(stages) <= set(log["compiled"]), (at, log["compiled"])  # each ran compiled
                if key.startswith("zbv"):  # each stage's backward compiled as B and W (compiled_split.py)
                    split = log["split"]
                    assert all(split.get(s, {}).get("graphs") for s in stages), (at, split)
                    assert all(g["W"] > 0 for s in stages for g in split[s]["graphs"]), (at, split)
                    assert all(split[s]["calls"]["W"] == split[s]["calls"]["split"] for s in stages), (at, split)
                eager = out[key.replace("torch_compile=True", "torch_compile=False")]
                rel = ((r["losses"] - eager["losses"]).abs() / eager["losses"].abs()).max().item()
                assert rel < TOL, f"{at}: compiled and eager losses differ by {rel:.2e}"
        _check_dropout_and_bf16(res["dropout-bf16"], rank)


# -- dropout's keyed masks and mixed precision, compiled against eager ----------------------------------------
def _dropout_and_bf16(rank: int) -> dict:
    import autopar
    from tests.equivalence import tiny_gpt2
    from tests.test_dropout import gpt2_with_dropout

    mesh = autopar.init_mesh("cpu", dp=2, tp=2)
    out: dict = {}
    model, batches = gpt2_with_dropout(batch=4)
    for compiled in (False, True):
        torch.manual_seed(0)  # the masks' seed (rank 0's initial seed)
        m = autopar.compile(model, mesh, kwargs=batches[0], objective="memory", torch_compile=compiled)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for b in batches:
            losses.append(m.train_step(**b).item())
            opt.step()
            opt.zero_grad()
        out[f"dropout{compiled}"] = torch.tensor(losses, dtype=torch.float64)
        if compiled:
            out["dropout_log"] = {"failed": list(m.compile_log.failed), "compiled": sorted(m.compile_log.first_s)}
    m.eval()
    with torch.no_grad():  # dropout off: another loss, so the masks above were drawn
        out["no_dropout"] = torch.tensor(float(m(**batches[0])))
    model, batches = tiny_gpt2(batch=4, seq=16, steps=3)
    for precision in ("fp32", "bf16"):
        for compiled in (False, True) if precision == "bf16" else (False,):
            m = autopar.compile(
                model, mesh, kwargs=batches[0], objective="memory", precision=precision, torch_compile=compiled
            )
            out[f"{precision}{compiled}"], _ = sgd_without_compile_warnings(m, batches)
    return out


def sgd_without_compile_warnings(m, batches: list[dict]) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """``m.train_step`` and an SGD step (lr 0.1) on each batch, a compile failure's ``RuntimeWarning`` an error:
    the losses (float64) and the optimizer."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure's warning fails the run
        for b in batches:
            losses.append(m.train_step(**b).item())
            opt.step()
            opt.zero_grad()
    return torch.tensor(losses, dtype=torch.float64), opt


def _check_dropout_and_bf16(out: dict, rank: int) -> None:
    at = f"rank {rank}"
    rel = ((out["dropoutTrue"] - out["dropoutFalse"]).abs() / out["dropoutFalse"].abs()).max().item()
    assert rel < TOL, f"{at}: dropout compiled vs eager {rel:.2e}"
    assert not out["dropout_log"]["failed"] and "stage0" in out["dropout_log"]["compiled"], (at, out["dropout_log"])
    assert abs(out["no_dropout"].item() - out["dropoutFalse"][0].item()) > 1e-3, f"{at}: dropout drew no mask"
    # bf16: both runs round differently from fp32 (Inductor computes a fused kernel's inside in fp32, eager
    # rounds after each op); the compiled run must be as close to fp32 as eager bf16 is, within BF16_NOISE
    fp32, eager, compiled = out["fp32False"], out["bf16False"], out["bf16True"]
    eager_err = ((eager - fp32).abs() / fp32.abs()).max().item()
    compiled_err = ((compiled - fp32).abs() / fp32.abs()).max().item()
    print(f"{at}: bf16 losses' largest relative distance from fp32: eager {eager_err:.2e}, compiled {compiled_err:.2e}")
    assert eager_err > 0, f"{at}: bf16 did not change the losses (not computed in bf16?)"
    assert compiled_err <= BF16_NOISE * max(eager_err, 2**-8), (at, compiled_err, eager_err)


# compiled bf16 may be at most this many times as far from fp32 as eager bf16 is (with a floor of 2^-8 relative):
# both round to bf16, at different places (Inductor keeps a fused kernel's inside in fp32); the test prints both
BF16_NOISE = 4.0


# -- one process: a compile failure names the op and runs that graph eagerly ----------------------------------
class ReluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), target)


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train_relu_mlp(compiled: bool) -> tuple[torch.Tensor, object]:
    import autopar

    torch.manual_seed(0)
    model = ReluMLP().double()
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 16, generator=g).double(), "target": torch.randn(8, 16, generator=g).double()}]
    batches *= 2
    m = autopar.compile(model, autopar.init_mesh("cpu", dp=1), kwargs=batches[0], torch_compile=compiled)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for b in batches:
        losses.append(m.train_step(**b).item())
        opt.step()
        opt.zero_grad()
    return torch.tensor(losses, dtype=torch.float64), m


# heavy since session 15 (24 s of Inductor compiling): make test keeps one compiled run,
# tests/test_torch_compile_small.py, and stays within its 15 minutes
@pytest.mark.heavy
def test_a_compile_failure_names_the_kernel_warns_and_runs_eagerly(one_process):
    import torch._inductor.config as inductor_config

    eager, _ = _train_relu_mlp(False)
    with inductor_config.patch({"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"}):  # Inductor's own test hook
        with pytest.warns(RuntimeWarning, match=r"torch.compile failed on stage0: op aten.relu.default"):
            broken, m = _train_relu_mlp(True)
    assert m.compile_log.failed and "relu" in m.compile_log.failed[0], m.compile_log.failed
    assert torch.equal(broken, eager)  # the failing graph ran eagerly: the same numbers
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fine, m = _train_relu_mlp(True)  # without the bug: compiled, no warning, the same numbers to rounding
    assert not m.compile_log.failed and "stage0" in m.compile_log.first_s
    assert ((fine - eager).abs() / eager.abs()).max() < TOL


def test_a_split_backward_runs_a_compiled_regions_backward_once_and_equals_the_whole():
    """B of a compiled region (one autograd node) keeps what it gave its weights; W starts below it."""
    import torch._functorch.config as functorch_config

    from autopar.runtime.execute.split_backward import input_gradients

    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    region = torch.compile(lambda x: torch.tanh(x @ w).sum(0), backend="aot_eager")
    x0 = torch.randn(3, 4, dtype=torch.float64)
    ones = torch.ones(4, dtype=torch.float64)
    gw, gx = torch.autograd.grad(torch.tanh(x0.requires_grad_() @ w).sum(0), (w, x0), ones)
    with functorch_config.patch(donated_buffer=False):  # B retains the graph
        x = x0.detach().requires_grad_()
        y = region(x)
        runs = []
        y.grad_fn.register_prehook(lambda grads: runs.append(1))
        assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"
        weights = input_gradients([(y, torch.ones_like(y))])
        assert w.grad is None and torch.allclose(x.grad, gx)  # B: the input's gradient only
        weights.run()
    assert torch.allclose(w.grad, gw) and len(runs) == 1  # W: the weight's, without running the region again
