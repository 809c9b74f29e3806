"""The size of DeepSeek-V3's strategy problem, and the roles' own layout for its router.

Repeated layers fold onto one per kind and an expert block is a few grouped matmuls whatever its experts
(``solver/sharding/solve.py`` ``repeated_layers``), so the ILP the solver is given does not grow with the layers or
the experts. With roles by name on ``dp=2 x ep=2`` every batch-carrying activation is split on the batch over
``dp`` (``data_parallel_constraints``): DeepSeek-V3's router (a ``scatter`` marking its chosen groups, a ``gather``
of the chosen experts' weights) and its attention's ``q.new_empty`` keep the rows split there, where before they
had no such placement and the shard pass fell back to the inputs alone, a problem of 333k variables (BENCHMARKS.md
section 19). Each test plans a model of a few layers, a few seconds each.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec, R, Shard
from autopar.models.small_families import _MOE_CONFIGS, _lm
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.shard import AS_ASKED, ShardOptions, shard
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.experts import EXPERT_GROUPED_MM
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train

DP_EP = MeshSpec((("dp", 2), ("ep", 2)))
NAME = ShardOptions(roles="name", backend="highs")  # TrainConfig's default roles, the time objective


def _deepseek(layers: int, experts: int = 4, kernel: str = "grouped_mm"):
    """Tiny DeepSeek-V3 (``small_families._MOE_CONFIGS``: MLA, a shared expert, top-2 of the experts of the best of
    two groups; every layer a mixture of experts) with ``layers`` layers of ``experts`` routed experts, and its
    input."""
    config, cls, cfg = _MOE_CONFIGS["deepseek_v3"]
    cfg = dict(cfg, num_experts_per_tok=2, num_hidden_layers=layers, n_routed_experts=experts)
    torch.manual_seed(0)
    return _lm(config, cls, **cfg, experts_implementation=kernel)(torch.Generator().manual_seed(1))


def _planned(layers: int, experts: int = 4, **options):
    model, kwargs = _deepseek(layers, experts)
    lowered = lower(capture(model, (), kwargs), DP_EP)
    return lowered, shard(lowered, ShardOptions(**{**NAME.__dict__, **options}))


@pytest.mark.heavy  # four captures and plans, about 40 s under load
def test_the_ilp_does_not_grow_with_the_layers_or_the_experts() -> None:
    """DeepSeek-V3 on dp=2 x ep=2, roles by name: 2 and 4 layers (folded onto one), 8 and 16 experts give the ILP
    the same variables and constraints, each plan the roles' own (no fallback), its expert tables split over ep."""
    sizes = {}
    for layers, experts in ((2, 8), (4, 8), (2, 16)):
        lowered, planned = _planned(layers, experts)
        sol = planned.solution
        assert planned.how == AS_ASKED and sol.status == "optimal", (planned.how, sol.status)
        assert sol.layers == layers, sol.layers
        tables = [v for v in planned.program.params if v.name.endswith(("gate_up_proj", "experts.down_proj"))]
        assert len(tables) == 2 * layers and all(t.type.placements[1] == Shard(0) for t in tables)
        sizes[layers, experts] = (sol.variables, sol.constraints)
    assert sizes[2, 8] == sizes[4, 8] == sizes[2, 16], sizes


@pytest.mark.heavy  # two plans of one capture, about 15 s under load
def test_the_folded_plan_is_the_unfolded_optimum() -> None:
    """The same 3-layer model solved with its layers folded onto one and in full (``reuse_layers=False``): the same
    objective and every op placed alike."""
    model, kwargs = _deepseek(3)
    lowered = lower(capture(model, (), kwargs), DP_EP)
    folded = shard(lowered, NAME)
    full = shard(lowered, ShardOptions(**{**NAME.__dict__, "reuse_layers": False}))
    assert folded.solution.layers == 3 and full.solution.layers == 0
    assert folded.solution.objective == pytest.approx(full.solution.objective, rel=1e-9)
    assert folded.step_seconds == pytest.approx(full.step_seconds, rel=1e-9)
    placed = {op.result: op.type.placements for op in folded.program.ops}
    assert placed == {op.result: op.type.placements for op in full.program.ops}


@pytest.mark.heavy  # a float64 run on four simulated ranks, about 30 s under load
def test_the_router_split_on_the_batch_trains_exactly() -> None:
    """DeepSeek-V3 (grouped_mm) on dp=2 x ep=2 with roles by name: the plan is the roles' own (every batch-carrying
    activation split over dp, the router's scatter and gather among them), and two AdamW steps on simulated ranks
    equal two in one process (float64, losses and parameters within ``TOL``)."""
    model, kwargs = _deepseek(1)
    model = float64_model(model)
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(model, DP_EP, (), kwargs, options=NAME, float64=True)
    prog = sim.modules[0].train_program
    assert "plan_how" not in prog.attrs, prog.attrs.get("plan_how")
    router = [op for op in prog.ops if op.target in ("aten.scatter.value", "aten.gather")]
    assert router and all(op.type.placements[0] == Shard(0) for op in router), [str(op.type) for op in router]
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**kwargs)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():  # float64 semantics; torch._grouped_mm itself has no float64 kernel
        ref = train(reference, [kwargs, kwargs], "adamw")
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


@pytest.mark.heavy  # one capture and three plans, about 55 s at a load of 30
def test_the_free_ilp_chooses_expert_parallelism_where_it_is_cheapest() -> None:
    """OLMoE with wide experts (8 of width 4096 on hidden 256, 4 x 128 tokens, top-2: the experts are most of the
    weights and of the compute) on ep=2 (on a DGX A100) under the time objective, nothing constrained and no roles:
    the ILP splits both expert tables on their experts over ep and sends the rows to them. The alternatives, priced
    by the same ILP with the expert tables constrained, are slower by at least 5%: the experts whole on every
    rank (data parallel or computed twice: their gradients all-reduced, or twice the experts' FLOPs) or split on
    their widths (the activations moved instead of the rows)."""
    config, cls, cfg = _MOE_CONFIGS["olmoe"]
    cfg = dict(cfg, num_experts_per_tok=2, hidden_size=256, intermediate_size=4096, num_experts=8,
               max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model, _ = _lm(config, cls, **cfg, experts_implementation="grouped_mm")(torch.Generator().manual_seed(1))
    ids = torch.randint(0, 64, (4, 128), generator=torch.Generator().manual_seed(2))
    lowered = lower(capture(model, (), {"input_ids": ids, "labels": ids}), MeshSpec((("ep", 2),)))
    free_opts = ShardOptions(cluster=ClusterSpec.load("dgx-a100"), backend="highs")
    assert free_opts.roles == "auto" and not free_opts.constrain
    free = shard(lowered, free_opts)
    tables = [v.name for v in free.program.params if v.name.endswith(("gate_up_proj", "experts.down_proj"))]
    placed = {v.name: v.type.placements for v in free.program.params if v.name in tables}
    assert len(tables) == 2 and all(p == (Shard(0),) for p in placed.values()), placed
    grouped = [op for op in free.program.ops if op.target in EXPERT_GROUPED_MM]
    assert grouped and all(free.chosen[op.result].inputs[0] == (Shard(0),) for op in grouped)
    others = {
        "whole": lambda p: p == (R,),
        "widths": lambda p: isinstance(p[0], Shard) and p[0].dim > 0,
    }
    for name, pred in others.items():
        alt = shard(lowered, ShardOptions(**{**free_opts.__dict__, "constrain": dict.fromkeys(tables, pred)}))
        assert free.step_seconds < 0.95 * alt.step_seconds, (name, free.step_seconds, alt.step_seconds)
