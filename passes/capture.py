"""Capture an nn.Module with torch.export (non-strict) without computing or allocating weights."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.errors import CaptureError


@dataclass
class Captured:
    """An exported program plus what autopar needs to call the sharded result like the model."""

    exported: torch.export.ExportedProgram
    in_spec: Any
    out_spec: Any
    seconds: float
    user_input_names: list[str] = field(default_factory=list)


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
        ep = torch.export.export(model, tuple(args), kwargs, strict=False)
    except (TypeError, RuntimeError, ValueError, IndexError) as e:
        if _is_input_mismatch(e):
            raise CaptureError(
                f"the example inputs do not fit {type(model).__name__}: {_short(e)}\n"
                "Pass inputs with the shapes and argument names the model's forward expects."
            ) from e
        raise CaptureError(_export_failure(model, e)) from e
    except Exception as e:  # torch._dynamo / export UserErrors and unsupported-op errors
        raise CaptureError(_export_failure(model, e)) from e
    seconds = time.perf_counter() - t0
    spec = ep.module_call_graph[0].signature
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    return Captured(ep, spec.in_spec, spec.out_spec, seconds, names)


_MISMATCH_HINTS = (
    "shapes cannot be multiplied",
    "size of tensor",
    "must match the size",
    "unexpected keyword",
    "positional argument",
    "missing",
    "index out of range",
    "expected input",
    "Expected",
    "shape",
)


def _is_input_mismatch(e: Exception) -> bool:
    msg = str(e)
    return isinstance(e, (TypeError, IndexError)) or any(h in msg for h in _MISMATCH_HINTS)


def _short(e: Exception, lines: int = 6) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n".join(text[:lines])


def _export_failure(model: torch.nn.Module, e: Exception) -> str:
    """Name the op or the user's source line torch.export stopped at."""
    user_frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "/torch/" not in f.filename and "autopar" not in f.filename
    ]
    where = (
        f"\n  at {user_frames[-1].filename}:{user_frames[-1].lineno}: {user_frames[-1].line}"
        if user_frames
        else ""
    )
    return (
        f"torch.export cannot capture {type(model).__name__}: {_short(e)}{where}\n"
        "Make the forward traceable (no data-dependent Python control flow on tensor values, no "
        "unsupported ops), or wrap the offending part in a function torch.export supports; see "
        "https://pytorch.org/docs/stable/export.html"
    )
