"""Check the IR's invariants: SSA, defined-before-use, placements that fit the mesh, shapes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.errors import VerifyError
from autopar.ir.core import (
    COLLECTIVES,
    DEVICE,
    Device,
    Op,
    Partial,
    Program,
    Ref,
    Replicate,
    Shard,
    TensorType,
    iter_refs,
    map_refs,
    resolve_target,
)


def _check_type(where: str, t: TensorType, prog: Program) -> None:
    mesh = prog.mesh
    if len(t.placements) != len(mesh.axes):
        raise VerifyError(
            f"{where}: {len(t.placements)} placements for a mesh of {len(mesh.axes)} axes {mesh}; "
            "give one placement per mesh axis"
        )
    per_dim: dict[int, int] = {}
    for p, (axis, n) in zip(t.placements, mesh.axes):
        if isinstance(p, Shard):
            if not 0 <= p.dim < len(t.shape):
                raise VerifyError(f"{where}: S({p.dim}) on axis {axis} but the tensor has rank {len(t.shape)}")
            per_dim[p.dim] = per_dim.get(p.dim, 1) * n
            if t.shape[p.dim] % (per_dim[p.dim] * p.chunks):
                raise VerifyError(
                    f"{where}: dim {p.dim} of size {t.shape[p.dim]} is not divisible by "
                    f"{per_dim[p.dim] * p.chunks} (axis {axis}, {p})"
                )
        elif not isinstance(p, (Replicate, Partial)):
            raise VerifyError(f"{where}: {p!r} is not a placement")


def _check_transfer(op: Op, types: dict[str, TensorType], prog: Program) -> None:
    """send/recv: a pipeline-axis name, a neighbouring peer stage, send keeps the type."""
    where = f"%{op.result} = {op.target}"
    axis = op.kwargs.get("axis")
    want = prog.attrs.get("pipeline_axis")
    if not isinstance(axis, str) or (want is not None and axis != want):
        raise VerifyError(f"{where}: axis {axis!r} is not the pipeline axis {want!r}")
    if axis in prog.mesh.names:
        raise VerifyError(f"{where}: the pipeline axis {axis} must not be an axis of the program's mesh {prog.mesh}")
    peer = op.kwargs.get("peer_stage")
    if not isinstance(peer, int) or isinstance(peer, bool) or peer < 0:
        raise VerifyError(f"{where}: peer_stage must be a stage number, not {peer!r}")
    stage = op.attrs.get("stage")
    if stage is not None and peer != stage + (1 if op.target == "send" else -1):
        raise VerifyError(f"{where} in stage {stage} names peer stage {peer}; only neighbouring stages exchange")
    if op.target == "send":
        if len(op.args) != 1 or op.args[0].name not in types:
            raise VerifyError(f"{where}: send takes exactly one value")
        if types[op.args[0].name] != op.type:
            raise VerifyError(f"{where}: send must not change the type ({types[op.args[0].name]} -> {op.type})")
    elif op.args:
        raise VerifyError(f"{where}: recv takes no arguments")


def _check_channels(prog: Program) -> None:
    """The k-th send from stage a to stage b carries the type of the k-th recv of b from a."""
    sends: dict[tuple[int, int], list[TensorType]] = {}
    recvs: dict[tuple[int, int], list[TensorType]] = {}
    for op in prog.ops:
        if op.target in ("send", "recv") and "stage" in op.attrs:
            s, peer = op.attrs["stage"], op.kwargs["peer_stage"]
            key, book = ((s, peer), sends) if op.target == "send" else ((peer, s), recvs)
            book.setdefault(key, []).append(op.type)
    for key in sorted(set(sends) | set(recvs)):
        a, b = sends.get(key, []), recvs.get(key, [])
        if a != b:
            raise VerifyError(
                f"stage {key[0]} sends {len(a)} value(s) to stage {key[1]}, which receives {len(b)}"
                + ("" if len(a) != len(b) else " of other types")
                + ": every send needs a recv of the same type, in the same order"
            )


def _check_collective(op: Op, types: dict[str, TensorType], prog: Program) -> None:
    if op.target in ("send", "recv"):
        _check_transfer(op, types, prog)
        return
    axis = op.kwargs.get("axis")
    if axis not in prog.mesh.names:
        raise VerifyError(f"%{op.result} = {op.target}: axis {axis!r} is not a mesh axis {prog.mesh}")
    src = types[op.args[0].name]
    dst = op.type
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise VerifyError(f"%{op.result} = {op.target}: a collective changes neither shape nor dtype")
    i = prog.mesh.index(axis)
    others_same = all(a == b for j, (a, b) in enumerate(zip(src.placements, dst.placements)) if j != i)
    if not others_same:
        raise VerifyError(f"%{op.result} = {op.target} on axis {axis} changed placements of other axes")
    a, b = src.placements[i], dst.placements[i]
    ok = {
        "all_reduce": isinstance(a, Partial) and isinstance(b, Replicate),
        "reduce_scatter": isinstance(a, Partial) and isinstance(b, Shard),
        "all_gather": isinstance(a, Shard) and isinstance(b, Replicate),
        "all_to_all": isinstance(a, Shard) and isinstance(b, Shard),
        "local_shard": isinstance(a, Replicate) and isinstance(b, Shard),
        "grad_all_reduce": a == b,
    }[op.target]
    if not ok:
        raise VerifyError(f"%{op.result} = {op.target} on axis {axis} cannot turn {a} into {b}")


def verify(prog: Program, shapes: bool = False) -> None:
    """Raise VerifyError on the first broken invariant. ``shapes=True`` also re-infers every aten
    op's result shape and dtype on the meta device and compares it with the IR's type (an op that reads a
    file or writes its arguments is refused, never run: ``side_effect``)."""
    defined: dict[str, TensorType] = {}
    for v in prog.inputs:
        if v.name in defined:
            raise VerifyError(f"%{v.name} is defined twice")
        _check_type(f"{v.kind} %{v.name}", v.type, prog)
        defined[v.name] = v.type
    for op in prog.ops:
        for ref in iter_refs((op.args, op.kwargs)):
            if ref.name not in defined:
                raise VerifyError(f"%{op.result} = {op.target} uses %{ref.name} before it is defined")
        if len(op.results) != len(op.types):
            raise VerifyError(f"%{op.result}: {len(op.results)} results but {len(op.types)} types")
        for r, t in zip(op.results, op.types):
            if r in defined:
                raise VerifyError(f"%{r} is defined twice (SSA)")
            _check_type(f"%{r} = {op.target}", t, prog)
            defined[r] = t
        if op.target in COLLECTIVES:
            _check_collective(op, defined, prog)
        elif shapes and op.target.startswith("aten."):
            _check_shape(op, defined)
    for ref in iter_refs(prog.outputs):
        if ref.name not in defined:
            raise VerifyError(f"output %{ref.name} is not defined")
    _check_channels(prog)


# ATen ops that reach outside the program (files) or ops of autopar's vocabulary never hold: never run here
_IO_OPS = frozenset({"aten.from_file", "aten._nested_tensor_from_mask", "aten.set_"})


def side_effect(target: str) -> str | None:
    """What ``target`` does besides computing its results from its arguments: reads a file, writes an
    argument in place (functionalized lowering never emits such) or draws random numbers; ``None`` when
    nothing (or it is not an ATen op)."""
    if target in _IO_OPS:
        return "reads or writes memory outside the program (a file)"
    try:
        fn = resolve_target(target)
    except (KeyError, AttributeError):
        return None
    if fn._schema.is_mutable:
        return "writes one of its arguments in place"
    if torch.Tag.nondeterministic_seeded in fn.tags:
        return "draws random numbers"
    return None


def _check_shape(op: Op, types: dict[str, TensorType]) -> None:
    """The op's result shapes as the IR says: the op run on the meta device on its arguments' whole shapes."""
    for r, t, shape in zip(op.results, op.types, _meta_shapes(op, op.args, lambda ref: types[ref.name].shape, types)):
        if shape != t.shape:
            raise VerifyError(f"%{r} = {op.target}: the IR says shape {list(t.shape)}, the op gives {list(shape)}")


def _meta_shapes(op: Op, args: tuple, shape_of: Callable[[Ref], tuple[int, ...]], types) -> list[tuple[int, ...]]:
    """The shapes of ``op``'s results: ``op.target`` run on the meta device with positional arguments ``args``
    (``op.args``, or as a rank calls it), each value ``ref`` of shape ``shape_of(ref)``. An op that reads a file
    or writes its arguments is refused, never run (``side_effect``)."""
    effect = side_effect(op.target)
    if effect is not None and effect != "draws random numbers":  # a random op on meta tensors draws nothing
        raise VerifyError(
            f"%{op.result} = {op.target} {effect}: autopar's programs never hold such an op, so it is not run to "
            "check its shape; the program was edited or is not autopar's"
        )

    def meta(ref):
        return torch.empty(shape_of(ref), dtype=types[ref.name].torch_dtype, device="meta")

    def dev(x):
        return torch.device("meta") if isinstance(x, Device) else x

    margs = tuple(dev(a) if a is DEVICE else a for a in map_refs(args, meta))
    kwargs = {k: dev(v) for k, v in map_refs(op.kwargs, meta).items()}
    out = resolve_target(op.target)(*margs, **kwargs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return [tuple(o.shape) for o in outs]


# -- what one rank runs: every ATen op on its local shards -------------------------------------------------------

_SHAPE_ARG = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.expand"}
_SPLIT = {"aten.split.Tensor", "aten.split_with_sizes"}
# ATen ops that a rank does not run as the op on its shards (``runtime/build/codegen.py`` calls its own function
# for them where they are split: expert-parallel or row-split grouped matmuls)
_OWN_CALL = frozenset({"aten._grouped_mm"})


def local_args(op: Op, mesh_sizes: tuple[int, ...]) -> tuple:
    """The op's positional arguments with global shape arguments replaced by local ones: what a rank calls
    it with (``runtime/build/codegen.py``)."""
    args = list(op.args)
    if op.target in _SHAPE_ARG:
        args[1] = list(op.types[0].local_shape_for(mesh_sizes))
    elif op.target in _SPLIT:
        dim = (args[2] if len(args) > 2 else 0) % len(op.types[0].shape)
        sizes = [t.local_shape_for(mesh_sizes)[dim] for t in op.types]
        args[1] = sizes[0] if op.target == "aten.split.Tensor" else sizes
    return tuple(args)


def verify_local(prog: Program) -> None:
    """Raise VerifyError where an ATen op cannot run on one rank's shards: each rank runs the op on the local
    shapes of its arguments (their shapes divided by the mesh axes that split them), which must give the local
    shapes of its results under their placements. ``verify(shapes=True)`` compares whole shapes only, so an
    edited placement (a bias ``{R,S(0)}`` made ``{R,R}``) passed it and failed in the generated code. Shards are
    even (``_check_type``), so every rank has the same local shapes and one check holds for all of them."""
    sizes = prog.mesh.sizes
    types = prog.types()

    def local(ref: Ref) -> tuple[int, ...]:
        return types[ref.name].local_shape_for(sizes)

    def shown(ref: Ref) -> str:
        return f"%{ref.name} {list(local(ref))} {{{','.join(map(str, types[ref.name].placements))}}}"

    for op in prog.ops:
        if not op.target.startswith("aten.") or op.target in _OWN_CALL:
            continue
        reads = ", ".join(shown(r) for r in dict.fromkeys(iter_refs((op.args, op.kwargs))))
        try:
            got = _meta_shapes(op, local_args(op, sizes), local, types)
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise VerifyError(
                f"%{op.result} = {op.target} cannot run on one rank's shards: it reads {reads} there ({first}); "
                "a placement of one of them does not fit the others"
            ) from None
        for r, t, shape in zip(op.results, op.types, got):
            want = t.local_shape_for(sizes)
            if shape != want:
                raise VerifyError(
                    f"%{r} = {op.target}: on one rank it reads {reads} and gives shape {list(shape)}, but %{r}'s "
                    f"placements {{{','.join(map(str, t.placements))}}} say {list(want)}"
                )
