"""Mixtures of experts train exactly with every experts kernel transformers offers (issue 31), on simulated ranks.

Mixtral, Qwen3-MoE and OLMoE, built small from their configs (``autopar/models/small_families.py``: one layer,
hidden 32, 4 experts, top-2), trained two AdamW steps in float64 on dp=2 x tp=2 and pp=2 x tp=2 simulated ranks
(``autopar/check/simtrain.py``) against the model in one process (``TOL``, every loss and state-dict key):

- ``grouped_mm``, transformers' default: captured as transformers' ``grouped_mm_fallback`` op (float32 and
  float64; ``torch._grouped_mm`` in half types), which autopar lowered as ``aten.grouped_mm_fallback``, a name no
  op has, until the IR kept ops' namespaces (an AttributeError on every rank before);
- ``eager``, a Python loop over the experts hit, whose shapes depend on the routing: autopar captures it through
  the grouped kernel (``passes/capture.py``), so the grouped plan is also checked against the eager loop run in
  one process, and an eager-configured Mixtral is compiled itself;
- ``batched_mm``, a gather of every token's expert weights and a batched matmul.

The router's top-k runs in every case; on dp x tp the auxiliary load-balancing loss (``output_router_logits``,
coefficient 0.01) is part of the loss. Under pp it is left out: a pipeline computes it per microbatch, which is
not the batch's (another issue's, microbatch batch coupling). None of these families has a router z-loss.

Every plan is priced on a cluster whose computation is slow (``SLOW``), where splitting pays; the test asserts
that the grouped kernel's plans shard expert weights and split grouped matmuls over tp, so the sharding rules
of the grouped matmul (``solver/sharding/rules/contractions.py``) are what is checked, and that batched_mm's
split attention weights there.
Cost: about 130 s wall on this 2-core machine shared by five sessions, 13 plans (about a minute of CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec, Replicate
from autopar.models.small_families import moe
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train
from tests.test_families_sim import OBJECTIVES

MESHES = {"dp2xtp2": MeshSpec((("dp", 2), ("tp", 2))), "pp2xtp2": MeshSpec((("pp", 2), ("tp", 2)))}
FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
GROUPED = {"transformers.grouped_mm_fallback", "aten._grouped_mm"}


def _train(
    family: str, mesh: str, kernel: str | None, references: tuple[str | None, ...], objective: str = "time"
) -> SimCompiled:
    """Plan ``family`` built with ``kernel`` on ``mesh``, train it two AdamW steps on simulated ranks and assert
    both the losses and the final state equal two steps of the model in one process, once per kernel in
    ``references`` (the same initial weights computed by that kernel)."""
    torch.manual_seed(0)
    pp = mesh.startswith("pp")
    model, batch = moe(family, kernel, aux_loss=0.0 if pp else 0.01)(torch.Generator().manual_seed(1))
    model = float64_model(model)
    refs = {k: copy.deepcopy(model) for k in references}
    sim = SimCompiled.of(
        model, MESHES[mesh], (), batch, options=OBJECTIVES[objective], microbatches=2 if pp else 1, float64=True
    )
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(2)], dtype=torch.float64)
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    full = sim.full_state_dict()
    for k, reference in refs.items():
        if k is not None:
            reference.model.config._experts_implementation = k
        with Float64Mode():  # float64 semantics; torch._grouped_mm itself has no float64 kernel
            ref = train(reference, [batch, batch], "adamw")
        assert loss_error(losses[:, 0], ref) < TOL, (k, losses[:, 0], ref)
        err, where, missing = state_error(full, reference)
        assert not missing and err < TOL, (k, err, where, missing)
    return sim


def _split_over_tp(sim: SimCompiled, where: str = ".experts.") -> tuple[list[str], list[str]]:
    """The weights whose name holds ``where`` that the plan shards over tp, and the grouped matmuls it splits
    there."""
    prog = sim.program
    tp = prog.mesh.index("tp")
    weights = [v.name for v in prog.params if where in v.name and not isinstance(v.type.placements[tp], Replicate)]
    grouped = [o.result for o in prog.ops if o.target in GROUPED and not isinstance(o.type.placements[tp], Replicate)]
    return weights, grouped


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_default_kernel_trains_exactly(family: str, mesh: str) -> None:
    """transformers' default experts kernel (grouped_mm), checked against itself and the eager loop."""
    sim = _train(family, mesh, None, (None, "eager"))
    experts, grouped = _split_over_tp(sim)
    assert experts and grouped, f"the plan splits no expert weight ({experts}) or grouped matmul ({grouped}) over tp"


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_mm_kernel_trains_exactly(family: str, mesh: str) -> None:
    """batched_mm gathers each token's expert weights (an index of the [E, N, K] weights by the routing). Its
    fastest plans on ``SLOW`` split only the batch (over both axes); the memory objective shards the weights."""
    sim = _train(family, mesh, "batched_mm", ("batched_mm",), objective="memory")
    experts, _ = _split_over_tp(sim)
    attention, _ = _split_over_tp(sim, ".self_attn.")
    assert experts and attention, f"the plan splits too little over tp: experts {experts}, attention {attention}"


def test_eager_kernel_model_trains_exactly() -> None:
    """A model configured with the eager loop over experts (data-dependent shapes) is compiled as it is."""
    sim = _train("mixtral", "dp2xtp2", "eager", ("eager",))
    experts, grouped = _split_over_tp(sim)
    assert experts and grouped, (experts, grouped)
