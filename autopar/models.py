"""Resolve a MODEL string (a preset with overrides, or a user function) into a model and example inputs.

A MODEL string is one of

    gpt2                                  a preset (see ``list_presets()``)
    gpt2:n_layer=2,n_embd=64,batch=2      a preset with overrides: config attributes plus ``batch``/``seq``
    path/to/file.py:make_model            a function returning (model, args) or (model, args, kwargs)
    package.module:make_model             the same, imported by module name

Every preset's forward computes its own training loss from the example inputs, and the first leaf of
its output is that scalar loss: Hugging Face models get ``input_ids`` and ``labels`` (int64,
[batch, seq]) and return a ``ModelOutput`` whose first field is ``loss``; the encoder-layer and MLP
presets take a float input and a ``target`` and return the MSE loss. Dropout probabilities default
to 0.0 so that parallel and single-process runs agree exactly; overrides may set them.

``build(spec, device="meta")`` allocates no weights. ``build(spec, device="cpu", seed=0)`` builds
real weights deterministically (``torch.manual_seed(seed)`` before construction) and draws the
example inputs from a generator seeded with ``seed`` (0 when not given).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import PresetError

__all__ = ["ModelSpec", "TinyMLP", "TinyMLPConfig", "EncoderLayers", "list_presets", "build"]

# Keys every preset accepts besides its config's attributes.
_SPECIAL_KEYS = ("batch", "seq")
# Extra key for Hugging Face presets: "sdpa" (one fused op) or "eager" (explicit matmul/softmax).
_ATTN_KEY = "attn_implementation"


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """What a MODEL string resolved to: call ``model(*args, **kwargs)`` to get the loss."""

    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    description: str


# ----------------------------------------------------------------------------------------------------
# Non-Hugging-Face models used by presets


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


# ----------------------------------------------------------------------------------------------------
# Families: how to make a config, a model, inputs and a parameter count for each kind of preset


@dataclass(frozen=True)
class _Family:
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

_FAMILIES: dict[str, _Family] = {
    "gpt2": _Family(
        "gpt2", _hf("transformers", "GPT2Config"), _make_hf("GPT2LMHeadModel", _GPT2), "tokens", _count_gpt2
    ),
    "llama": _Family(
        "llama",
        _hf("transformers", "LlamaConfig"),
        _make_hf("LlamaForCausalLM", _LLAMA),
        "tokens",
        _count_llama,
    ),
    "bert": _Family(
        "bert",
        _hf("transformers", "BertConfig"),
        _make_hf("BertForMaskedLM", _BERT),
        "tokens",
        _count_bert_mlm,
    ),
    "encoder": _Family("encoder", _hf("transformers", "BertConfig"), EncoderLayers, "hidden", _count_encoder),
    "mlp": _Family("mlp", lambda: TinyMLPConfig, TinyMLP, "hidden", _count_mlp, hf=False),
}

# Settings shared by every preset of a family: no KV cache, no dropout (exact parallel equivalence).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
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
# tiny vocabularies: drop GPT-2's special token ids (50256) so HF does not warn they are out of range
_TINY_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclass(frozen=True)
class _Preset:
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

_PRESET_LIST: list[_Preset] = [
    _Preset("gpt2", "gpt2", "GPT-2 small", _gpt(12, 768, 12)),
    _Preset("gpt2-medium", "gpt2", "GPT-2 medium", _gpt(24, 1024, 16)),
    _Preset("gpt2-xl", "gpt2", "GPT-2 XL", _gpt(48, 1600, 25)),
    _Preset(
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
    _Preset("llama-7b", "llama", "LLaMA-2 7B", _llama(32, 4096, 32, 32, 11008), batch=4, seq=4096),
    _Preset(
        "llama-70b",
        "llama",
        "LLaMA-2 70B (GQA, 8 kv heads)",
        _llama(80, 8192, 64, 8, 28672),
        batch=4,
        seq=4096,
    ),
    _Preset(
        "gpt3-175b",
        "gpt2",
        "GPT-3 175B (GPT-2 architecture, Megatron PTD-P)",
        _gpt(96, 12288, 96, 2048),
        batch=8,
        seq=2048,
    ),
    _Preset("mmr-bert-large", "encoder", _MMR.format("BERT-Large"), _encoder(1024, 16), batch=2, seq=512),
    _Preset("mmr-1.7b", "encoder", _MMR.format("1.7B"), _encoder(2304, 24), batch=16, seq=2048),
    _Preset("mmr-3.6b", "encoder", _MMR.format("3.6B"), _encoder(3072, 24), batch=16, seq=2048),
    _Preset("mmr-7.5b", "encoder", _MMR.format("7.5B"), _encoder(4096, 32), batch=16, seq=2048),
    _Preset("merak-gpt-1.4b", "gpt2", _MERAK.format("1.4B"), _gpt(47, 1536, 16)),
    _Preset("merak-gpt-2.5b", "gpt2", _MERAK.format("2.5B"), _gpt(54, 1920, 20)),
    _Preset("merak-gpt-8.3b", "gpt2", _MERAK.format("8.3B"), _gpt(72, 3072, 32)),
    _Preset("merak-gpt-20b", "gpt2", _MERAK.format("20B"), _gpt(98, 4096, 32)),
    _Preset(
        "tiny-gpt2",
        "gpt2",
        "tiny GPT-2 for tests",
        _gpt(2, 64, 4, 64, **_TINY_TOKENS) | {"vocab_size": 128},
        batch=4,
        seq=16,
    ),
    _Preset(
        "tiny-llama",
        "llama",
        "tiny LLaMA (GQA) for tests",
        _llama(2, 64, 4, 2, 128) | {"vocab_size": 128, "max_position_embeddings": 64} | _TINY_TOKENS,
        batch=4,
        seq=16,
    ),
    _Preset(
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
    _Preset("tiny-encoder", "encoder", "tiny single encoder layer for tests", _encoder(64, 4), batch=4, seq=16),
    _Preset(
        "tiny-mlp",
        "mlp",
        "MLP with two branches, residuals and an in-forward MSE loss (not HF)",
        batch=4,
        seq=8,
    ),
]
_PRESETS: dict[str, _Preset] = {p.name: p for p in _PRESET_LIST}


# ----------------------------------------------------------------------------------------------------
# Configs, overrides and descriptions


def _human(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _config_keys(fam: _Family, cfg: Any) -> set[str]:
    if not fam.hf:
        return {f.name for f in dataclasses.fields(cfg)}
    keys = {k for k in cfg.to_dict() if not k.startswith("_")}
    return keys | set(getattr(type(cfg), "attribute_map", {}))


def _make_config(preset: _Preset, overrides: dict[str, Any]) -> Any:
    fam = _FAMILIES[preset.family]
    cls = fam.config_cls()
    values = {**_FAMILY_DEFAULTS[preset.family], **preset.config}
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


def _parse_overrides(preset: str, text: str) -> dict[str, Any]:
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


def _describe(preset: _Preset, cfg: Any, batch: int, seq: int) -> str:
    fam = _FAMILIES[preset.family]
    n = fam.count(cfg)
    if fam.hf:
        layers, plural = cfg.num_hidden_layers, "s" if cfg.num_hidden_layers != 1 else ""
        shape = f"{layers} layer{plural}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads"
        if preset.family == "llama":
            shape += f" ({cfg.num_key_value_heads} kv), intermediate {cfg.intermediate_size}"
    else:
        shape = f"dim {cfg.dim}, hidden {cfg.hidden}"
    return f"{preset.title}: {n:,} params ({_human(n)}), {shape}; batch {batch} x seq {seq}"


def list_presets() -> dict[str, str]:
    """Every preset name with a one-line description (parameter count, layers, hidden, batch x seq)."""
    return {p.name: _describe(p, _make_config(p, {}), p.batch, p.seq) for p in _PRESET_LIST}


# ----------------------------------------------------------------------------------------------------
# Building


def _positive_int(preset: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PresetError(f"override {key}={value!r} for preset {preset!r} must be a positive integer.")
    return value


def _example_inputs(
    fam: _Family, cfg: Any, batch: int, seq: int, device: torch.device, seed: int | None, dtype: torch.dtype
) -> tuple[tuple, dict]:
    if fam.inputs == "tokens":
        shape, v = (batch, seq), cfg.vocab_size
        if device.type == "meta":
            ids = torch.empty(shape, dtype=torch.int64, device=device)
            return (), {"input_ids": ids, "labels": torch.empty_like(ids)}
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        ids = torch.randint(0, v, shape, generator=g)
        labels = torch.randint(0, v, shape, generator=g)
        return (), {"input_ids": ids.to(device), "labels": labels.to(device)}
    width = cfg.dim if not fam.hf else cfg.hidden_size
    shape3 = (batch, seq, width)
    if device.type == "meta":
        x = torch.empty(shape3, dtype=dtype, device=device)
        return (x,), {"target": torch.empty_like(x)}
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    x, t = torch.randn(shape3, generator=g), torch.randn(shape3, generator=g)
    return (x.to(device, dtype),), {"target": t.to(device, dtype)}


def _build_preset(
    spec: str, preset: _Preset, overrides: dict[str, Any], device: torch.device, seed: int | None
) -> ModelSpec:
    fam = _FAMILIES[preset.family]
    batch = _positive_int(preset.name, "batch", overrides.pop("batch", preset.batch))
    seq = _positive_int(preset.name, "seq", overrides.pop("seq", preset.seq))
    cfg = _make_config(preset, overrides)
    limit = getattr(cfg, "max_position_embeddings", None) if fam.hf else None
    if fam.inputs == "tokens" and limit is not None and seq > limit:
        raise PresetError(
            f"seq={seq} exceeds the {limit} positions of preset {preset.name!r}; "
            f"also override {'n_positions' if preset.family == 'gpt2' else 'max_position_embeddings'}."
        )
    dtype = _config_dtype(preset.name, cfg) if fam.hf else torch.float32
    if device.type != "meta" and seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = fam.make(cfg)
    except (TypeError, ValueError, AssertionError) as e:
        raise PresetError(
            f"building preset {preset.name!r} with overrides {overrides} failed: "
            f"{str(e).rstrip('.')}. Change the overrides."
        ) from e
    if dtype != torch.float32:
        model = model.to(dtype)
    model.train()
    args, kwargs = _example_inputs(fam, cfg, batch, seq, device, seed, dtype)
    return ModelSpec(spec, model, args, kwargs, _describe(preset, cfg, batch, seq))


def _config_dtype(preset: str, cfg: Any) -> torch.dtype:
    """The parameter dtype named by a ``dtype=`` override (HF configs carry one); fp32 when unset."""
    value = getattr(cfg, "dtype", None)
    if value is None:
        return torch.float32
    dtype = value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise PresetError(
            f"dtype={value!r} for preset {preset!r} is not a floating dtype; use float32, bfloat16 or float16."
        )
    return dtype


def _load_callable(spec: str, target: str, fn_name: str) -> Callable[..., Any]:
    if target.endswith(".py") or "/" in target or os.sep in target:
        if not os.path.isfile(target):
            raise PresetError(
                f"model file {target!r} (from MODEL {spec!r}) does not exist; "
                "give a path to a .py file as path/to/file.py:fn."
            )
        mod_name = f"_autopar_user_model_{abs(hash(os.path.abspath(target)))}"
        try:
            mspec = importlib.util.spec_from_file_location(mod_name, target)
            assert mspec is not None and mspec.loader is not None
            module = importlib.util.module_from_spec(mspec)
            sys.modules[mod_name] = module
            mspec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise PresetError(
                f"importing model file {target!r} failed: {type(e).__name__}: {e}. "
                "Fix the file so that it imports on its own."
            ) from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            close = difflib.get_close_matches(target, list(_PRESETS), n=3)
            hint = f" Did you mean preset {', '.join(close)}?" if close else ""
            raise PresetError(
                f"MODEL {spec!r}: {target!r} is neither a preset nor an importable module "
                f"({e}).{hint} See autopar.models.list_presets()."
            ) from e
        except Exception as e:
            raise PresetError(f"importing module {target!r} failed: {type(e).__name__}: {e}.") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        close = difflib.get_close_matches(fn_name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PresetError(f"{target!r} has no function {fn_name!r}{hint}")
    return fn


def _build_user(spec: str, target: str, fn_name: str, device: torch.device, seed: int | None) -> ModelSpec:
    fn = _load_callable(spec, target, fn_name)
    try:
        takes_device = "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_device = False
    if device.type != "meta" and seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            result = fn(device=device) if takes_device else fn()
    except Exception as e:
        raise PresetError(f"calling {target}:{fn_name} failed: {type(e).__name__}: {e}") from e
    usage = "must return (model, args) or (model, args, kwargs) with an nn.Module, a tuple and a dict"
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise PresetError(f"{target}:{fn_name} returned {type(result).__name__}; it {usage}.")
    model, args, kwargs = (*result, {}) if len(result) == 2 else result
    if not isinstance(model, nn.Module):
        raise PresetError(f"{target}:{fn_name} returned a {type(model).__name__} as the model; it {usage}.")
    if isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise PresetError(
            f"{target}:{fn_name} returned args of type {type(args).__name__} and kwargs of type "
            f"{type(kwargs).__name__}; it {usage}."
        )
    n = sum(p.numel() for p in model.parameters())
    desc = f"user model {type(model).__name__} from {target}:{fn_name}: {n:,} params ({_human(n)})"
    return ModelSpec(spec, model, args, kwargs, desc)


def build(spec: str, device: str | torch.device = "meta", seed: int | None = None) -> ModelSpec:
    """Resolve a MODEL string into a model and example inputs; see the module docstring for the forms."""
    spec = spec.strip()
    dev = torch.device(device)
    name, _, rest = spec.partition(":")
    if name in _PRESETS:
        return _build_preset(spec, _PRESETS[name], _parse_overrides(name, rest), dev, seed)
    target, colon, fn_name = spec.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    is_module = all(part.isidentifier() for part in target.split(".")) and fn_name.isidentifier()
    if colon and (is_file or is_module):
        return _build_user(spec, target, fn_name, dev, seed)
    close = difflib.get_close_matches(name, list(_PRESETS), n=4, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise PresetError(
        f"unknown model preset {name!r}.{hint} autopar.models.list_presets() lists all presets; "
        "a custom model is given as path/to/file.py:fn or package.module:fn returning "
        "(model, args) or (model, args, kwargs)."
    )
