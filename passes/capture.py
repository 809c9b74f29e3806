"""Capture an nn.Module with torch.export (non-strict) without computing or allocating weights."""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.errors import CaptureError
from autopar.ir.core import Program
from autopar.passes.hf_masks import eager_masks


@dataclass(frozen=True)
class LayerRepeat:
    """How a captured layer stack stands for the model's (``passes/repeat_layers.py``): ``kept[p]`` is the model's
    index of the layer captured at position ``p``; ``copies``: (position, count) of each captured layer followed by
    ``count`` more like it."""

    stack: str  # module path of the layer list: "model.layers"
    kept: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]


@dataclass
class Captured:
    """An exported program plus what autopar needs to call the sharded result like the model."""

    exported: torch.export.ExportedProgram
    in_spec: Any
    out_spec: Any
    seconds: float
    user_input_names: list[str] = field(default_factory=list)
    # planning's capture of a few layers that stand for the whole stack (passes/repeat_layers.py): ``lower``
    # repeats them to the model's depth; None: the model as it is
    repeat: LayerRepeat | None = None
    # ``lower(self, MeshSpec())`` where planning's capture made it already (its checks): the fingerprint's program
    plain: Program | None = None


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_like(x, device="meta")
    return x


def capture(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> Captured:
    """Export ``model(*args, **kwargs)``.

    A model built on the meta device is captured there (inputs are moved to meta too), so no weight
    is ever allocated; a model with real weights is traced with fake tensors by torch.export itself,
    so nothing is computed and its weights are not copied.
    """
    kwargs = dict(kwargs or {})
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if on_meta:
        args = torch.utils._pytree.tree_map(_to_meta, args)
        kwargs = torch.utils._pytree.tree_map(_to_meta, kwargs)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), _static_experts(model), eager_masks():
            # torch's RNN modules re-assign their weight list in forward: export warns, and nothing is wrong
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights", category=UserWarning)
            ep = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:
        if _is_capture_limit(e):
            raise CaptureError(_export_failure(model, e)) from e
        raise CaptureError(
            f"the example inputs do not fit {type(model).__name__}: {_short(e)}{_where(e)}\n"
            "Pass inputs with the shapes, dtypes and argument names the model's forward expects."
        ) from e
    seconds = time.perf_counter() - t0
    spec = ep.module_call_graph[0].signature
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    return Captured(ep, spec.in_spec, spec.out_spec, seconds, names)


@contextlib.contextmanager
def _static_experts(model: torch.nn.Module) -> Iterator[None]:
    """Hugging Face MoE experts set to transformers' eager loop over experts (``experts_implementation="eager"``)
    traced through its ``grouped_mm`` kernel instead. The loop's shapes depend on the routing (``nonzero``, a
    Python loop over the experts hit, a gather of each one's tokens), which torch.export cannot capture; the
    grouped kernel computes the same sum of each token's experts, weighted by the router, with static shapes.
    Found by duck typing: a module with transformers' experts attributes (``use_experts_implementation``)."""
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") and hasattr(m, "config")
    }
    eager = {k: c for k, c in configs.items() if getattr(c, "_experts_implementation", None) in ("eager", None)}
    was = {k: c._experts_implementation for k, c in eager.items()}
    for c in eager.values():
        c._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for k, c in eager.items():
            c._experts_implementation = was[k]


# Exceptions that mean torch.export itself cannot trace the code (as opposed to the model raising
# an ordinary shape or argument error on the example inputs).
_CAPTURE_LIMITS = (
    "UserError",
    "Unsupported",
    "GuardOnDataDependentSymNode",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    "PendingUnbackedSymbolNotFound",
)


def _is_capture_limit(e: BaseException | None) -> bool:
    while e is not None:
        if any(name in type(e).__name__ for name in _CAPTURE_LIMITS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _short(e: Exception, lines: int = 6) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n".join(text[:lines])


def _where(e: Exception) -> str:
    """The innermost frame of the user's code in the traceback: the line to look at."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "/torch/" not in f.filename and "/autopar/" not in f.filename and "/passes/" not in f.filename
    ]
    return f"\n  at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""


def _export_failure(model: torch.nn.Module, e: Exception) -> str:
    """Name the op or the user's source line torch.export stopped at."""
    return (
        f"torch.export cannot capture {type(model).__name__}: {_short(e)}{_where(e)}\n"
        "Make the forward traceable (no data-dependent Python control flow on tensor values, no "
        "unsupported ops), or wrap the offending part in a function torch.export supports; see "
        "https://pytorch.org/docs/stable/export.html"
    )


def flatten_inputs(in_spec: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Flatten a call's inputs in the order of the captured ``in_spec`` (keyword order may differ);
    raise CaptureError when they are not the structure the model was captured with."""
    keys = in_spec.child(1).context if in_spec.num_children == 2 else None
    if keys is not None and set(kwargs) == set(keys):
        kwargs = {k: kwargs[k] for k in keys}
    flat, spec = torch.utils._pytree.tree_flatten((tuple(args), kwargs))
    if spec != in_spec:
        want, got = _names(in_spec), _names(spec)
        missing, extra = [x for x in want if x not in got], [x for x in got if x not in want]
        detail = (f"; missing {missing}" if missing else "") + (f"; not compiled for {extra}" if extra else "")
        detail = detail or "; the same names nested another way"
        raise CaptureError(
            f"the inputs do not match the example inputs the model was compiled with ({', '.join(want)}){detail}: "
            "pass the same inputs, or compile again with these"
        )
    return flat


def _names(spec: Any) -> list[str]:
    """Each input leaf of a call's ``(args, kwargs)`` spec by the user's name: ``args[i]`` or the keyword, then
    the path inside it."""
    template = torch.utils._pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    out = [""] * spec.num_leaves
    for path, i in torch.utils._pytree.tree_flatten_with_path(template)[0]:
        head = f"args[{path[1].idx}]" if path[0].idx == 0 else str(path[1].key)
        out[i] = head + torch.utils._pytree.keystr(path[2:])
    return out
