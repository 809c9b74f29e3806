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
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float64:
            return grouped_mm_float64(*args, **kwargs)
        return func(*args, **kwargs)


def grouped_mm_float64(a, b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """``torch._grouped_mm`` in float64, which torch's kernels lack (float32 and half types only), group by group
    with ``mm``: what transformers' default MoE kernel (``experts_implementation="grouped_mm"``) calls, forward and
    backward, when a model is run in float64 eagerly. ``offs`` are the groups' cumulative ends along a's rows
    (2-D a, 3-D b), b's columns (3-D a, 2-D b) or the contracted dim (2-D a and b, one product per group); a row
    past the last offset is zero, as in transformers' fallback kernel."""
    if bias is not None and not (b.dim() == 3):
        raise ValueError("grouped_mm_float64: a bias is defined for a 3-D second operand only")
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b) + (bias.unsqueeze(1) if bias is not None else 0)
    else:
        ends = [int(e) for e in offs.tolist()]
        starts = [0] + ends[:-1]
        if a.dim() == 2 and b.dim() == 3:
            out = a.new_zeros(a.shape[0], b.shape[-1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                out[s:e] = a[s:e] @ b[g] + (bias[g] if bias is not None else 0)
        elif a.dim() == 3 and b.dim() == 2:
            out = a.new_zeros(a.shape[1], b.shape[-1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                out[:, s:e] = a[g] @ b[:, s:e]
        else:
            out = torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    return out if out_dtype is None else out.to(out_dtype)


def double(x: Any) -> Any:
    """``x`` in float64 if it is a lower-precision float tensor (detached), else ``x``."""
    if isinstance(x, torch.Tensor) and x.dtype in _TORCH_FLOATS:
        return x.detach().to(torch.float64)
    return x


__all__ = ["Float64Mode", "double", "grouped_mm_float64", "to_float64"]
