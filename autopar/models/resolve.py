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

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import PresetError
from autopar.models.families import FAMILIES, Family
from autopar.models.presets import PRESETS, Preset, describe, human_count, list_presets, make_config, parse_overrides

__all__ = ["ModelSpec", "build", "list_presets"]


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """What a MODEL string resolved to: call ``model(*args, **kwargs)`` to get the loss."""

    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    description: str


def _positive_int(preset: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PresetError(f"override {key}={value!r} for preset {preset!r} must be a positive integer.")
    return value


def _example_inputs(
    fam: Family, cfg: Any, batch: int, seq: int, device: torch.device, seed: int | None, dtype: torch.dtype
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


# (hidden size, attention heads) as each config family names them
_HEAD_FIELDS = (("n_embd", "n_head"), ("hidden_size", "num_attention_heads"), ("d_model", "num_heads"))


def _check_heads(preset: str, cfg: Any, overrides: dict[str, Any]) -> None:
    """A hidden size the attention heads do not divide (``gpt2:n_embd=64`` keeps GPT-2's 12 heads) is refused
    with the override that fixes it: the largest head count up to the preset's that divides it."""
    for hidden_name, heads_name in _HEAD_FIELDS:
        hidden, heads = getattr(cfg, hidden_name, None), getattr(cfg, heads_name, None)
        if not (isinstance(hidden, int) and isinstance(heads, int)) or heads < 1 or hidden % heads == 0:
            continue
        fit = max(h for h in range(1, heads + 1) if hidden % h == 0)
        given = ",".join(f"{k}={v}" for k, v in overrides.items())
        raise PresetError(
            f"{preset}:{given}: {hidden_name}={hidden} is not a multiple of the {heads} attention heads "
            f"({heads_name}); also override {heads_name}, e.g. {preset}:{given},{heads_name}={fit}"
        )


def _build_preset(
    spec: str, preset: Preset, overrides: dict[str, Any], device: torch.device, seed: int | None
) -> ModelSpec:
    fam = FAMILIES[preset.family]
    batch = _positive_int(preset.name, "batch", overrides.pop("batch", preset.batch))
    seq = _positive_int(preset.name, "seq", overrides.pop("seq", preset.seq))
    cfg = make_config(preset, overrides)
    limit = getattr(cfg, "max_position_embeddings", None) if fam.hf else None
    if fam.inputs == "tokens" and limit is not None and seq > limit:
        raise PresetError(
            f"seq={seq} exceeds the {limit} positions of preset {preset.name!r}; "
            f"also override {'n_positions' if preset.family == 'gpt2' else 'max_position_embeddings'}."
        )
    _check_heads(preset.name, cfg, overrides)
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
    return ModelSpec(spec, model, args, kwargs, describe(preset, cfg, batch, seq))


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
            close = difflib.get_close_matches(target, list(PRESETS), n=3)
            hint = f" Did you mean preset {', '.join(close)}?" if close else ""
            raise PresetError(
                f"MODEL {spec!r}: {target!r} is neither a preset nor an importable module "
                f"({e}).{hint} See autopar.models.resolve.list_presets()."
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
    desc = f"user model {type(model).__name__} from {target}:{fn_name}: {n:,} params ({human_count(n)})"
    return ModelSpec(spec, model, args, kwargs, desc)


def build(spec: str, device: str | torch.device = "meta", seed: int | None = None) -> ModelSpec:
    """Resolve a MODEL string into a model and example inputs; see the module docstring for the forms."""
    spec = spec.strip()
    dev = torch.device(device)
    name, _, rest = spec.partition(":")
    if name in PRESETS:
        return _build_preset(spec, PRESETS[name], parse_overrides(name, rest), dev, seed)
    target, colon, fn_name = spec.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    is_module = all(part.isidentifier() for part in target.split(".")) and fn_name.isidentifier()
    if colon and (is_file or is_module):
        return _build_user(spec, target, fn_name, dev, seed)
    close = difflib.get_close_matches(name, list(PRESETS), n=4, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise PresetError(
        f"unknown model preset {name!r}.{hint} autopar.models.resolve.list_presets() lists all presets; "
        "a custom model is given as path/to/file.py:fn or package.module:fn returning "
        "(model, args) or (model, args, kwargs)."
    )
