"""Planning from two layers of each kind (passes/repeat_layers.py): the program, fingerprint and plan of the
full capture, and a full capture wherever the layers differ or are read past their run."""

from __future__ import annotations

import pytest
import torch

from autopar.ir.core import MeshSpec
from autopar.ir.printer import print_program
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.repeat_layers import layer_kinds, main_stack, reduction
from autopar.passes.shard import ShardOptions
from autopar.plan import fingerprint
from autopar.planner import capture_for_planning, plan_captured
from autopar.runtime.build.precision import for_capture

_DEC = "hidden_size=32,intermediate_size=64,num_attention_heads=4,vocab_size=64,batch=2,seq=8"
# 3 dense layers, then 3 mixture-of-experts ones: a run of each kind, each cut to two and repeated once
DEEPSEEK = (
    f"deepseek-v3:num_hidden_layers=6,first_k_dense_replace=3,{_DEC},moe_intermediate_size=16,num_key_value_heads=4,"
    "n_routed_experts=4,num_experts_per_tok=2,n_group=2,topk_group=1,q_lora_rank=8,kv_lora_rank=8,qk_nope_head_dim=4,"
    "qk_rope_head_dim=4,v_head_dim=4"
)
GPT2 = "gpt2:n_layer=3,n_embd=32,n_head=4,vocab_size=64,n_positions=16,batch=2,seq=8"
MIXTRAL = f"mixtral-8x22b:num_hidden_layers=3,{_DEC},num_key_value_heads=2,num_local_experts=4,num_experts_per_tok=2"


def _both(spec: str, precision: str = "fp32"):
    m = build(spec, device="meta")
    reduced = capture_for_planning(m.model, m.args, m.kwargs, precision)
    return reduced, capture(*for_capture(m.model, m.args, m.kwargs, precision))


def _plan_parts(report) -> tuple:
    """What a plan decides and predicts: every op's placements (the program) and the predicted costs."""
    s = report.plan.stats
    keys = ("memory_per_device_bytes", "step_seconds", "comm_bytes", "comm_seconds", "redundant_bytes", "ilp_groups")
    return report.plan.program, report.plan.fingerprint, tuple(s[k] for k in keys)


@pytest.mark.parametrize(
    ("spec", "kept", "mesh"),
    [
        (GPT2, (0, 1), (("dp", 2), ("tp", 2))),
        # two captures and two plans of 6 layers, about 20 s under load
        pytest.param(DEEPSEEK, (0, 1, 3, 4), (("dp", 2), ("ep", 2)), marks=pytest.mark.heavy),
    ],
)
def test_plan_from_two_layers_of_each_kind_is_the_full_capture_plan(spec, kept, mesh) -> None:
    """The strategy of every op and the predicted memory, step and communication from the reduced capture are
    those from the whole model's (GPT-2: one kind; DeepSeek-V3: its dense and its mixture-of-experts layers)."""
    reduced, full = _both(spec)
    assert reduced.repeat is not None and reduced.repeat.kept == kept
    opts = ShardOptions(roles="name", backend="highs")  # TrainConfig's default roles, the time objective
    mesh = MeshSpec(mesh)
    assert _plan_parts(plan_captured(reduced, mesh, opts, baselines=())) == _plan_parts(
        plan_captured(full, mesh, opts, baselines=())
    )


@pytest.mark.parametrize(
    ("spec", "precision"),
    # DeepSeek-V3: 10 layers captured, about 10 s under load
    [(MIXTRAL, "fp32"), pytest.param(DEEPSEEK, "bf16", marks=pytest.mark.heavy)],
)
def test_lowered_program_is_the_full_capture_op_for_op(spec, precision) -> None:
    """Each run's second layer repeated: the program text (names, types, paths, parameters in torch.export's
    order) and the fingerprint a plan is checked by are the full capture's."""
    reduced, full = _both(spec, precision)
    assert reduced.repeat is not None
    mine, theirs = lower(reduced), lower(full)
    assert print_program(mine) == print_program(theirs)
    assert fingerprint(reduced, mine) == fingerprint(full, theirs)


def _hf(config: str, model: str, **cfg):
    import transformers

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    base.update(max_position_embeddings=32, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        m = getattr(transformers, model)(getattr(transformers, config)(**{**base, **cfg}))
    ids = torch.empty((2, 8), dtype=torch.int64, device="meta")
    return m.train(), {"input_ids": ids, "labels": ids}


SLIDING = dict(sliding_window=4, use_sliding_window=True)


def test_sliding_and_global_layers_are_kinds_of_their_own() -> None:
    """Qwen2's per-layer ``layer_types``: alternating sliding and global layers leave no run to cut (the model is
    captured whole); three of each are two runs, captured with the config list cut as the stack is."""
    kinds = ["sliding_attention", "full_attention"]
    for types, kept in ((kinds * 2, None), ([kinds[0]] * 3 + [kinds[1]], (0, 1, 3))):
        model, kwargs = _hf("Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=4, layer_types=types, **SLIDING)
        found = layer_kinds(model, main_stack(model)[1])
        assert [k for _, k in found.lists] == ["layer_types"]
        assert (reduction(found.kinds) or (None,))[0] == kept
    reduced = capture_for_planning(model, (), kwargs)
    assert model.config.layer_types == types and len(model.model.layers) == 4  # put back
    assert print_program(lower(reduced)) == print_program(lower(capture(model, (), kwargs)))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(output_router_logits=True, router_aux_loss_coef=0.01),  # a loss over every layer's router logits
        dict(output_hidden_states=True),  # every layer's output returned
    ],
)
def test_layers_read_past_their_run_are_captured_whole(cfg) -> None:
    """A value of a layer that the reduced capture would stand for read outside its run: no reduced capture."""
    model, kwargs = _hf("MixtralConfig", "MixtralForCausalLM", num_hidden_layers=3, num_local_experts=4, **cfg)
    assert reduction(layer_kinds(model, main_stack(model)[1]).kinds) is not None  # the layers are alike
    assert capture_for_planning(model, (), kwargs).repeat is None


def test_a_layer_computing_with_its_index_is_its_own_kind() -> None:
    """GPT-2's ``scale_attn_by_inverse_layer_idx``: each layer's attention scaled by 1 / (index + 1), an attribute
    of its own (``scaling``), so no two layers are alike."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=16, scale_attn_by_inverse_layer_idx=True
    )
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg).train()
    assert reduction(layer_kinds(model, main_stack(model)[1]).kinds) is None


class _Block(torch.nn.Module):
    def __init__(self, index: int, scaled: bool):
        super().__init__()
        self.index, self.scaled = index, scaled
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * (self.index + 1 if self.scaled else 1)


class _Stack(torch.nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(i, scaled) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.sum()


@pytest.mark.parametrize("scaled", [False, True])
def test_a_forward_reading_its_index_is_seen_in_the_captured_layers(scaled) -> None:
    """A layer's index (``index``, equal to its place in every layer) is no part of its kind; a forward computing
    with it makes the two captured layers' programs differ (a constant 1 against 2), and the model is captured
    whole. Either way the program is the full capture's."""
    model, x = _Stack(scaled), torch.randn(2, 8)
    reduced = capture_for_planning(model, (x,), {})
    assert (reduced.repeat is None) == scaled
    assert [b.index for b in model.blocks] == list(range(5))  # put back
    assert print_program(lower(reduced)) == print_program(lower(capture(model, (x,), {})))


class _Counted(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.blocks) != 5:
            raise ValueError(f"built with 5 blocks, holds {len(self.blocks)}")
        return super().forward(x)


def test_a_forward_refusing_the_shorter_stack_is_captured_whole() -> None:
    model, x = _Counted(False), torch.randn(2, 8)
    reduced = capture_for_planning(model, (x,), {})
    assert reduced.repeat is None and len(model.blocks) == 5
    assert print_program(lower(reduced)) == print_program(lower(capture(model, (x,), {})))
