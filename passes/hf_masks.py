"""Capture Hugging Face attention masks as HF's eager forward makes them on the example inputs.

Under ``torch.export`` transformers' ``masking_utils`` never skips a mask: ``_ignore_causal_mask_sdpa`` answers
False while exporting (an exported program may be called at other shapes, where a hard-coded ``is_causal`` would
be wrong), and ``find_packed_sequence_indices`` cannot read the position ids, so it builds a packed-sequence mask
from them. The captured program then calls SDPA with an explicit ``[b, 1, s, s]`` boolean mask where the eager
forward on the same inputs calls it with ``attn_mask=None, is_causal=True``: on CUDA a masked SDPA cannot use the
flash kernel, and the mask alone is ``b * s**2`` bytes. autopar's programs are specialised to the captured
shapes and input structure (``local_inputs`` refuses another shape, ``flatten_inputs`` an added or removed
``attention_mask``), so the eager decision for these shapes is the right one to capture.

``eager_masks()`` patches, while capturing, only the decisions transformers makes without reading a tensor:

- the mask-skipping tests (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa`` and XPU's
  ``_can_skip_bidirectional_mask_xpu``) run HF's own code as outside export when there is no padding mask; with
  one (the user passed ``attention_mask``) they run untouched, so the mask is kept. Sliding windows, chunked
  attention and ``q_len != kv_len`` keep their masks by HF's own rules, as in eager.
- ``find_packed_sequence_indices`` gets the position ids' values when they are computed from shapes alone (no
  input, parameter or buffer among their ancestors in the trace: the model's own ``arange`` when the user passed
  no ``position_ids``); it evaluates them (``batch * seq`` integers) and returns HF's eager answer. Position
  ids from the inputs are not evaluated: the traced packed-sequence mask is kept, as today.

Each patch is applied only where the function exists with the expected first parameter (transformers >= 4.53
has ``masking_utils``); anything else, or a failure to evaluate, leaves transformers' export behaviour as it is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx.experimental import proxy_tensor
from torch.utils._python_dispatch import _disable_current_modes

_SKIP_TESTS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "_can_skip_bidirectional_mask_xpu")
_EXPORT_FLAGS = ("is_torchdynamo_exporting", "is_torchdynamo_compiling")
_MAX_ELEMENTS = 1 << 24  # a value bigger than this among the position ids' ancestors is not evaluated


@contextlib.contextmanager
def eager_masks() -> Iterator[None]:
    """While capturing: transformers' mask decisions as in eager on the example inputs (see the module docstring);
    nothing when transformers' ``masking_utils`` is not loaded (the model is not a transformers model)."""
    mu = sys.modules.get("transformers.masking_utils")
    patches: dict[str, Callable] = {}
    if mu is not None:
        for name in _SKIP_TESTS:
            fn = getattr(mu, name, None)
            if _first_parameter(fn) == "padding_mask":
                patches[name] = _skip_as_eager(mu, fn)
        fn = getattr(mu, "find_packed_sequence_indices", None)
        if _first_parameter(fn) == "position_ids":
            patches["find_packed_sequence_indices"] = _packed_as_eager(mu, fn)
    saved = {name: getattr(mu, name) for name in patches}
    for name, fn in patches.items():
        setattr(mu, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(mu, name, fn)


def _first_parameter(fn: Any) -> str | None:
    if not callable(fn):
        return None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params[0] if params else None


def _skip_as_eager(mu: Any, fn: Callable) -> Callable:
    """``fn`` (a mask-skipping test) as outside export when it is given no padding mask."""

    @functools.wraps(fn)
    def skip(*args: Any, **kwargs: Any) -> bool:
        padding = kwargs["padding_mask"] if "padding_mask" in kwargs else (args[0] if args else None)
        if padding is not None:
            return fn(*args, **kwargs)
        with _as_eager(mu):
            return fn(*args, **kwargs)

    return skip


def _packed_as_eager(mu: Any, fn: Callable) -> Callable:
    """``find_packed_sequence_indices`` answering as in eager when the position ids' values follow from shapes."""

    @functools.wraps(fn)
    def packed(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        values = shape_constant(position_ids)
        if values is not None:
            with _disable_current_modes(), _as_eager(mu):
                if fn(values, *args, **kwargs) is None:
                    return None  # one sequence per row, as eager finds
        return fn(position_ids, *args, **kwargs)

    return packed


@contextlib.contextmanager
def _as_eager(mu: Any) -> Iterator[None]:
    """``masking_utils``' tracing flags as outside export: not exporting or compiling, and a tensor is traced only
    when it is a traced tensor itself (a fake tensor, a proxy), not because an export is running."""
    flags = {name: getattr(mu, name) for name in _EXPORT_FLAGS if callable(getattr(mu, name, None))}
    if callable(getattr(mu, "is_tracing", None)):
        flags["is_tracing"] = mu.is_tracing
    for name in flags:
        setattr(mu, name, _is_traced if name == "is_tracing" else _never)
    try:
        yield
    finally:
        for name, fn in flags.items():
            setattr(mu, name, fn)


def _never() -> bool:
    return False


def _is_traced(tensor: Any = None) -> bool:
    return tensor is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def shape_constant(t: Any) -> torch.Tensor | None:
    """The values of ``t``, a tensor in the trace being captured, when they follow from shapes alone: every op
    among its ancestors an aten op (or a getitem of one's results) whose arguments are constants or other such
    ops, none an input, parameter, buffer or lifted constant. Evaluated on the CPU; None when not so, or when the
    trace cannot be read (no proxy mode: not under capture)."""
    try:
        mode = proxy_tensor.get_proxy_mode()
        if mode is None or not isinstance(t, torch.Tensor):
            return None
        proxy = proxy_tensor.get_proxy_slot(t, mode.tracer, None, lambda e: e.proxy)
        if proxy is None:
            return None
        needed = _ancestors(proxy.node)
        if needed is None:
            return None
        with _disable_current_modes():
            env: dict[torch.fx.Node, Any] = {}
            for node in proxy.node.graph.nodes:
                if node in needed:
                    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                    env[node] = node.target(*_on_cpu(args), **_on_cpu(kwargs))
            out = env[proxy.node]
    except Exception:  # an internal torch API moved, or an op refused CPU constants: capture as without the patch
        return None
    return out if isinstance(out, torch.Tensor) and type(out) is torch.Tensor else None


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node] | None:
    """``node`` and the nodes it is computed from, when all are aten ops on constants (see ``shape_constant``)."""
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op != "call_function" or not (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem):
            return None
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > _MAX_ELEMENTS:
            return None
        if any(isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool) for a in _leaves((n.args, n.kwargs))):
            return None
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _leaves(tree: Any) -> list[Any]:
    return torch.utils._pytree.tree_leaves(tree)


def _on_cpu(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda x: torch.device("cpu") if isinstance(x, torch.device) else x, tree)
