"""Initialize a model built on the meta device one tensor at a time, the same for every mesh.

A model built under ``torch.device("meta")`` has shapes but no values. ``init_value(model, name,
seed)`` produces the whole value of one parameter or buffer on the CPU:

1. the tensor is materialized alone on the CPU, filled with a sentinel (NaN, or the dtype's minimum
   for integers), and swapped into its owning module in place of the meta tensor;
2. the CPU generator is seeded with a seed derived from ``(seed, canonical name)`` (sha256), so the
   value does not depend on which other tensors this rank initializes, nor in what order;
3. the module's own initializers run as when the model is built: the owner's ``reset_parameters()``
   (PyTorch's default init), then, for a Hugging Face model, ``_init_weights`` of every module from the
   owner up to the root, innermost first (HF's ``initialize_weights`` order; GPT-2's scaled
   ``c_proj`` init is done by the attention module, an ancestor of the parameter's owner). Every
   other tensor is still on the meta device, where initializers do nothing, so each call touches
   only this tensor;
4. the meta tensor is put back; the caller keeps (or slices) the value and frees it.

A tensor no initializer wrote (still holding the sentinel) raises ``PipelineError``: better than
training from uninitialized memory. Tied tensors (GPT-2's ``wte`` and ``lm_head``) are initialized
once, under their first name in ``named_parameters()`` order (the *canonical* name).

``materialize(model, seed)`` initializes a whole meta model this way on the CPU: the single-process
reference of a pipeline run that initialized only its shards holds exactly the same numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from autopar.errors import PipelineError


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter and buffer name -> the first name of the same tensor (tied ones share one)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in _named_tensors(model):
        first.setdefault(id(t), name)
        out[name] = first[id(t)]
    return out


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: 63 bits of sha256("seed:name")."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _chain(model: torch.nn.Module, name: str) -> tuple[list[torch.nn.Module], str]:
    *path, attr = name.split(".")
    mods = [model]
    for p in path:
        mods.append(getattr(mods[-1], p))
    return mods, attr


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full(t.shape, float("nan"), dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.zeros(t.shape, dtype=t.dtype)
    return torch.full(t.shape, torch.iinfo(t.dtype).min, dtype=t.dtype)


def _untouched(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def _hf_root(mods: list[torch.nn.Module], i: int):
    """The nearest Hugging Face PreTrainedModel among mods[0..i] (the one whose _init_weights applies)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of the presets only
        return None
    for m in reversed(mods[: i + 1]):
        if isinstance(m, PreTrainedModel):
            return m
    return None


@torch.no_grad()
def init_value(model: torch.nn.Module, name: str, seed: int = 0) -> torch.Tensor:
    """The initial value of parameter or buffer ``name`` of a meta-device model, on the CPU."""
    canon = canonical_names(model).get(name)
    if canon is None:
        raise PipelineError(f"{type(model).__name__} has no parameter or buffer {name!r}")
    mods, attr = _chain(model, canon)
    owner = mods[-1]
    is_param = attr in owner._parameters
    meta = owner._parameters[attr] if is_param else owner._buffers[attr]
    if meta.device.type != "meta":
        return meta.detach().cpu().clone()
    value = _sentinel(meta)
    swapped = torch.nn.Parameter(value, requires_grad=meta.requires_grad) if is_param else value
    store = owner._parameters if is_param else owner._buffers
    store[attr] = swapped
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tensor_seed(seed, canon))
            reset = getattr(owner, "reset_parameters", None)
            if callable(reset):
                reset()
            for i in reversed(range(len(mods))):
                root = _hf_root(mods, i)
                if root is not None:
                    root._init_weights(mods[i])
    finally:
        store[attr] = meta
    if _untouched(value):
        raise PipelineError(
            f"no initializer wrote {canon} ({type(owner).__name__}.{attr}) of the meta-device model: give "
            f"{type(owner).__name__} a reset_parameters() that sets it, or build the model on the CPU"
        )
    return value


@torch.no_grad()
def materialize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every meta tensor of ``model`` its ``init_value`` on the CPU (in place; returns ``model``)."""
    canon = canonical_names(model)
    values: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(canon.values()):
        values[name] = init_value(model, name, seed)
    made: dict[str, torch.Tensor] = {}
    for name, c in canon.items():
        mods, attr = _chain(model, name)
        owner = mods[-1]
        if attr in owner._parameters:
            if c not in made:
                old = owner._parameters[attr]
                made[c] = torch.nn.Parameter(values[c], requires_grad=old.requires_grad)
            owner._parameters[attr] = made[c]
        else:
            owner._buffers[attr] = made.setdefault(c, values[c])
    return model


__all__ = ["canonical_names", "init_value", "materialize", "tensor_seed"]
