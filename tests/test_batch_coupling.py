"""Losses and statistics that couple the batch, found on the IR (``passes/batch_coupling.py``) and refused over
several microbatches (``BatchCouplingError``), where a pipeline would silently train another model (issue 36).

Before the analysis, CLIP on pp=2 x tp=2 trained with half its in-batch negatives (step-1 loss 1.161 against
2.454), and Qwen3-MoE's load-balancing loss was averaged over microbatches instead of taken over the batch.
Every family of ``autopar/models/small_families.py`` is analyzed too: only the batch-norm ResNet couples.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.cli import main as cli_main
from autopar.config import TrainConfig
from autopar.errors import BatchCouplingError, ConfigError, SimulationError
from autopar.ir.core import MeshSpec
from autopar.models.small_families import FAMILIES, moe
from autopar.passes.batch_coupling import UNPROVEN, analyze, batch_couplings
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions
from autopar.planner import PipelinePlanOptions, plan_captured
from autopar.search.profile import profile_program
from autopar.search.space import SearchSpace, chains, families
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train

PP = MeshSpec((("pp", 2),))
PP_TP = MeshSpec((("pp", 2), ("tp", 2)))
TP = MeshSpec((("tp", 2),))


def _clip(g: torch.Generator) -> tuple[torch.nn.Module, dict]:
    import transformers

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=4)  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    config._attn_implementation = "eager"
    model = transformers.CLIPModel(config)
    ids, pixels = torch.randint(3, 64, (4, 8), generator=g), torch.randn(4, 3, 16, 16, generator=g)
    return model, {"input_ids": ids, "pixel_values": pixels, "return_loss": True}


def _qwen3_moe(g: torch.Generator, **cfg) -> tuple[torch.nn.Module, dict]:
    """Qwen3-MoE with its load-balancing loss (``output_router_logits``, a nonzero coefficient), on transformers'
    default experts kernel (``grouped_mm``: it sorts the batch's tokens by expert and puts them back)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False, **{"output_router_logits": True, "router_aux_loss_coef": 0.1, **cfg},
    )  # fmt: skip
    config._attn_implementation = "eager"
    ids = torch.randint(3, 64, (4, 8), generator=g)
    return transformers.Qwen3MoeForCausalLM(config), {"input_ids": ids, "labels": ids}


class _BatchNormRegression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
            torch.nn.Tanh(), torch.nn.Linear(16, 4),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(x), t)


def _lowered(model: torch.nn.Module, kwargs: dict):
    return lower(capture(model, (), kwargs), TP)


def test_only_the_batch_norm_family_couples_its_batch() -> None:
    """No false positive: of every small family (causal LMs, MoE, encoders, T5, ViT, ConvNeXt) only ResNet,
    whose batch norm trains on the batch's statistics, couples; the others microbatch exactly, and none is
    unproven: Mixtral on transformers' default ``grouped_mm`` kernel sorts its tokens by expert over the whole
    flattened batch and puts them back, which the analysis reads as per sample (before, it was unproven)."""
    coupled, unproven = {}, {}
    for name, make in FAMILIES.items():
        model, kwargs = make(torch.Generator().manual_seed(0))
        for c in batch_couplings(_lowered(model, kwargs)):
            (unproven if c.kind == UNPROVEN else coupled).setdefault(name, []).append(c.describe())
    assert set(coupled) == {"resnet"}, coupled
    assert all("aten.batch_norm" in c for c in coupled["resnet"]), coupled
    assert not unproven, unproven


class _SortedExperts(torch.nn.Module):
    """The grouped-GEMM experts pattern of transformers' ``grouped_mm`` kernel, written out: sort the (token,
    slot) expert ids, gather the tokens by ``perm // k``, grouped matmul by ``cumsum(histc(ids))`` offsets, put
    the rows back. ``broken`` spoils one step (what a variant that is not per sample would do)."""

    def __init__(self, broken: str = "") -> None:
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

        self.router, self.broken = torch.nn.Linear(8, 4), broken
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, 8)
        weights, ids = torch.topk(self.router(h).softmax(-1), 2)
        sorted_ids, perm = torch.sort(ids.reshape(-1))
        rows = h[perm // 2]
        low, high = (0, 0) if self.broken == "histc range" else (0, 3)
        offsets = torch.cumsum(torch.histc(sorted_ids.float(), bins=4, min=low, max=high), 0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.w, offs=offsets) * weights.reshape(-1)[perm, None]
        if self.broken == "no restore":
            back = out  # the sorted order kept: row i is no longer token i // 2's
        else:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.size(0))
            back = out[inverse]
        y = back.view(-1, 2, 8).sum(1).reshape(x.shape)
        return torch.nn.functional.mse_loss(y, t)


def test_the_grouped_mm_sort_is_read_as_per_sample() -> None:
    """The sort of ``grouped_mm`` followed through: the written-out kernel microbatches exactly (no coupling,
    the loss a mean); kept in its sorted order, or grouped by a histogram over the data's own range, it does not
    (unproven: the analysis says so instead of calling it per sample)."""
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    good = analyze(_lowered(_SortedExperts(), {"x": x, "t": t}))
    assert good.couplings == () and good.loss_state == "mean", good.couplings
    for broken in ("no restore", "histc range"):
        found = batch_couplings(_lowered(_SortedExperts(broken), {"x": x, "t": t}))
        assert [c.kind for c in found] == [UNPROVEN], (broken, found)


def test_the_analysis_names_each_kind_of_coupling() -> None:
    """CLIP's contrastive logits mix the samples (a matmul no sharding of the batch rows computes apart);
    the MoE load-balancing loss multiplies two means over the batch's tokens; its cross-entropy, added to
    it, divides by the batch's count of targets. The same MoE without the auxiliary loss couples nothing."""
    clip = batch_couplings(_lowered(*_clip(torch.Generator().manual_seed(0))))
    assert [(c.target, c.kind) for c in clip] == [("aten.matmul", "mixes samples")], clip
    moe = batch_couplings(_lowered(*_qwen3_moe(torch.Generator().manual_seed(0))))
    assert all(c.certain for c in moe), moe  # past its first grouped_mm layer too: the sort is read
    kinds = {(c.target, c.kind) for c in moe}
    assert ("aten.mul.Tensor", "nonlinear in batch statistics") in kinds, moe
    assert ("aten.div.Tensor", "batch divisor") in kinds, moe
    plain = _lowered(*_qwen3_moe(torch.Generator().manual_seed(0), output_router_logits=False))
    assert batch_couplings(plain) == () and analyze(plain).loss_state == "mean"


@pytest.mark.parametrize("microbatches", [2, 4])
def test_clip_on_pp_tp_is_refused_by_name(microbatches: int) -> None:
    """CLIP on pp=2 x tp=2 with 2 or 4 microbatches: refused on every rank, naming the contrastive matmul,
    why, and what to do (the ranks' modules raise it as they are built)."""
    model, kwargs = _clip(torch.Generator().manual_seed(0))
    want = r"BatchCouplingError: the step runs as \d microbatches.*aten.matmul.*mixes samples.*microbatches=1"
    with pytest.raises(SimulationError, match=want):
        SimCompiled.of(model, PP_TP, (), kwargs, microbatches=microbatches)


def test_moe_aux_loss_on_pp_1f1b_is_refused_by_name() -> None:
    """Qwen3-MoE with its load-balancing loss on pp=2 with 4 microbatches under 1F1B: refused, naming the
    product of the token fractions and the router means, and saying that GPipe runs it exactly (1F1B's last
    stage starts a backward before the step's last forward, which the batch tail needs)."""
    model, kwargs = _qwen3_moe(torch.Generator().manual_seed(0))
    kwargs = {k: v.repeat(2, 1) for k, v in kwargs.items()}  # 8 rows: 4 microbatches of 2
    want = r"BatchCouplingError: .*aten.mul.Tensor.*nonlinear in batch statistics.*exact.*gpipe.*not on 1f1b"
    with pytest.raises(SimulationError, match=want):
        SimCompiled.of(model, PP, (), kwargs, microbatches=4)


def test_moe_aux_loss_on_pp_gpipe_is_exact() -> None:
    """Qwen3-MoE (transformers' default grouped_mm kernel) with its load-balancing loss weighted by
    ``router_aux_loss_coef=0.1`` (``MoeLogitsCE``: Hugging Face's own loss would cast to float32) on pp=2 with
    4 microbatches under GPipe trains as one process (float64, 3 SGD steps, losses and every parameter to
    1e-10): the batch tail (runtime/execute/batch_tail.py) takes the token fractions and the cross-entropy's
    count of targets over the whole step. Before it, the plan was refused."""
    torch.manual_seed(0)
    model, _ = moe("qwen3_moe", aux_loss=0.1)(torch.Generator().manual_seed(0))
    model = float64_model(model)
    ids = torch.randint(3, 64, (8, 8), generator=torch.Generator().manual_seed(1))  # 4 microbatches of 2
    batch = {"input_ids": ids, "labels": ids}
    assert {c.kind for c in batch_couplings(_lowered(copy.deepcopy(model), batch))} == {
        "nonlinear in batch statistics", "batch divisor"
    }  # fmt: skip
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(copy.deepcopy(model), PP, (), batch, microbatches=4, schedule="gpipe", float64=True)
    assert sim.modules[0].program.attrs["pipeline_stages"] == 2  # the plan really pipelines
    make_optimizer("sgd", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(3)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [batch] * 3)
    assert (losses == losses[:, :1]).all(), losses
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where)


def test_batch_norm_on_pp_is_refused_and_one_microbatch_is_exact() -> None:
    """Batch norm in training on pp=2: two microbatches would normalize by each half's statistics (refused);
    one microbatch per step trains as one process (float64, losses and every state, running statistics too).
    In evaluation it normalizes by its running statistics, per sample: nothing couples."""
    torch.manual_seed(0)
    model = _BatchNormRegression().double()
    batch = {"x": torch.randn(8, 8, dtype=torch.float64), "t": torch.randn(8, 4, dtype=torch.float64)}
    with pytest.raises(SimulationError, match=r"BatchCouplingError: .*aten.batch_norm.*batch norm in training"):
        SimCompiled.of(copy.deepcopy(model), PP, (), batch, microbatches=2)
    sim = SimCompiled.of(copy.deepcopy(model), PP, (), batch, microbatches=1)
    assert sim.modules[0].program.attrs["pipeline_stages"] == 2  # the plan really pipelines
    make_optimizer("sgd", sim)
    losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
    reference = copy.deepcopy(model)
    assert loss_error(losses, train(reference, [batch, batch])) < TOL
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where)
    assert batch_couplings(_lowered(copy.deepcopy(model).eval(), batch)) == ()  # evaluation: running statistics


def clip_model() -> tuple[torch.nn.Module, tuple, dict]:
    """The CLIP above as ``autopar check``'s ``MODEL`` (``tests.test_batch_coupling:clip_model``)."""
    model, kwargs = _clip(torch.Generator().manual_seed(0))
    return model, (), kwargs


def test_autopar_check_names_clips_coupled_op(capsys: pytest.CaptureFixture) -> None:
    """``autopar check MODEL --mesh pp=2,tp=2`` checks one microbatch (exact) and warns that CLIP's matmul
    couples the batch, which more microbatches would change."""
    assert cli_main(["check", "tests.test_batch_coupling:clip_model", "--mesh", "pp=2,tp=2"]) == 0
    out = capsys.readouterr().out
    assert "agrees on mesh" in out and "couples its batch" in out and "aten.matmul" in out, out


def test_microbatch_semantics_option() -> None:
    """The option that accepts per-microbatch semantics reaches the runtime; another value is refused."""
    assert TrainConfig(microbatch_semantics="per_microbatch").runtime_options().microbatch_semantics == "per_microbatch"
    assert TrainConfig().runtime_options().microbatch_semantics == "exact"
    with pytest.raises(ConfigError):
        TrainConfig(microbatch_semantics="approximate")


def test_deepseek_v3_trains_exactly_on_pp_tp() -> None:
    """Tiny DeepSeek-V3 on pp=2 x tp=2, two microbatches: it failed in its first backward ("derivative for
    aten::copy is not implemented": its attention writes the query and key heads into ``new_empty`` tensors,
    functionalized to ``aten.copy``), one rank stopping while the others waited for gradients. Two SGD steps
    now equal one process (float64). Its routing has no auxiliary loss: nothing couples the batch."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32, use_cache=False,
        experts_implementation="batched_mm",
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = float64_model(transformers.DeepseekV3ForCausalLM(config))
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(model, PP_TP, (), batch, microbatches=2, float64=True)
    assert sim.modules[0].program.attrs["pipeline_stages"] == 2
    make_optimizer("sgd", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():  # its RMS norms and rotary tables compute in float32 in the model: float64 here, as the plan
        ref = train(reference, [batch, batch])
    assert (losses == losses[:, :1]).all(), losses
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where)


def test_autopar_plan_refuses_clips_microbatches_and_plans_one() -> None:
    """``autopar plan`` (``plan_captured``) on pp=2 x tp=2: 2 microbatches refused by name, as compile would
    refuse the plan; one microbatch, or the per-microbatch semantics accepted in the config, is planned."""
    model, kwargs = _clip(torch.Generator().manual_seed(0))
    half = {k: v[:2] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}  # one microbatch's inputs
    captured = capture(model, (), half)
    two = PipelinePlanOptions(microbatches=2)
    with pytest.raises(BatchCouplingError, match=r"runs as 2 microbatches.*aten.matmul"):
        plan_captured(captured, PP_TP, ShardOptions(), pipeline=two)
    accepted = {"microbatch_semantics": "per_microbatch"}
    report = plan_captured(captured, PP_TP, ShardOptions(), pipeline=two, config=accepted)
    assert report.plan.pipeline["microbatches"] == 2


def test_the_search_offers_a_coupled_model_one_microbatch_per_step() -> None:
    """The search's profile keeps the coupled ops; its families (mesh, micro-batch) of such a model all run the
    step as one microbatch, while a plain causal LM keeps its several-microbatch families."""
    clip, kwargs = _clip(torch.Generator().manual_seed(0))
    coupled = profile_program(lower(capture(clip, (), kwargs), MeshSpec()), batch=4)
    assert any("aten.matmul" in c for c in coupled.coupled)
    gpt2, kwargs = FAMILIES["gpt2"](torch.Generator().manual_seed(0))
    plain = profile_program(lower(capture(gpt2, (), kwargs), MeshSpec()), batch=4)
    assert plain.coupled == ()
    assert {f.microbatches for f in families(SimpleNamespace(p=coupled, B=8), SearchSpace(), 4)} == {1}
    assert max(f.microbatches for f in families(SimpleNamespace(p=plain, B=8), SearchSpace(), 4)) > 1


def test_plan_and_search_offer_the_moe_aux_loss_gpipe_microbatches() -> None:
    """The MoE load-balancing loss is exact as a batch tail under GPipe: ``autopar plan`` on pp=2 plans 4
    microbatches under gpipe and refuses them under 1F1B (naming gpipe); the search's profile says a tail makes
    it exact, its families keep several microbatches, and each pipelined chain of those is GPipe without
    recomputation (while CLIP's families stay at one microbatch, above)."""
    model, _ = moe("qwen3_moe", aux_loss=0.1)(torch.Generator().manual_seed(0))
    ids = torch.randint(3, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (), {"input_ids": ids[:2], "labels": ids[:2]})  # one microbatch's inputs
    gpipe = PipelinePlanOptions(microbatches=4, schedule="gpipe")
    assert plan_captured(captured, PP, ShardOptions(), pipeline=gpipe).plan.pipeline["microbatches"] == 4
    with pytest.raises(BatchCouplingError, match=r"aten.mul.Tensor.*exact.*gpipe.*not on 1f1b"):
        plan_captured(captured, PP, ShardOptions(), pipeline=PipelinePlanOptions(microbatches=4))
    two_layers, kwargs = _qwen3_moe(torch.Generator().manual_seed(0))  # the search puts whole layers on stages
    kwargs = {k: v.repeat(2, 1) for k, v in kwargs.items()}
    profile = profile_program(lower(capture(two_layers, (), kwargs), MeshSpec()), batch=8)
    assert profile.coupled and profile.tail and profile.num_layers == 2
    analytic = SimpleNamespace(
        p=profile, B=8, n=len(profile.units), zero0_dominated=True, even_layout=lambda s: 0, balanced_layout=lambda s: 1
    )
    fams = [f for f in families(analytic, SearchSpace(), 4) if f.pp > 1 and f.microbatches > 1]
    assert fams
    for fam in fams:
        got = {(c.base.schedule, c.levels) for c in chains(analytic, SearchSpace(), fam)}
        assert got == {("gpipe", (("none", 0),))}, got
