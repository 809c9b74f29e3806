"""The rank simulator (runtime/sim/ranksim.py): after a failed run the next run of the same world starts clean;
pipelines (pp x dp with ZeRO, zero-bubble, sub-pipelined tp) train exactly on simulated ranks; a frozen submodule
stays frozen; a loss summed over the batch is refused with microbatches."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.errors import SimulationError
from autopar.ir.core import MeshSpec
from autopar.models.small_families import FAMILIES
from autopar.passes.shard import ShardOptions
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.context import use_comm
from autopar.runtime.execute.split_backward import deferring_weights, run_backward
from autopar.runtime.sim.ranksim import SimWorld
from autopar.solver.sharding.cost import TrainingSetup
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train


def test_a_collective_left_half_met_by_a_failed_run_does_not_leak_into_the_next():
    """Rank 1 waits in an all-reduce when rank 0 fails; the next run's all-reduces must meet afresh. Without the
    reset, rank 1's stale contribution stays in the meeting point and the next run fails (shown once), which made
    test_check's failure reports depend on thread timing. Cost: ~0.1 s."""
    world = SimWorld(MeshSpec((("tp", 2),)), timeout=10.0)
    rv = world.group("tp", 0).rv  # the tp group's meeting point

    def fail_once_joined(rank: int) -> None:
        if rank == 0:
            while rv.arrived == 0:  # rank 1 is inside the all-reduce: now fail
                time.sleep(0.001)
            raise ValueError("boom")
        with use_comm(world.comm(rank)):
            coll.all_reduce(torch.full((1,), 100.0), "tp")

    with pytest.raises(SimulationError, match="rank 0 .*boom"):
        world.run(fail_once_joined)

    def reduce(rank: int) -> float:
        with use_comm(world.comm(rank)):
            return float(coll.all_reduce(torch.full((1,), float(rank + 1)), "tp"))

    assert world.run(reduce) == [3.0, 3.0]


# (mesh, schedule, its options, microbatches, ZeRO stage, sub-pipelined tp)
PIPELINE_RUNS = {
    "pp2xdp2-1f1b-zero1": ((("pp", 2), ("dp", 2)), "1f1b", {}, 2, 1, False),
    "pp2xdp2-interleaved-zero3": ((("pp", 2), ("dp", 2)), "interleaved", {"chunks": 2}, 2, 3, False),
    "pp2xdp2-zbv": ((("pp", 2), ("dp", 2)), "zbv", {}, 4, 0, False),
    "pp2xtp2-subpipelined": ((("pp", 2), ("tp", 2)), "1f1b", {"recompute": 1}, 2, 0, True),
}


@pytest.mark.parametrize("run", list(PIPELINE_RUNS))
def test_pipelines_train_exactly_on_simulated_ranks(run: str) -> None:
    """Pipelines on the simulator (``autopar/check/simtrain.py``) beyond pp x tp: pp x dp with ZeRO-1 and ZeRO-3 and
    zero-bubble V, and sub-pipelined tensor parallelism with recomputation; two AdamW steps of tiny GPT-2
    equal one process (float64, every state-dict key). The pp x tp families: tests/test_families_sim.py.
    Cost: about 1-2 s each."""
    axes, schedule, options, microbatches, zero, sub = PIPELINE_RUNS[run]
    torch.manual_seed(0)
    model, batch = FAMILIES["gpt2"](torch.Generator().manual_seed(1))
    model = float64_model(model)
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(
        model, MeshSpec(axes), (), batch, options=ShardOptions(setup=TrainingSetup(zero=zero)),
        microbatches=microbatches, schedule=schedule, schedule_options=options, sub_pipeline_tp=sub, float64=True,
    )  # fmt: skip
    make_optimizer("adamw", sim)
    losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [batch, batch], "adamw")
    assert loss_error(losses, ref) < TOL, (losses, ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


def test_each_simulated_rank_defers_its_own_weight_gradients() -> None:
    """A split backward's B files its W with the step of its own thread: the rank simulator runs every rank
    in a thread of one process. With one process-wide stack (as before) thread 0's B landed in thread 1's
    list (the block opened last), so a rank ran another rank's W: the zero-bubble families on pp x tp
    simulated ranks then failed about one run in three (collectives out of order, a 1e-3 loss error)."""
    both_open, both_done = threading.Barrier(2), threading.Barrier(2)
    filed: dict[int, int] = {}

    def rank(r: int) -> None:
        w = torch.nn.Parameter(torch.ones(2))
        x = torch.ones(2, requires_grad=True)
        with deferring_weights() as pending:
            both_open.wait()
            if r == 0:
                run_backward([(w * x).sum()], [torch.ones(())])
            both_done.wait()
            filed[r] = len(pending)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert filed == {0: 1, 1: 0}


class _FrozenEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.head = torch.nn.Linear(8, 4)
        self.enc.requires_grad_(False)

    def forward(self, x, t):
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.enc(x))), t)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_frozen_submodule_is_not_trained(zero: int) -> None:
    """Parameters with requires_grad=False get no gradient on the ranks (they were trainable Parameters: an
    optimizer over them moved them, and the losses drifted 5% from the model's in three steps): two SGD steps
    on dp=2 x tp=2 (the module's optimizer, ZeRO-2 over dp too) equal the model's, frozen weights unchanged."""
    torch.manual_seed(0)
    model = _FrozenEncoder().double()
    batch = {"x": torch.randn(8, 8, dtype=torch.float64), "t": torch.randn(8, 4, dtype=torch.float64)}
    options = ShardOptions(objective="memory", setup=TrainingSetup(zero=zero, zero_axes=("dp",) if zero else None))
    sim = _two_sgd_steps_equal_the_models(model, batch, MeshSpec((("dp", 2), ("tp", 2))), options)
    assert all(torch.equal(sim.full_state_dict()[k], v) for k, v in model.state_dict().items() if k.startswith("enc"))


class _SparseEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1)

    def forward(self, ids, t):
        return torch.nn.functional.mse_loss(self.head(self.emb(ids)).squeeze(-1), t)


def test_a_sparse_embedding_trains_with_the_default_optimizer() -> None:
    """``nn.Embedding(sparse=True)`` gives its weight a sparse gradient, which torch's fused kernels refuse at
    ``step()``: make_optimizer's default keeps torch's own kernel there (it failed: "`_fused_sgd` does not
    support sparse gradients"), and two SGD steps on dp=2 equal the model's."""
    torch.manual_seed(0)
    model = _SparseEmbedding().double()
    batch = {"ids": torch.randint(0, 50, (4, 6)), "t": torch.randn(4, 6, dtype=torch.float64)}
    _two_sgd_steps_equal_the_models(model, batch, MeshSpec((("dp", 2),)), ShardOptions(objective="memory"))


def _two_sgd_steps_equal_the_models(model, batch: dict, mesh: MeshSpec, options: ShardOptions) -> SimCompiled:
    """Two SGD steps of ``model`` compiled on ``mesh`` (the module's own optimizer) give the model's losses and
    parameters, to ``TOL``; the compiled module after them."""
    sim = SimCompiled.of(copy.deepcopy(model), mesh, (), batch, options=options)
    make_optimizer("sgd", sim)
    losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
    reference = copy.deepcopy(model)
    assert loss_error(losses, train(reference, [batch, batch])) < TOL
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where)
    return sim


def test_a_summed_loss_over_microbatches_is_refused() -> None:
    """Averaging the microbatches' losses halves a loss summed over the batch (reduction='sum') and its
    gradients: with two microbatches the step's loss was half the model's and the parameters 94% off, silently.
    The module refuses it and names the op; one microbatch (the program itself is exact) trains as the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    loss = _SummedLoss(model)
    batch = {"x": torch.randn(8, 8, dtype=torch.float64), "t": torch.randn(8, 4, dtype=torch.float64)}
    mesh = MeshSpec((("dp", 2),))
    with pytest.raises(SimulationError, match=r"BatchError: the loss is a sum over the batch .*aten.mse_loss"):
        SimCompiled.of(copy.deepcopy(loss), mesh, (), batch, microbatches=2)
    sim = SimCompiled.of(copy.deepcopy(loss), mesh, (), batch, options=ShardOptions(objective="memory"))
    make_optimizer("sgd", sim)
    losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
    assert loss_error(losses, train(copy.deepcopy(loss), [batch, batch])) < TOL


class _SummedLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, t):
        return torch.nn.functional.mse_loss(self.model(x), t, reduction="sum")
