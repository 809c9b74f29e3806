"""compile(check=True) at any size: the user's planned program carried onto a scaled-down copy of the model.

The copy is the model rebuilt from its config with every width divided by one power of two (hidden,
intermediate, per-head and embedding sizes; layer, head, expert and position counts kept) and the
inputs cut to a few rows and positions (each dim kept a multiple of the ranks that split it; token ids
folded into the smaller vocabulary). Its captured and lowered program must have the planned program's
ops, op for op (same targets, same value names); the planned program (collectives, stages and
transfers included) then gets the copy's shapes and literal arguments (view sizes) in place of its own,
its placements untouched, and every shape is re-derived on the meta device (``verify(shapes=True)``).
What is checked is the user's plan, op for op and placement for placement, at a size the rank simulator
runs in seconds. Why a rebuilt config and not a rescaled graph: docs/architecture.md.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections import defaultdict, deque
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.errors import CheckError
from autopar.ir.core import COLLECTIVES, Op, Program, Ref, Shard, TensorType, Value
from autopar.ir.verify import verify
from autopar.passes.capture import Captured, capture, flatten_inputs
from autopar.passes.lower import lower

SMALL = 8  # the most rows and positions the copy's inputs keep per dim (more when the ranks splitting it need)
SMALL_VOCAB = 256
_WIDTH = re.compile(r"(hidden|embd|d_model|intermediate|inner|ffn|d_ff|d_kv|head_dim|embed_dim|(^|_)dim$)")
_NOT_WIDTH = re.compile(r"(layer|num_|n_head|heads|expert|position|bucket|vocab|window|max_|token|label|stage)")
_MODEL_WIDTH = re.compile(r"(hidden_size|n_embd|d_model|embed_dim|^dim)$")
_HEADS = re.compile(r"(num_attention_heads|num_heads|n_head|num_key_value_heads|num_kv_heads|n_heads)$")


def _fields(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise CheckError(f"check=True cannot read the model's config ({type(config).__name__}): {_HOW}")
    return {k: getattr(config, k, v) for k, v in to_dict().items()}


_HOW = (
    "check a small configuration of the model with `autopar check file.py:fn --mesh ...` instead, and compile "
    "with check=False"
)


def scaled_config(config: Any) -> tuple[Any, int]:
    """A copy of ``config`` with every width field divided by the largest power of two that divides every
    width and every per-head width and leaves at least 2 per head; the factor."""
    fields = {k: v for k, v in _fields(config).items() if isinstance(v, int) and not isinstance(v, bool)}
    widths = {k: v for k, v in fields.items() if _WIDTH.search(k) and not _NOT_WIDTH.search(k) and v > 1}
    heads = [v for k, v in fields.items() if _HEADS.search(k) and v > 0]
    model_widths = [w for k, w in widths.items() if _MODEL_WIDTH.search(k)]  # split into heads by attention
    per_head = [w // h for w in model_widths for h in heads if w % h == 0 and w // h > 1]
    unit = math.gcd(*widths.values(), *per_head) if widths else 1
    f = 1
    while unit % (2 * f) == 0 and min([*widths.values(), *per_head]) // (2 * f) >= 2:
        f *= 2
    if f == 1:
        raise CheckError(
            f"check=True found no width in the model's config ({type(config).__name__}: {sorted(fields)}) to "
            f"scale down; {_HOW}"
        )
    small = {k: v // f for k, v in widths.items()}
    if fields.get("vocab_size", 0) > SMALL_VOCAB:
        small["vocab_size"] = SMALL_VOCAB
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **small), f
    out = copy.deepcopy(config)
    for k, v in small.items():
        setattr(out, k, v)
    return out, f


def scaled_model(model: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    """The model rebuilt on ``device`` from its scaled-down config (``scaled_config``), with fresh weights."""
    config = getattr(model, "config", None)
    if config is None:
        raise CheckError(f"check=True on a large model rebuilds it small from its config, and this "
                         f"{type(model).__name__} has no `config`; {_HOW}")  # fmt: skip
    small, _ = scaled_config(config)
    with torch.device(device):
        from_config = getattr(type(model), "_from_config", None)  # Hugging Face's constructor from a config
        try:
            return from_config(small) if from_config is not None else type(model)(small)
        except Exception as e:
            raise CheckError(
                f"check=True could not rebuild {type(model).__name__} from its scaled-down config "
                f"({type(e).__name__}: {e}); {_HOW}"
            ) from e


def scaled_inputs(prog: Program, captured: Captured, args: tuple, kwargs: dict, vocab: int | None) -> tuple:
    """``(args, kwargs)`` with every tensor cut to ``SMALL`` per dim (a multiple of the ranks that split the
    dim in ``prog``) and integer values at or above ``vocab`` folded into it."""
    values = [v for v in prog.inputs if v.kind == "input"]
    mesh = prog.mesh
    leaves = iter(values)
    flat = flatten_inputs(captured.in_spec, args, kwargs)
    g = torch.Generator().manual_seed(0)

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        v = next(leaves)
        for d, n in enumerate(x.shape):
            k = math.prod(s for p, s in zip(v.type.placements, mesh.sizes) if isinstance(p, Shard) and p.dim == d)
            keep = min(n, -(-max(SMALL, k) // k) * k)
            x = x.narrow(d, 0, keep)
        if x.device.type == "meta":  # example inputs without data: random ones of their shape
            x = _random_like(x, g, vocab)
        if vocab is not None and not x.is_floating_point() and x.dtype != torch.bool:
            x = torch.where(x >= vocab, x % vocab, x)
        return x.clone()

    small = [cut(x) for x in flat]
    return pytree.tree_unflatten(small, pytree.tree_structure((tuple(args), dict(kwargs))))


def _random_like(x: torch.Tensor, g: torch.Generator, vocab: int | None) -> torch.Tensor:
    if x.is_floating_point():
        return torch.randn(x.shape, generator=g, dtype=x.dtype)
    if x.dtype == torch.bool:
        return torch.ones(x.shape, dtype=torch.bool)
    return torch.randint(0, vocab or 2, x.shape, generator=g, dtype=x.dtype)


def transplant(planned: Program, small: Program) -> Program:
    """``planned`` (any stage of the flow after sharding) with ``small``'s shapes and literal arguments: the
    same ops and placements on the scaled-down copy's sizes. ``small`` is the copy's lowered program."""
    ops = {op.result: op for op in small.ops}
    inputs = {v.name: v for v in small.inputs}
    types: dict[str, TensorType] = {}

    def retype(t: TensorType, shape: tuple[int, ...]) -> TensorType:
        return TensorType(t.dtype, shape, t.placements)

    new_inputs = []
    for v in planned.inputs:
        if v.name not in inputs:
            raise CheckError(f"the scaled-down copy has no input %{v.name}: {_MISMATCH}")
        new_inputs.append(Value(v.name, v.kind, retype(v.type, inputs[v.name].type.shape), v.attrs))
        types[v.name] = new_inputs[-1].type
    sent: dict[tuple[int, int], deque] = defaultdict(deque)
    new_ops = []
    for op in planned.ops:
        if op.target in COLLECTIVES:
            if op.target == "recv":
                shape = sent[(int(op.kwargs["peer_stage"]), int(op.attrs["stage"]))].popleft()
            else:
                shape = types[op.args[0].name].shape
                if op.target == "send":
                    sent[(int(op.attrs["stage"]), int(op.kwargs["peer_stage"]))].append(shape)
            new = op.with_(types=(retype(op.type, shape),))
        else:
            twin = ops.get(op.result)
            if twin is None or twin.target != op.target or twin.results != op.results:
                found = f"%{op.result} = {twin.target}" if twin is not None else "nothing"
                raise CheckError(
                    f"the planned %{op.result} = {op.target} is {found} in the scaled-down copy: {_MISMATCH}"
                )
            new = op.with_(
                types=tuple(retype(t, s.shape) for t, s in zip(op.types, twin.types)),
                args=_literals(op.args, twin.args, op),
                kwargs=_literals(op.kwargs, twin.kwargs, op),
            )
        new_ops.append(new)
        types.update(zip(new.results, new.types))
    out = planned.with_(inputs=tuple(new_inputs), ops=tuple(new_ops))
    verify(out, shapes=True)
    return out


_MISMATCH = (
    "its graph is not the model's at a smaller size (shape-dependent code?); check a small configuration with "
    "`autopar check file.py:fn --mesh ...` instead"
)


def _literals(planned: Any, small: Any, op: Op) -> Any:
    """``planned``'s references (they may name collectives' results) with ``small``'s literals elsewhere."""
    if isinstance(planned, Ref):
        return planned
    if isinstance(planned, (list, tuple)) and isinstance(small, (list, tuple)) and len(planned) == len(small):
        return type(planned)(_literals(p, s, op) for p, s in zip(planned, small))
    if isinstance(planned, dict) and isinstance(small, dict) and planned.keys() == small.keys():
        return {k: _literals(planned[k], small[k], op) for k in planned}
    if type(planned) is not type(small) and not (_number(planned) and _number(small)):
        raise CheckError(f"the arguments of %{op.result} = {op.target} differ in the scaled-down copy: {_MISMATCH}")
    return small


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scaled_copy(planned: list[Program], model: torch.nn.Module, captured: Captured, args: tuple, kwargs: dict):
    """(the scaled-down model on the CPU, its inputs, each of the ``planned`` programs carried onto it). The
    copy is captured on the device the model was (meta or not): the layouts torch.export sees, and so the
    ops it keeps (a ``contiguous`` of an already contiguous value is dropped), depend on it."""
    small_model = scaled_model(model)
    vocab = getattr(getattr(small_model, "config", None), "vocab_size", None)
    small_args, small_kwargs = scaled_inputs(planned[0], captured, args, kwargs, vocab)
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    twin = scaled_model(model, "meta") if on_meta else small_model
    lowered = lower(capture(twin, small_args, small_kwargs), planned[0].mesh)
    return small_model, small_args, small_kwargs, [transplant(p, lowered) for p in planned]


__all__ = ["scaled_config", "scaled_copy", "scaled_inputs", "scaled_model", "transplant"]
