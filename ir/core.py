"""The autopar IR: frozen values for mesh, placements, tensor types, ops and whole programs.

One op per line, SSA names, global shapes, placements per mesh axis (DTensor vocabulary):

    mesh @m = [dp=2, tp=2]
    param %wte.weight : f32[128,64] {R,S(1)}
    input %input_ids : i64[4,16] {S(0),R}
    %3 : f32[4,16,64] {S(0),S(2)} = aten.embedding(%wte.weight, %input_ids)  # transformer.wte
    %4 : f32[4,16,64] {S(0),R} = all_gather(%3) {axis=tp, dim=2}
    output %loss, %logits

"axis" always means a mesh axis and "dim" a tensor dimension. The printer lives in
``ir/printer.py``, the parser in ``ir/parser.py`` and the verifier in ``ir/verify.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autopar.ir.axes import PIPELINE_AXIS, is_pipeline_axis

# ---------------------------------------------------------------------------------------------
# Placements


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Rank i of the axis holds the i-th slice of ``dim``.

    ``chunks > 1`` is an interleaved shard: the dim is first cut into ``chunks`` equal pieces and each
    piece is sharded on its own, so rank i holds slice i of every piece. It is what a fused QKV
    projection needs for its output to split into head-parallel q, k and v (DTensor's _StridedShard).
    """

    dim: int
    chunks: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim},{self.chunks})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the whole tensor is their sum (or average)."""

    op: str = "sum"

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Replicate | Shard | Partial
R = Replicate()


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return R
    if text.startswith("S(") and text.endswith(")"):
        parts = [int(p) for p in text[2:-1].split(",")]
        return Shard(*parts)
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    raise ValueError(f"not a placement: {text!r} (expected R, S(dim), S(dim,chunks) or P(op))")


# ---------------------------------------------------------------------------------------------
# Mesh and tensor types


@dataclass(frozen=True)
class MeshSpec:
    """Named mesh axes and their sizes, e.g. dp=2, tp=4. The IR needs no process group."""

    axes: tuple[tuple[str, int], ...] = ()

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    def index(self, name: str) -> int:
        return self.names.index(name)

    @property
    def pipeline_size(self) -> int:
        """The size of the pipeline axis (``pp``, see ``ir/axes.py``); 1 on a mesh without one."""
        return dict(self.axes).get(PIPELINE_AXIS, 1)

    def without_pipeline(self) -> MeshSpec:
        """This mesh without its pipeline axis: the mesh the intra-op plan (the ILP) is made for."""
        return MeshSpec(tuple((a, s) for a, s in self.axes if not is_pipeline_axis(a)))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}={s}" for a, s in self.axes) + "]"


DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}
SHORT_DTYPE = {v: k for k, v in DTYPE_SHORT.items()}
ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in SHORT_DTYPE.items()}


@dataclass(frozen=True)
class TensorType:
    """dtype, global shape and one placement per mesh axis."""

    dtype: str
    shape: tuple[int, ...]
    placements: tuple[Placement, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return SHORT_DTYPE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.torch_dtype.is_floating_point

    def with_placements(self, placements: tuple[Placement, ...]) -> TensorType:
        return replace(self, placements=tuple(placements))

    def local_shape(self, mesh: MeshSpec) -> tuple[int, ...]:
        return local_shape(self.shape, self.placements, mesh.sizes)

    def local_shape_for(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return local_shape(self.shape, self.placements, sizes)

    def local_nbytes(self, mesh: MeshSpec) -> int:
        return math.prod(self.local_shape(mesh)) * self.itemsize

    def __str__(self) -> str:
        shape = ",".join(str(s) for s in self.shape)
        return f"{self.dtype}[{shape}] {{{','.join(str(p) for p in self.placements)}}}"


def local_shape(shape: tuple[int, ...], placements: tuple[Placement, ...], sizes: tuple[int, ...]):
    out = list(shape)
    for p, n in zip(placements, sizes):
        if isinstance(p, Shard):
            out[p.dim] //= n
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Values, ops, programs


@dataclass(frozen=True)
class Ref:
    """A use of an SSA value inside an op's arguments."""

    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


class Device:
    """The symbolic device argument: capture runs on meta, codegen substitutes the rank's device."""

    _instance: Device | None = None

    def __new__(cls) -> Device:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "@device"

    def __reduce__(self):
        return (Device, ())


DEVICE = Device()


@dataclass(frozen=True)
class Value:
    """A graph input: a parameter, buffer or user input."""

    name: str
    kind: str  # "param" | "buffer" | "input"
    type: TensorType
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Op:
    """One operation: results, their types, the target, its arguments and annotations.

    ``args``/``kwargs`` are what the target is called with (Refs for SSA values). ``attrs`` are
    autopar's annotations (stage, chosen strategy, ...) and never reach the target.
    """

    results: tuple[str, ...]
    types: tuple[TensorType, ...]
    target: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    path: str = ""
    flops: int = 0
    bytes: int = 0

    @property
    def result(self) -> str:
        return self.results[0]

    @property
    def type(self) -> TensorType:
        return self.types[0]

    def input_refs(self) -> list[Ref]:
        return [r for r in iter_refs((self.args, self.kwargs))]

    def with_(self, **changes: Any) -> Op:
        return replace(self, **changes)


COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "local_shard",
        "grad_all_reduce",
        "send",
        "recv",
    }
)


# ATen ops that only reinterpret their input's memory (no new data): views, aliases, splits.
VIEW_OPS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.reshape",
        "aten.expand",
        "aten.transpose.int",
        "aten.permute",
        "aten.t",
        "aten.unsqueeze",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.split.Tensor",
        "aten.split_with_sizes",
        "aten.unbind.int",
        "aten.alias",
        "aten.detach",
        "aten.as_strided",
    }
)


def iter_refs(obj: Any):
    """Yield every Ref inside a nest of tuples, lists and dicts, in order."""
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_refs(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_refs(x)


def map_refs(obj: Any, fn) -> Any:
    """Rebuild a nest with every Ref replaced by fn(Ref)."""
    if isinstance(obj, Ref):
        return fn(obj)
    if isinstance(obj, list):
        return [map_refs(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(map_refs(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_refs(v, fn) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class Program:
    """A whole captured model: mesh, graph inputs, ops in topological order, outputs."""

    mesh: MeshSpec
    inputs: tuple[Value, ...]
    ops: tuple[Op, ...]
    outputs: tuple[Any, ...]  # Refs, or constants (None) the model returns
    attrs: dict[str, Any] = field(default_factory=dict)

    def types(self) -> dict[str, TensorType]:
        """Name -> type of every SSA value."""
        out = {v.name: v.type for v in self.inputs}
        for op in self.ops:
            out.update(zip(op.results, op.types))
        return out

    def producers(self) -> dict[str, Value | Op]:
        out: dict[str, Value | Op] = {v.name: v for v in self.inputs}
        for op in self.ops:
            for r in op.results:
                out[r] = op
        return out

    def users(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {v.name: [] for v in self.inputs}
        for op in self.ops:
            for r in op.results:
                out.setdefault(r, [])
        for op in self.ops:
            seen = set()
            for ref in op.input_refs():
                if ref.name not in seen:
                    out[ref.name].append(op)
                    seen.add(ref.name)
        return out

    def requires_grad(self) -> set[str]:
        """Names of the values whose gradient backward computes: float parameters (not the ``frozen`` ones, the
        user's ``requires_grad=False``) and what they feed."""
        out = {v.name for v in self.inputs if v.kind == "param" and v.type.is_float and not v.attrs.get("frozen")}
        for op in self.ops:
            if any(r.name in out for r in op.input_refs()):
                out.update(r for r, t in zip(op.results, op.types) if t.is_float)
        return out

    @property
    def params(self) -> tuple[Value, ...]:
        return tuple(v for v in self.inputs if v.kind == "param")

    def with_(self, **changes: Any) -> Program:
        return replace(self, **changes)


def resolve_target(target: str):
    """'aten.view' -> torch.ops.aten.view.default, 'aten.add.Tensor' -> torch.ops.aten.add.Tensor; an op of
    another namespace keeps it: 'transformers.grouped_mm_fallback' -> torch.ops.transformers.grouped_mm_fallback
    .default (a custom op, registered by the library that defines it, which must be imported). KeyError for a
    target no registered op has."""
    parts = target.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise KeyError(f"{target!r} is not an op name (namespace.op[.overload])")
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(packet, parts[2] if len(parts) == 3 else "default")
    except (AttributeError, RuntimeError) as e:
        raise KeyError(f"no op {target!r} is registered with torch ({e})") from None


def bound_args(op: Op) -> dict[str, Any] | None:
    """``op``'s arguments (positional and keyword) by their names in its ATen schema; None for a target that
    is no ATen op."""
    try:
        schema = resolve_target(op.target)._schema
    except (KeyError, AttributeError):
        return None
    return dict(zip((a.name for a in schema.arguments), op.args)) | dict(op.kwargs)


def target_name(op_overload) -> str:
    """Inverse of resolve_target: the op's namespace, name and overload ('default' left out)."""
    namespace, packet = op_overload._schema.name.split("::")
    overload = op_overload._overloadname
    return f"{namespace}.{packet}" if overload == "default" else f"{namespace}.{packet}.{overload}"
