"""The kinds of model the presets build: config class, constructor, inputs and parameter count of each.

Hugging Face families (GPT-2, LLaMA, BERT; the mixtures of experts Mixtral, Qwen3-MoE, DeepSeek-V3) are
imported lazily; ``TinyMLP`` and ``EncoderLayers`` are
defined here. Every family's defaults turn dropout and the KV cache off, so parallel and single-process
runs agree exactly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EncoderLayers", "FAMILIES", "FAMILY_DEFAULTS", "Family", "TinyMLP", "TinyMLPConfig"]


@dataclass(frozen=True)
class TinyMLPConfig:
    """Sizes of ``TinyMLP``; small enough for multi-process CPU tests."""

    dim: int = 16  # input/output features per token
    hidden: int = 32  # width of the two parallel branches
    dropout: float = 0.0  # 0.0 so parallel runs match a single process exactly


class TinyMLP(nn.Module):
    """An MLP with two parallel branches, two residuals and an MSE loss against ``target``."""

    def __init__(self, config: TinyMLPConfig):
        super().__init__()
        self.config = config
        self.fc_in = nn.Linear(config.dim, config.hidden)
        self.branch_a = nn.Linear(config.hidden, config.hidden)
        self.branch_b = nn.Linear(config.hidden, config.hidden)
        self.norm = nn.LayerNorm(config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.fc_out = nn.Linear(config.hidden, config.dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc_in(x))
        gate = torch.sigmoid(self.branch_a(h))  # branch 1
        value = torch.tanh(self.branch_b(h))  # branch 2, joined with branch 1 by a product
        h = self.norm(h + self.dropout(gate * value))  # residual around the branches
        y = self.fc_out(h) + x  # residual around the whole block
        return F.mse_loss(y, target)


class EncoderLayers(nn.Module):
    """Hugging Face BERT encoder layers alone (no embeddings, no head) with an MSE loss against ``target``.

    This is what the minimal-memory-redundancy ILP paper measured: "a single-layer Transformer
    model, specifically an encoder layer" (Sec. 4.2); module paths read ``encoder.layer.0....``.
    """

    def __init__(self, config: Any):
        super().__init__()
        # deferred: transformers is optional (the hf extra)
        from transformers.models.bert.modeling_bert import BertEncoder

        self.config = config
        self.encoder = BertEncoder(config)

    def forward(self, hidden_states: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.encoder(hidden_states).last_hidden_state
        return F.mse_loss(out, target)


@dataclass(frozen=True)
class Family:
    """One kind of model: its config class, constructor, input kind and parameter formula."""

    name: str
    config_cls: Callable[[], type]  # returns the class lazily (transformers imports slowly)
    make: Callable[[Any], nn.Module]
    inputs: str  # "tokens": input_ids + labels; "hidden": float x + target
    count: Callable[[Any], int]  # parameter count from the config, without building
    hf: bool = True


def _hf(module: str, cls: str) -> Callable[[], type]:
    def load() -> type:
        return getattr(importlib.import_module(module), cls)

    return load


def _vocab_tied(c: Any) -> bool:
    return bool(getattr(c, "tie_word_embeddings", True))


def _count_gpt2(c: Any) -> int:
    h, inner, v = c.n_embd, c.n_inner or 4 * c.n_embd, c.vocab_size
    layer = 4 * h * h + 4 * h + 2 * h * inner + inner + h + 4 * h  # attn, mlp, two layer norms
    return v * h + c.n_positions * h + c.n_layer * layer + 2 * h + (0 if _vocab_tied(c) else v * h)


def _count_llama(c: Any) -> int:
    h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
    hd = c.head_dim or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv + h) if c.attention_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if c.mlp_bias else 0)
    layer = attn + mlp + 2 * h  # two RMS norms
    return v * h + c.num_hidden_layers * layer + h + (0 if _vocab_tied(c) else v * h)


def _bert_layer(c: Any) -> int:
    h, i = c.hidden_size, c.intermediate_size
    return 4 * h * h + 4 * h + 2 * h + h * i + i + i * h + h + 2 * h


def _count_bert_mlm(c: Any) -> int:
    h, v = c.hidden_size, c.vocab_size
    embeddings = (v + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
    head = h * h + h + 2 * h + v  # transform dense + layer norm + decoder bias (decoder weight tied)
    return embeddings + c.num_hidden_layers * _bert_layer(c) + head + (0 if _vocab_tied(c) else v * h)


def _count_encoder(c: Any) -> int:
    return c.num_hidden_layers * _bert_layer(c)


def _gqa_attention(c: Any, qk_norm: bool = False) -> int:
    """q, k, v, o projections of grouped-query attention without biases (Mixtral's and Qwen3-MoE's), and Qwen3's
    RMS norms of each query and key head."""
    h = c.hidden_size
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return 2 * h * q + 2 * h * kv + (2 * hd if qk_norm else 0)


def _moe_total(c: Any, layers: int) -> int:
    """Embeddings, ``layers`` (the decoder layers' parameters), the final RMS norm and the head."""
    h, v = c.hidden_size, c.vocab_size
    return v * h + layers + h + (0 if _vocab_tied(c) else v * h)


def _count_mixtral(c: Any) -> int:
    h, e = c.hidden_size, c.num_local_experts
    layer = _gqa_attention(c) + e * h + 3 * e * h * c.intermediate_size + 2 * h  # router, experts, two norms
    return _moe_total(c, c.num_hidden_layers * layer)


def _count_qwen3_moe(c: Any) -> int:
    h, e = c.hidden_size, c.num_experts
    total = 0
    for i in range(c.num_hidden_layers):
        sparse = i not in c.mlp_only_layers and e > 0 and (i + 1) % c.decoder_sparse_step == 0
        mlp = e * h + 3 * e * h * c.moe_intermediate_size if sparse else 3 * h * c.intermediate_size
        total += _gqa_attention(c, qk_norm=True) + mlp + 2 * h
    return _moe_total(c, total)


def _count_deepseek_v3(c: Any) -> int:
    """Multi-head latent attention (low-rank queries and keys/values with their RMS norms), dense MLPs in the first
    ``first_k_dense_replace`` layers, then routed and shared experts and the router (its score-correction bias is
    a buffer). The multi-token-prediction module is not part of Hugging Face's model."""
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * heads * qk if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    attn = q + kv + heads * c.v_head_dim * h
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    moe = e * h + 3 * e * h * inter + 3 * h * inter * c.n_shared_experts
    dense = 3 * h * c.intermediate_size
    k = c.first_k_dense_replace
    return _moe_total(c, c.num_hidden_layers * (attn + 2 * h) + k * dense + (c.num_hidden_layers - k) * moe)


def _count_mlp(c: TinyMLPConfig) -> int:
    d, h = c.dim, c.hidden
    return d * h + h + 2 * (h * h + h) + 2 * h + h * d + d


def _make_hf(cls_name: str, module: str) -> Callable[[Any], nn.Module]:
    def make(config: Any) -> nn.Module:
        return _hf(module, cls_name)()(config)

    return make


_GPT2 = "transformers.models.gpt2.modeling_gpt2"
_LLAMA = "transformers.models.llama.modeling_llama"
_BERT = "transformers.models.bert.modeling_bert"

FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "gpt2", _hf("transformers", "GPT2Config"), _make_hf("GPT2LMHeadModel", _GPT2), "tokens", _count_gpt2
    ),
    "llama": Family(
        "llama",
        _hf("transformers", "LlamaConfig"),
        _make_hf("LlamaForCausalLM", _LLAMA),
        "tokens",
        _count_llama,
    ),
    "bert": Family(
        "bert",
        _hf("transformers", "BertConfig"),
        _make_hf("BertForMaskedLM", _BERT),
        "tokens",
        _count_bert_mlm,
    ),
    "mixtral": Family(
        "mixtral",
        _hf("transformers", "MixtralConfig"),
        _make_hf("MixtralForCausalLM", "transformers.models.mixtral.modeling_mixtral"),
        "tokens",
        _count_mixtral,
    ),
    "qwen3_moe": Family(
        "qwen3_moe",
        _hf("transformers", "Qwen3MoeConfig"),
        _make_hf("Qwen3MoeForCausalLM", "transformers.models.qwen3_moe.modeling_qwen3_moe"),
        "tokens",
        _count_qwen3_moe,
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        _hf("transformers", "DeepseekV3Config"),
        _make_hf("DeepseekV3ForCausalLM", "transformers.models.deepseek_v3.modeling_deepseek_v3"),
        "tokens",
        _count_deepseek_v3,
    ),
    "encoder": Family("encoder", _hf("transformers", "BertConfig"), EncoderLayers, "hidden", _count_encoder),
    "mlp": Family("mlp", lambda: TinyMLPConfig, TinyMLP, "hidden", _count_mlp, hf=False),
}

# Settings shared by every preset of a family: no KV cache, no dropout (exact parallel equivalence).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        # GPT-2's gelu_new as one aten.gelu(approximate="tanh") op instead of six elementwise ops
        activation_function="gelu_pytorch_tanh",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        loss_type="ForCausalLM",
        attn_implementation="sdpa",
    ),
    "llama": dict(use_cache=False, attention_dropout=0.0, loss_type="ForCausalLM", attn_implementation="sdpa"),
    "bert": dict(
        use_cache=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"
    ),
    # mixtures of experts: transformers' default experts kernel (grouped_mm), no router-logit outputs
    "mixtral": dict(use_cache=False, attention_dropout=0.0, loss_type="ForCausalLM", attn_implementation="sdpa"),
    "qwen3_moe": dict(use_cache=False, attention_dropout=0.0, loss_type="ForCausalLM", attn_implementation="sdpa"),
    "deepseek_v3": dict(use_cache=False, attention_dropout=0.0, loss_type="ForCausalLM", attn_implementation="sdpa"),
    # the ILP paper's PyTorch 1.11 had no fused attention: eager keeps the [b, heads, s, s] scores
    "encoder": dict(
        use_cache=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_hidden_layers=1,
        attn_implementation="eager",
    ),
    "mlp": {},
}
