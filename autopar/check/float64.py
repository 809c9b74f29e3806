"""float64 semantics for exact checks: a planned program and a model run with every float in float64.

A model that upcasts inside (Hugging Face's RMS norms and rotary tables compute in float32, its losses cast
logits with ``.float()``) keeps float32 rounding in a float64 copy, and a sharded reduction of such a value
rounds differently from the unsharded one (~1e-9 after a few AdamW steps). ``to_float64`` rewrites a
program's float types and dtype arguments to float64; ``Float64Mode`` does the same to every op a model runs
eagerly. ``autopar check`` and the simulator's training (``autopar/check/simtrain.py``) compare the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.ir.core import Program, TensorType, Value

_FLOATS = {"f32": "f64", "f16": "f64", "bf16": "f64"}
_TORCH_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def to_float64(prog: Program) -> Program:
    """The program with every floating tensor and dtype argument in float64 (same ops, placements)."""

    def ty(t: TensorType) -> TensorType:
        return TensorType(_FLOATS.get(t.dtype, t.dtype), t.shape, t.placements)

    def arg(x: Any) -> Any:
        if isinstance(x, torch.dtype):
            return torch.float64 if x in _TORCH_FLOATS else x
        if isinstance(x, (list, tuple)):
            return type(x)(arg(v) for v in x)
        if isinstance(x, dict):
            return {k: arg(v) for k, v in x.items()}
        return x

    inputs = tuple(Value(v.name, v.kind, ty(v.type), v.attrs) for v in prog.inputs)
    ops = tuple(
        op.with_(types=tuple(ty(t) for t in op.types), args=arg(op.args), kwargs=arg(op.kwargs)) for op in prog.ops
    )
    return prog.with_(inputs=inputs, ops=ops)


class Float64Mode(TorchDispatchMode):
    """Runs the model with every cast to a lower float dtype made to float64 (HF's loss upcasts logits
    with ``.float()``, which on a float64 model would round them to float32)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {k: (torch.float64 if v in _TORCH_FLOATS else v) for k, v in (kwargs or {}).items()}
        args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in _TORCH_FLOATS else a for a in args)
        return func(*args, **kwargs)


def double(x: Any) -> Any:
    """``x`` in float64 if it is a lower-precision float tensor (detached), else ``x``."""
    if isinstance(x, torch.Tensor) and x.dtype in _TORCH_FLOATS:
        return x.detach().to(torch.float64)
    return x


__all__ = ["Float64Mode", "double", "to_float64"]
