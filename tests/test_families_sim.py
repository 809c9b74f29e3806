"""Hugging Face families built small from their configs (``autopar/models/small_families.py``), each checked exactly on
simulated ranks, on dp=2 x tp=2 (every op's values and gradients) and trained on pp=2 x tp=2.

Every family is planned on dp=2 x tp=2 under both objectives and one float64 training step (forward,
backward, gradient sync) of every simulated rank is compared, value by value and gradient by
gradient, with the unsharded program and the model itself (``autopar.check.step.check_model``, tolerance
1e-10 relative; the largest difference seen is about 1e-15). Language models are trained on a float64
cross-entropy of their logits (HF's own loss casts to float32), vision models on a cross-entropy of
their class logits; dropout is off.

The fastest plan (``objective="time"``) of a model this small on this machine's spec is replication
(computing is cheaper than any collective), which would check nothing; so the time objective is priced
on a cluster whose computation is slow (``SLOW``), where splitting every op pays, and the plans split
most values on both axes. ``objective="memory"`` shards weights as much as it can (Megatron layouts,
vocab-parallel embeddings and losses, partial sums).

Regressions kept here: DistilBERT's padding row trained under a vocab-parallel embedding (fixed in
``runtime/comm/collectives.py``); Falcon's in-place ``div_`` after a collective and T5's ``-inf`` relative
positions were false reports of the checker (``autopar/check/step.py``); Mixtral's in-place router
normalization (``/=`` on a top-k result) differed before the captured graph was functionalized.
Also exact when tried (left out for time): Qwen2, MPT, GPT-NeoX, Gemma, Phi, OLMoE, Qwen2-MoE, BART, Swin,
and tp=2 alone for every family here.

On pp=2 x tp=2 each family trains two AdamW steps through every simulated rank's ``ParallelModule`` (its
pipeline schedule: every schedule is used by some family; point to point through the simulator) against the
model in one process, float64 semantics on both sides (``autopar/check/float64.py``: the models' own float32 RMS
norms and rotary tables would otherwise differ by rounding), every loss and state-dict key at ``TOL``. Perturbing
every pipeline message by 1e-3 fails GPT-2, T5 and ViT there (tried by hand).

Cost: about 40-70 s on a loaded 2-core machine for dp x tp (26 checks of 1-3 s, one process); 6-18 s for
pp x tp (13 trainings).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.check.step import check_model
from autopar.ir.core import MeshSpec, Replicate
from autopar.models.small_families import FAMILIES
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train

DP_TP = MeshSpec((("dp", 2), ("tp", 2)))
PP_TP = MeshSpec((("pp", 2), ("tp", 2)))
SLOW = ClusterSpec.load("local-cpu:peak_flops.fp32=1MFLOP/s,memory_bandwidth=1MB/s").replace(
    nodes=1, devices_per_node=4
)
OBJECTIVES = {"time": ShardOptions(objective="time", cluster=SLOW), "memory": ShardOptions(objective="memory")}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_step_is_exact_on_dp_tp(family: str, objective: str) -> None:
    torch.manual_seed(0)
    model, kwargs = FAMILIES[family](torch.Generator().manual_seed(1))
    report = check_model(model, (), kwargs, DP_TP, options=OBJECTIVES[objective])
    assert report.agrees, report.summary()
    assert report.max_diff < 1e-10 and report.loss == pytest.approx(report.loss_reference, rel=1e-12)
    assert report.compared > 100  # values and gradients of every op, not the loss alone
    split = [
        sum(not isinstance(t.placements[a], Replicate) for op in report.program.ops for t in op.types) for a in (0, 1)
    ]
    assert min(split) >= 10, f"the plan splits too little to check anything: {split} values split per axis"


# each family's pipeline schedule, every schedule at least once (name, options, microbatches); the batch-norm
# ResNet runs one microbatch (its batch statistics are a microbatch's, as on real ranks)
PIPELINES: dict[str, tuple[str, dict, int]] = {
    "gpt2": ("1f1b", {}, 2), "opt": ("gpipe", {}, 2), "llama": ("interleaved", {"chunks": 2}, 2),
    "bloom": ("zb-h1", {}, 2), "falcon": ("zb-h2", {}, 2), "mistral": ("zbv", {}, 2),
    "mixtral": ("dualpipev", {}, 4), "bert": ("wave", {"waves": 2}, 2), "distilbert": ("scp", {}, 2),
    "t5": ("1f1b", {"recompute": 1}, 2), "vit": ("gpipe", {}, 2), "resnet": ("1f1b", {}, 1),
    "convnext": ("interleaved", {"chunks": 2}, 2),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_exactly_on_pp_tp(family: str) -> None:
    """Two SGD steps of the family on pp=2 x tp=2 simulated ranks (``autopar/check/simtrain.py``: every rank's
    ``ParallelModule`` with its pipeline schedule, point-to-point through the simulator) equal two steps of
    the model in one process: every loss and every key of the state dict, float64, ``TOL``."""
    torch.manual_seed(0)
    model, kwargs = FAMILIES[family](torch.Generator().manual_seed(1))
    model = float64_model(model)
    kwargs = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    name, options, microbatches = PIPELINES[family]
    sim = SimCompiled.of(
        model, PP_TP, (), kwargs, options=OBJECTIVES["time"], microbatches=microbatches, schedule=name,
        schedule_options=options, float64=True,
    )  # fmt: skip
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**kwargs)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():  # the model's own float32 upcasts (RMS norms, rotary tables) in float64, as the programs
        ref = train(reference, [kwargs, kwargs], "adamw")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    full = sim.full_state_dict()  # batch norm's running statistics and step counter (num_batches_tracked) too
    err, where, missing = state_error(full, reference)
    assert not missing and err < TOL, (err, where, missing)
