"""Print an IR Program as text, one op per line; ir/parser.py reads the same text back."""

from __future__ import annotations

import re
from typing import Any

import torch

from autopar.ir.core import Device, MeshSpec, Op, Program, Ref, TensorType, Value

_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = {
    "True",
    "False",
    "None",
    "inf",
    "nan",
    "mesh",
    "attr",
    "param",
    "buffer",
    "input",
    "output",
    "S",
    "R",
    "P",
}


def format_literal(x: Any) -> str:
    """Literal syntax shared by op arguments, kwargs and attributes (round-trips via the parser)."""
    if isinstance(x, Ref):
        return str(x)
    if isinstance(x, Device):
        return "@device"
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return repr(x)  # 'inf', 'nan' and exact decimal forms all parse back
    if isinstance(x, str):
        # identifiers print bare ({axis=tp, op=sum}); anything the parser could read otherwise is quoted
        # (a keyword, or a torch dtype/layout/format's name such as float or strided)
        bare = _IDENT.fullmatch(x) is not None and x not in _RESERVED and not x.startswith("torch")
        bare = bare and not isinstance(getattr(torch, x, None), _TORCH_ENUMS)
        return x if bare else repr(x)
    if isinstance(x, _TORCH_ENUMS):
        return str(x)  # torch.float32, torch.strided, torch.contiguous_format
    if isinstance(x, list):
        return "[" + ", ".join(format_literal(v) for v in x) + "]"
    if isinstance(x, tuple):
        inner = ", ".join(format_literal(v) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={format_literal(v)}" for k, v in x.items()) + "}"
    raise TypeError(f"cannot print {type(x).__name__} {x!r} in the IR")


def _braced(d: dict[str, Any], open_: str, close: str) -> str:
    if not d:
        return ""
    return f" {open_}" + ", ".join(f"{k}={format_literal(v)}" for k, v in d.items()) + close


def format_type(t: TensorType) -> str:
    return str(t)


def format_value(v: Value, mesh: MeshSpec | None = None) -> str:
    ty = _local_type(v.type, mesh) if mesh is not None else format_type(v.type)
    return f"{v.kind} %{v.name} : {ty}{_braced(v.attrs, '<', '>')}"


def format_op(op: Op, types: dict[str, TensorType] | None = None, mesh: MeshSpec | None = None) -> str:
    results = ", ".join(f"%{r}" for r in op.results)
    if mesh is not None:  # after codegen the printer shows local shapes
        tys = ", ".join(_local_type(t, mesh) for t in op.types)
    else:
        tys = ", ".join(format_type(t) for t in op.types)
    args = ", ".join(format_literal(a) for a in op.args)
    line = f"{results} : {tys} = {op.target}({args}){_braced(op.kwargs, '{', '}')}"
    line += _braced(op.attrs, "<", ">")
    comment = op.path
    if op.flops or op.bytes:
        comment += f" | flops={op.flops} bytes={op.bytes}"
    if comment:
        line += f"  # {comment}"
    return line


def _local_type(t: TensorType, mesh: MeshSpec) -> str:
    shape = ",".join(str(s) for s in t.local_shape(mesh))
    return f"{t.dtype}[{shape}] {{{','.join(str(p) for p in t.placements)}}}"


def print_program(prog: Program, local: bool = False) -> str:
    """The IR as text. ``local=True`` shows each rank's local shapes (not parseable back)."""
    lines = [f"mesh @m = {prog.mesh}"]
    for k, v in prog.attrs.items():
        lines.append(f"attr {k} = {format_literal(v)}")
    mesh = prog.mesh if local else None
    lines += [format_value(v, mesh) for v in prog.inputs]
    lines += [format_op(op, mesh=mesh) for op in prog.ops]
    lines.append("output " + format_literal(tuple(prog.outputs)))
    return "\n".join(lines) + "\n"
