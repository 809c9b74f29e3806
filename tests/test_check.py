"""`autopar check` and the rank simulator under it: agreement on a scaled-down GPT-3 (dp x tp and pp x tp), T5 on
pp x tp and a file.py:fn model (with a plan file), a model with dropout against autopar's keyed dropout; the first
differing op named when a collective, a stage boundary or the dropout masks are broken on purpose; a no_grad
block, a GRU and non-tensor arguments (and a call that changes one: refused).
Cost: about 45-75 s on a loaded 2-core machine (twelve checks of small models, one process)."""

from __future__ import annotations

import re

import pytest
import torch

from autopar.check.simtrain import SimCompiled
from autopar.check.step import check_model
from autopar.cli import main
from autopar.errors import SimulationError
from autopar.ir.core import MeshSpec
from autopar.passes.shard import ShardOptions
from autopar.runtime.build import rng
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm import pending as inflight
from autopar.runtime.comm.context import use_comm
from autopar.runtime.sim import ranksim
from autopar.runtime.sim.ranksim import SimWorld

GPT3 = "gpt3-175b:n_layer=2,n_embd=64,n_head=4,vocab_size=256,batch=4,seq=8"

MODEL_FILE = """
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)
    def forward(self, x, target):
        y = self.b(torch.nn.functional.gelu(self.a(x))) + x
        return torch.nn.functional.mse_loss(y, target)
def make():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8), torch.randn(4, 8))
"""


def _check(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["check", *argv])
    return rc, capsys.readouterr().out


def test_check_agrees_on_scaled_down_gpt3(capsys) -> None:
    rc, out = _check(capsys, GPT3, "--mesh", "dp=2,tp=2")
    assert rc == 0 and "agrees on mesh [dp=2, tp=2]" in out, out
    assert float(re.search(r"largest relative difference (\S+)", out).group(1)) < 1e-10


def test_check_file_model_with_plan(tmp_path, capsys) -> None:
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"{path}:make", "--mesh", "dp=2,tp=2", "--no-baselines", "-o", str(plan)]) == 0
    capsys.readouterr()
    rc, out = _check(capsys, f"{path}:make", "--mesh", "dp=2,tp=2", "--plan", str(plan))
    assert rc == 0 and "agrees" in out, out


def test_check_names_a_broken_forward_collective(monkeypatch, capsys) -> None:
    """Reductions that forget to reduce: the first all-reduce or reduce-scatter's output differs and is named."""

    def no_reduce(c, x, axis, op, then=None):
        return inflight.Pending(None, lambda: then(x.clone()) if then is not None else x.clone())

    monkeypatch.setattr(inflight, "start_reduce", no_reduce)
    # least memory shards the weights over tp, so the forward reduces partial sums
    rc, out = _check(capsys, GPT3, "--mesh", "tp=2", "--objective", "memory")
    assert rc == 1 and "first op whose output differs" in out, out
    assert re.search(r"= (all_reduce|reduce_scatter)\(%\w+\) \{axis=tp", out), out
    assert "  # transformer" in out and "inputs: %" in out, out  # the module path and the input placements


def test_check_names_a_broken_backward_collective(monkeypatch, capsys) -> None:
    """Megatron's f without its backward all-reduce: forward agrees, a gradient differs, and the op whose
    backward made it (a grad_all_reduce) is named among the consumers."""
    monkeypatch.setattr(inflight, "bwd_grad_all_reduce", lambda c, g, axis: inflight.Pending(None, lambda: g))
    rc, out = _check(capsys, GPT3, "--mesh", "tp=2", "--objective", "memory")
    assert rc == 1 and "first gradient that differs" in out, out
    assert "grad_all_reduce" in out.split("made by the backward of its consumers:")[1], out


def test_simulated_collectives() -> None:
    """Collectives computed by their definition over simulated ranks, forward and backward; ranks that
    call different collectives, and a failing rank, are reported."""
    world = SimWorld(MeshSpec((("dp", 2), ("tp", 2))))

    def step(rank: int):
        c = world.comm(rank)
        x = torch.full((2, 3), float(rank), dtype=torch.float64, requires_grad=True)
        with use_comm(c):
            y = coll.all_reduce(x, "tp")  # ranks (dp, tp): 0 1 | 2 3
            z = coll.all_gather(y, "dp", 0)
            m = torch.tensor([float(rank)])
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=c.groups["dp"])
            (z * torch.arange(4.0, dtype=torch.float64).view(4, 1)).sum().backward()
            got = torch.zeros(2)
            if c.coords["tp"] == 0:
                c.groups["tp"].send([torch.full((2,), float(rank))], 1, 0).wait()
            else:
                c.groups["tp"].recv([got], 0, 0).wait()
        return float(y[0, 0]), z[:, 0].tolist(), float(m), x.grad[0, 0].item(), got.tolist()

    out = world.run(step)
    assert [o[0] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert out[0][1] == [1.0, 1.0, 5.0, 5.0] and out[3][1] == [1.0, 1.0, 5.0, 5.0]
    assert [o[2] for o in out] == [2.0, 3.0, 2.0, 3.0]
    # all_gather's backward keeps the rank's rows (dp=0: rows 0-1 weigh 0,1; dp=1: 2,3); all_reduce's is identity
    assert [o[3] for o in out] == [0.0, 0.0, 2.0, 2.0]
    assert out[1][4] == [0.0, 0.0] and out[3][4] == [2.0, 2.0]

    def mismatched(rank: int):
        with use_comm(world.comm(rank)):
            coll.all_reduce(torch.ones(rank + 1), "tp")

    with pytest.raises(SimulationError, match="called different collectives"):
        world.run(mismatched)

    def failing(rank: int):
        if rank == 2:
            raise ValueError("boom")
        with use_comm(world.comm(rank)):
            coll.all_reduce(torch.ones(1), "tp")

    with pytest.raises(SimulationError, match=r"rank 2 .*boom"):
        world.run(failing)


def test_check_covers_pipeline_stage_boundaries(monkeypatch, capsys) -> None:
    """pp=2 x tp=2: one microbatch through both stages agrees; with every pipeline send perturbed by 1e-3 the
    first op of the second stage is named, its received input marked as a stage boundary."""
    rc, out = _check(capsys, GPT3, "--mesh", "pp=2,tp=2")
    assert rc == 0 and "agrees on mesh [pp=2, tp=2]" in out, out
    send = ranksim.SimWorld.send

    def perturbed(world, key, tensors):
        pipeline = key[0] is None  # point to point between global ranks: the pipeline's
        return send(world, key, [t * 1.001 if pipeline and t.is_floating_point() else t for t in tensors])

    monkeypatch.setattr(ranksim.SimWorld, "send", perturbed)
    rc, out = _check(capsys, GPT3, "--mesh", "pp=2,tp=2")
    assert rc == 1 and "first op whose output differs" in out and "stage=1>" in out, out
    assert "(received from stage 0: a stage boundary)" in out, out


def test_check_on_t5_pipeline_agrees(tmp_path, capsys) -> None:
    """T5 (autopar/models/small_families.py) from a file.py:fn on pp=2 x tp=2."""
    path = tmp_path / "t5.py"
    path.write_text(
        "import torch\nfrom autopar.models.small_families import FAMILIES\n"
        "def make():\n    torch.manual_seed(0)\n    model, kw = FAMILIES['t5'](torch.Generator().manual_seed(1))\n"
        "    return model, (), kw\n"
    )
    rc, out = _check(capsys, f"{path}:make", "--mesh", "pp=2,tp=2")
    assert rc == 0 and "agrees on mesh [pp=2, tp=2]" in out, out


def test_check_with_dropout_against_keyed_dropout_on_one_device(monkeypatch) -> None:
    """A model with dropout is compared with autopar's keyed masks drawn on one device (the report says so):
    it agrees, and masks drawn from each rank's local positions (the per-rank stream bug) are named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    mesh = MeshSpec((("dp", 2), ("tp", 2)))
    report = check_model(model, (x,), {}, mesh, options=ShardOptions(objective="memory"))
    assert report.agrees and "keyed dropout on one device" in report.summary(), report.summary()
    of = rng.DropoutSite.of.__func__

    def local_positions(cls, *args):
        site = of(cls, *args)
        site.index = [torch.arange(len(i)) for i in site.index]
        return site

    monkeypatch.setattr(rng.DropoutSite, "of", classmethod(local_positions))
    report = check_model(model, (x,), {}, mesh, options=ShardOptions(objective="memory"))
    assert not report.agrees and "= aten.dropout(" in report.summary(), report.summary()


class _NoGradScale(torch.nn.Module):
    """Scales by a norm computed under no_grad: no gradient may flow through the norm."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = h.norm(dim=-1, keepdim=True) + 1.0
        return (self.b(h / s) ** 2).mean()


class _Recurrent(torch.nn.Module):
    """A GRU (aten.gru.input, tagged random for its dropout argument, here 0) and non-tensor arguments
    (a float, a bool and a None, which torch.export bakes into the graph)."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(8, 12, batch_first=True)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x, y, mask=None, scale: float = 1.0, shift: bool = True):
        out = self.head(self.rnn(x)[0][:, -1]) * scale
        return torch.nn.functional.cross_entropy(out + 1.0 if shift else out, y)


class _Ema(torch.nn.Module):
    """Updates a running average buffer in place under no_grad and reads it in the same forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return ((h - self.ema) ** 2).mean()


@pytest.mark.parametrize("case", ["no_grad", "gru_and_constant_inputs", "buffer_update", "frozen"])
def test_check_agrees_on_no_grad_blocks_rnns_and_non_tensor_inputs(case: str) -> None:
    """A no_grad block fed by values needing gradients used to be inlined with its gradient (the check named
    fc.weight's gradient: silently wrong training); a GRU without dropout was refused as a random op; a float
    keyword argument failed lowering ("the graph produced a float"); a buffer the forward updates in place was
    given to the programs as the model's forward had left it ("the captured graph differs from the model"); a frozen
    weight got a gradient in the whole program and none on the ranks (a crash)."""
    torch.manual_seed(0)
    mesh = MeshSpec((("dp", 2), ("tp", 2)))
    if case == "no_grad":
        model, args, kwargs = _NoGradScale(), (torch.randn(4, 8),), {}
    elif case == "buffer_update":
        model, args, kwargs = _Ema(), (torch.randn(4, 8),), {}
    elif case == "frozen":  # its frozen weight has no gradient on the ranks (the whole program gave it one)
        model, args, kwargs = (
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)),
            (torch.randn(4, 8),),
            {},
        )
        model[0].requires_grad_(False)
    else:
        model, args = _Recurrent(), (torch.randn(4, 5, 8), torch.randint(0, 3, (4,)))
        kwargs = {"mask": None, "scale": 2.0, "shift": False}
    report = check_model(model, args, kwargs, mesh, options=ShardOptions(objective="memory"))
    assert report.agrees and report.max_diff < 1e-10, report.summary()


def test_a_call_with_another_non_tensor_input_than_compiled_is_refused() -> None:
    """torch.export bakes a float argument into the program: calling with another value would silently compute
    with the compiled one, so the module names the argument instead (and the same value trains)."""
    torch.manual_seed(0)
    model, args = _Recurrent(), (torch.randn(4, 5, 8), torch.randint(0, 3, (4,)))
    sim = SimCompiled.of(model, MeshSpec((("dp", 2),)), args, {"scale": 2.0})
    assert all(torch.isfinite(loss) for loss in sim.train_step(*args, scale=2.0))
    with pytest.raises(SimulationError, match=r"input .scale. is 3.0 but the model was compiled with 2.0"):
        sim.train_step(*args, scale=3.0)


def test_a_check_of_a_plan_that_splits_nothing_says_so() -> None:
    """A tiny model's fastest plan replicates everything: "agrees" then checks no sharding, and the report says
    so; a least-memory plan splits and the note goes."""
    torch.manual_seed(0)
    model, x, mesh = _NoGradScale(), torch.randn(4, 8), MeshSpec((("dp", 2),))
    assert "no sharding was checked" in check_model(model, (x,), {}, mesh).summary()
    split = check_model(model, (x,), {}, mesh, options=ShardOptions(objective="memory"))
    assert split.agrees and "no sharding was checked" not in split.summary()
