"""The named model presets, and their configs: overrides parsed and checked, one-line descriptions.

A preset is a family (``autopar/models/families.py``), config values, and an example batch and sequence
length. ``gpt2:n_layer=2,batch=2`` overrides config attributes, ``batch``/``seq`` and, for Hugging Face
families, ``attn_implementation``; errors name the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import PresetError
from autopar.models.families import FAMILIES, FAMILY_DEFAULTS, Family

__all__ = ["PRESETS", "Preset", "describe", "human_count", "list_presets", "make_config", "parse_overrides"]

# Keys every preset accepts besides its config's attributes.
_SPECIAL_KEYS = ("batch", "seq")
# Extra key for Hugging Face presets: "sdpa" (one fused op) or "eager" (explicit matmul/softmax).
_ATTN_KEY = "attn_implementation"

# tiny vocabularies: drop GPT-2's special token ids (50256) so HF does not warn they are out of range
_TINY_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass(frozen=True)
class Preset:
    """A named model: family, config values, example batch and sequence, and a title for descriptions."""

    name: str
    family: str
    title: str
    config: dict[str, Any] = field(default_factory=dict)
    batch: int = 8
    seq: int = 1024


def _gpt(n_layer: int, n_embd: int, n_head: int, n_positions: int = 1024, **kw: Any) -> dict[str, Any]:
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=50257, **kw)


def _llama(layers: int, hidden: int, heads: int, kv: int, inter: int) -> dict[str, Any]:
    return dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )


def _encoder(hidden: int, heads: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden)


_MMR = "ILP paper Table 1 {} as ONE encoder layer (no embeddings/head, eager attention, as in its Sec. 4.2)"
_MERAK = "Merak GPT-{} (hidden from Sec. 6; Megatron-style heads, layers fitted to the size)"

PRESET_LIST: list[Preset] = [
    Preset("gpt2", "gpt2", "GPT-2 small", _gpt(12, 768, 12)),
    Preset("gpt2-medium", "gpt2", "GPT-2 medium", _gpt(24, 1024, 16)),
    Preset("gpt2-xl", "gpt2", "GPT-2 XL", _gpt(48, 1600, 25)),
    Preset(
        "bert-large",
        "bert",
        "BERT-Large MLM",
        dict(
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            intermediate_size=4096,
            vocab_size=30522,
        ),
        batch=8,
        seq=512,
    ),
    Preset("llama-7b", "llama", "LLaMA-2 7B", _llama(32, 4096, 32, 32, 11008), batch=4, seq=4096),
    Preset(
        "llama-70b",
        "llama",
        "LLaMA-2 70B (GQA, 8 kv heads)",
        _llama(80, 8192, 64, 8, 28672),
        batch=4,
        seq=4096,
    ),
    # Llama 3.1 405B as Meta's config.json gives it (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783,
    # Table 3: 126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128K);
    # its example sequence is the 8K of the main pre-training stage (the long-context stage: seq=131072)
    Preset(
        "llama3-405b",
        "llama",
        "Llama 3.1 405B (GQA, 8 kv heads)",
        _llama(126, 16384, 128, 8, 53248)
        | {"vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0},
        batch=1,
        seq=8192,
    ),
    Preset(
        "gpt3-175b",
        "gpt2",
        "GPT-3 175B (GPT-2 architecture, Megatron PTD-P)",
        _gpt(96, 12288, 96, 2048),
        batch=8,
        seq=2048,
    ),
    # Mixtures of experts, from the config.json each model's authors published on the Hugging Face Hub
    Preset(
        "mixtral-8x22b",
        "mixtral",
        "Mixtral 8x22B (8 experts, top-2; GQA, 8 kv heads)",
        # huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json
        dict(
            num_hidden_layers=56,
            hidden_size=6144,
            intermediate_size=16384,
            num_attention_heads=48,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=65536,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
        batch=4,
        seq=4096,
    ),
    Preset(
        "qwen3-235b-a22b",
        "qwen3_moe",
        "Qwen3-235B-A22B (128 experts, top-8; GQA, 4 kv heads)",
        # huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
        dict(
            num_hidden_layers=94,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
        batch=4,
        seq=4096,
    ),
    Preset(
        "deepseek-v3",
        "deepseek_v3",
        "DeepSeek-V3 671B (MLA; 256 routed experts, top-8 in 4 of 8 groups, 1 shared; 3 dense layers)",
        # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (its multi-token-prediction layer is not
        # part of transformers' model); the 671B of the DeepSeek-V3 technical report, arXiv:2412.19437, Sec. 4.2
        dict(
            num_hidden_layers=61,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            first_k_dense_replace=3,
            norm_topk_prob=True,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=129280,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        batch=4,
        seq=4096,
    ),
    Preset("mmr-bert-large", "encoder", _MMR.format("BERT-Large"), _encoder(1024, 16), batch=2, seq=512),
    Preset("mmr-1.7b", "encoder", _MMR.format("1.7B"), _encoder(2304, 24), batch=16, seq=2048),
    Preset("mmr-3.6b", "encoder", _MMR.format("3.6B"), _encoder(3072, 24), batch=16, seq=2048),
    Preset("mmr-7.5b", "encoder", _MMR.format("7.5B"), _encoder(4096, 32), batch=16, seq=2048),
    Preset("merak-gpt-1.4b", "gpt2", _MERAK.format("1.4B"), _gpt(47, 1536, 16)),
    Preset("merak-gpt-2.5b", "gpt2", _MERAK.format("2.5B"), _gpt(54, 1920, 20)),
    Preset("merak-gpt-8.3b", "gpt2", _MERAK.format("8.3B"), _gpt(72, 3072, 32)),
    Preset("merak-gpt-20b", "gpt2", _MERAK.format("20B"), _gpt(98, 4096, 32)),
    Preset(
        "tiny-gpt2",
        "gpt2",
        "tiny GPT-2 for tests",
        _gpt(2, 64, 4, 64, **_TINY_TOKENS) | {"vocab_size": 128},
        batch=4,
        seq=16,
    ),
    Preset(
        "tiny-llama",
        "llama",
        "tiny LLaMA (GQA) for tests",
        _llama(2, 64, 4, 2, 128) | {"vocab_size": 128, "max_position_embeddings": 64} | _TINY_TOKENS,
        batch=4,
        seq=16,
    ),
    Preset(
        "tiny-bert",
        "bert",
        "tiny BERT MLM for tests",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
            max_position_embeddings=64,
        ),
        batch=4,
        seq=16,
    ),
    Preset("tiny-encoder", "encoder", "tiny single encoder layer for tests", _encoder(64, 4), batch=4, seq=16),
    Preset(
        "tiny-mlp",
        "mlp",
        "MLP with two branches, residuals and an in-forward MSE loss (not HF)",
        batch=4,
        seq=8,
    ),
]
PRESETS: dict[str, Preset] = {p.name: p for p in PRESET_LIST}


# ----------------------------------------------------------------------------------------------------
# Configs, overrides and descriptions


def human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _config_keys(fam: Family, cfg: Any) -> set[str]:
    if not fam.hf:
        return {f.name for f in dataclasses.fields(cfg)}
    keys = {k for k in cfg.to_dict() if not k.startswith("_")}
    return keys | set(getattr(type(cfg), "attribute_map", {}))


def _is_size(key: str) -> bool:
    """Whether a config key is a count or a size (layers, heads, widths, vocabulary), which must be >= 1."""
    return key.startswith(("n_", "num_")) or key.endswith(("_size", "_dim", "_layers", "_heads", "_embd")) or key in (
        "hidden_size", "intermediate_size", "vocab_size", "n_positions", "max_position_embeddings",
    )  # fmt: skip


def make_config(preset: Preset, overrides: dict[str, Any]) -> Any:
    fam = FAMILIES[preset.family]
    cls = fam.config_cls()
    values = {**FAMILY_DEFAULTS[preset.family], **preset.config}
    default = cls(**values)
    keys = _config_keys(fam, default)
    aliases = getattr(cls, "attribute_map", {})
    for key, value in overrides.items():
        if key == _ATTN_KEY and fam.hf:
            if value not in ("sdpa", "eager"):
                raise PresetError(f"{key}={value!r} for preset {preset.name!r}: use sdpa or eager.")
            values[key] = value
            continue
        if key not in keys:
            allowed = sorted(keys | set(_SPECIAL_KEYS) | ({_ATTN_KEY} if fam.hf else set()))
            close = difflib.get_close_matches(key, allowed, n=4)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise PresetError(
                f"unknown override key {key!r} for preset {preset.name!r} "
                f"(config class {cls.__name__}){hint} "
                f"Keys are {cls.__name__} attribute names plus 'batch' and 'seq'."
            )
        canonical = aliases.get(key, key)
        values[canonical] = _coerce(preset.name, key, value, getattr(default, key, None))
        current = getattr(default, key, None)
        if _is_size(key) and isinstance(current, int) and not isinstance(current, bool) and values[canonical] < 1:
            raise PresetError(
                f"override {key}={value!r} for preset {preset.name!r} must be a positive integer (a count or size: "
                f"{key}={values[canonical]} would build an empty or invalid model)."
            )
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise PresetError(
            f"preset {preset.name!r} with overrides {overrides} gives an invalid "
            f"{cls.__name__}: {e}. Change the overrides."
        ) from e


def _coerce(preset: str, key: str, value: Any, default: Any) -> Any:
    """Check an override against the type of the value it replaces (ints may stand for floats)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok, value = True, str(value)
    else:
        ok = True
    if not ok:
        raise PresetError(
            f"override {key}={value!r} for preset {preset!r} must be a "
            f"{type(default).__name__} like its default {default!r}."
        )
    return value


def _parse_value(preset: str, key: str, text: str) -> Any:
    if text == "":
        raise PresetError(f"override {key!r} of preset {preset!r} has no value; write {key}=VALUE.")
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if not all(ch.isalnum() or ch in "._-+/" for ch in text):
        raise PresetError(
            f"cannot parse value {text!r} of override {key!r} for preset {preset!r}; "
            "values are ints, floats, true/false, none or plain words (letters, digits, ._-+/)."
        )
    return text


def parse_overrides(preset: str, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise PresetError(
                f"cannot parse override {item!r} for preset {preset!r}; write KEY=VALUE, e.g. {preset}:batch=2,seq=16."
            )
        out[key] = _parse_value(preset, key, val.strip())
    return out


def describe(preset: Preset, cfg: Any, batch: int, seq: int) -> str:
    fam = FAMILIES[preset.family]
    n = fam.count(cfg)
    if fam.hf:
        layers, plural = cfg.num_hidden_layers, "s" if cfg.num_hidden_layers != 1 else ""
        shape = f"{layers} layer{plural}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads"
        if preset.family == "llama":
            shape += f" ({cfg.num_key_value_heads} kv), intermediate {cfg.intermediate_size}"
        experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
        experts = experts or getattr(cfg, "n_routed_experts", None)
        if experts:
            shape += f", {experts} experts (top-{cfg.num_experts_per_tok})"
    else:
        shape = f"dim {cfg.dim}, hidden {cfg.hidden}"
    return f"{preset.title}: {n:,} params ({human_count(n)}), {shape}; batch {batch} x seq {seq}"


def list_presets() -> dict[str, str]:
    """Every preset name with a one-line description (parameter count, layers, hidden, batch x seq)."""
    return {p.name: describe(p, make_config(p, {}), p.batch, p.seq) for p in PRESET_LIST}
