"""Hugging Face families built small from their configs, each with a batch: the breadth autopar is checked on.

``FAMILIES[name](generator)`` gives ``(model, inputs)``: the model wrapped in ``LogitsCE`` (a float64-able
cross-entropy of its logits; Hugging Face's own loss casts to float32) and the keyword inputs of one global
batch of ``B`` rows. Decoders with learned, rotary and ALiBi positions, grouped-query attention, a
mixture of experts; encoders; an encoder-decoder; a vision transformer and two convolutional networks.
``moe(family, kernel)`` builds the mixtures of experts with each of transformers' experts kernels.
Dropout is off in every config (``tests/test_dropout.py`` covers autopar's keyed dropout). Several compute
parts in float32 whatever the model's dtype (RMS norms, rotary tables): compare them in float64 with
``autopar/check/float64.py``. Used by
``tests/test_families_sim.py`` and ``bench/families_table.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

B, S, V = 4, 8, 64  # batch, sequence, vocabulary
IMAGE, CLASSES = 16, 10


class LogitsCE(torch.nn.Module):
    """Cross-entropy of ``model(**inputs).logits`` against ``labels`` in the logits' dtype: per token for a
    language model ([B, S, V] logits), per image for a classifier ([B, C])."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, labels: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        logits = self.model(**inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _hf(config: str, model: str, **cfg) -> torch.nn.Module:
    transformers = importlib.import_module("transformers")  # deferred: an optional dependency
    config_ = getattr(transformers, config)(**cfg)
    config_._attn_implementation = "eager"
    return getattr(transformers, model)(config_)


def _tokens(g: torch.Generator, *names: str) -> dict[str, torch.Tensor]:
    return {n: torch.randint(3, V, (B, S), generator=g) for n in names}


def _lm(config: str, model: str, **cfg) -> Callable[[torch.Generator], tuple[torch.nn.Module, dict]]:
    return lambda g: (LogitsCE(_hf(config, model, **cfg)), _tokens(g, "input_ids", "labels"))


def _seq2seq(config: str, model: str, **cfg) -> Callable[[torch.Generator], tuple[torch.nn.Module, dict]]:
    return lambda g: (LogitsCE(_hf(config, model, **cfg)), _tokens(g, "input_ids", "decoder_input_ids", "labels"))


def _vision(config: str, model: str, **cfg) -> Callable[[torch.Generator], tuple[torch.nn.Module, dict]]:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict]:
        pixels = torch.randn(B, 3, IMAGE, IMAGE, generator=g)
        return LogitsCE(_hf(config, model, num_labels=CLASSES, **cfg)), {
            "pixel_values": pixels,
            "labels": torch.randint(0, CLASSES, (B,), generator=g),
        }

    return make


_DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)  # transformers' default experts kernel (grouped_mm)
_NO_SPECIAL = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


class MoeLogitsCE(LogitsCE):
    """``LogitsCE`` plus the router's auxiliary load-balancing loss, weighted as the model's config says (Hugging
    Face adds it to its own loss only with labels, which would cast the logits to float32)."""

    def forward(self, labels: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(**inputs)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss + self.model.config.router_aux_loss_coef * out.aux_loss


# Mixtures of experts, each buildable with any of transformers' experts kernels: ``grouped_mm`` (the default,
# through torch._grouped_mm or transformers' grouped_mm_fallback op), ``batched_mm`` and ``eager`` (a loop over
# the experts hit, which autopar captures through the grouped kernel: its shapes depend on the routing).
KERNELS = ("grouped_mm", "batched_mm", "eager")
_MOE_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(**_DEC, num_key_value_heads=2, num_local_experts=4,
                                                             max_position_embeddings=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**_DEC, num_key_value_heads=2, num_experts=4,
                                                                 moe_intermediate_size=32, max_position_embeddings=32,
                                                                 norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(**_DEC, num_key_value_heads=4, num_experts=4,
                                                       max_position_embeddings=32, **_NO_SPECIAL)),
    # MLA attention, a shared expert, grouped top-k routing (top-2 of the experts of the best group)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(**_DEC, num_key_value_heads=4, n_routed_experts=4,
                                                                       n_shared_experts=1, moe_intermediate_size=32,
                                                                       n_group=2, topk_group=1, first_k_dense_replace=0,
                                                                       q_lora_rank=16, kv_lora_rank=16,
                                                                       qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                                       v_head_dim=8, max_position_embeddings=32,
                                                                       **_NO_SPECIAL)),
}  # fmt: skip


def moe(
    family: str, kernel: str | None = None, aux_loss: float = 0.0
) -> Callable[[torch.Generator], tuple[torch.nn.Module, dict]]:
    """The MoE ``family`` (``_MOE_CONFIGS``) with top-2 routing over 4 experts, its experts computed by
    ``kernel`` (None: transformers' default); ``aux_loss``: the router's load-balancing loss weighted by it
    (``output_router_logits``) is part of the loss."""
    config, model, cfg = _MOE_CONFIGS[family]
    cfg = dict(cfg, num_experts_per_tok=2, router_aux_loss_coef=aux_loss, output_router_logits=bool(aux_loss))
    if kernel is not None:
        cfg["experts_implementation"] = kernel
    wrap = MoeLogitsCE if aux_loss else LogitsCE
    return lambda g: (wrap(_hf(config, model, **cfg)), _tokens(g, "input_ids", "labels"))


FAMILIES: dict[str, Callable[[torch.Generator], tuple[torch.nn.Module, dict]]] = {
    # decoders: learned positions (GPT-2's fused Conv1D QKV; OPT's tied head), rotary, ALiBi, GQA, MoE
    "gpt2": _lm("GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_NO_SPECIAL),
    "opt": _lm("OPTConfig", "OPTForCausalLM", vocab_size=V, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64,
               num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32, dropout=0.0,
               attention_dropout=0.0, pad_token_id=1),
    "llama": _lm("LlamaConfig", "LlamaForCausalLM", **_DEC, num_key_value_heads=4, max_position_embeddings=32),
    "bloom": _lm("BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=32, n_layer=1, n_head=4,
                 hidden_dropout=0.0, attention_dropout=0.0),
    "falcon": _lm("FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, hidden_dropout=0.0,
                  attention_dropout=0.0),
    "mistral": _lm("MistralConfig", "MistralForCausalLM", **_DEC, num_key_value_heads=2,
                   max_position_embeddings=32, sliding_window=None),
    "mixtral": _lm("MixtralConfig", "MixtralForCausalLM", **_DEC, num_key_value_heads=2, num_local_experts=4,
                   max_position_embeddings=32, **_MOE),
    # encoders
    "bert": _lm("BertConfig", "BertForMaskedLM", **_DEC, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0),
    "distilbert": _lm("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=V, dim=32, hidden_dim=64,
                      n_layers=1, n_heads=4, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0),
    # encoder-decoder (relative position buckets, RMS norm computed in float32 by HF)
    "t5": _seq2seq("T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=32, d_kv=8, d_ff=64,
                   num_layers=1, num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, use_cache=False),
    # vision: a transformer and two convolutional networks (batch norm; depthwise conv + layer norm)
    "vit": _vision("ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=4, hidden_size=32,
                   num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0),
    "resnet": _vision("ResNetConfig", "ResNetForImageClassification", embedding_size=16, hidden_sizes=[16, 32],
                      depths=[1, 1], layer_type="basic"),
    "convnext": _vision("ConvNextConfig", "ConvNextForImageClassification", patch_size=2, num_stages=2,
                        hidden_sizes=[16, 32], depths=[1, 1], drop_path_rate=0.0),
}  # fmt: skip


__all__ = ["B", "CLASSES", "FAMILIES", "IMAGE", "KERNELS", "S", "V", "LogitsCE", "MoeLogitsCE", "moe"]
