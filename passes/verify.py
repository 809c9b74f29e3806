"""Check the IR's invariants: SSA, defined-before-use, placements that fit the mesh, shapes."""

from __future__ import annotations

from autopar.errors import VerifyError
from autopar.passes.ir import COLLECTIVES, Op, Partial, Program, Replicate, Shard, TensorType, iter_refs


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
                raise VerifyError(
                    f"{where}: S({p.dim}) on axis {axis} but the tensor has rank {len(t.shape)}"
                )
            per_dim[p.dim] = per_dim.get(p.dim, 1) * n
            if t.shape[p.dim] % (per_dim[p.dim] * p.chunks):
                raise VerifyError(
                    f"{where}: dim {p.dim} of size {t.shape[p.dim]} is not divisible by "
                    f"{per_dim[p.dim] * p.chunks} (axis {axis}, {p})"
                )
        elif not isinstance(p, (Replicate, Partial)):
            raise VerifyError(f"{where}: {p!r} is not a placement")


def _check_collective(op: Op, types: dict[str, TensorType], prog: Program) -> None:
    if op.target in ("send", "recv"):
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
    op's result shape and dtype on the meta device and compares it with the IR's type."""
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


def _check_shape(op: Op, types: dict[str, TensorType]) -> None:
    import torch

    from autopar.passes.ir import DEVICE, Device, map_refs, resolve_target

    def meta(ref):
        t = types[ref.name]
        return torch.empty(t.shape, dtype=t.torch_dtype, device="meta")

    def dev(x):
        return torch.device("meta") if isinstance(x, Device) else x

    args = map_refs(op.args, meta)
    kwargs = {k: dev(v) for k, v in map_refs(op.kwargs, meta).items()}
    args = tuple(dev(a) if a is DEVICE else a for a in args)
    out = resolve_target(op.target)(*args, **kwargs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for r, t, o in zip(op.results, op.types, outs):
        if tuple(o.shape) != t.shape:
            raise VerifyError(
                f"%{r} = {op.target}: the IR says shape {list(t.shape)}, the op gives {list(o.shape)}"
            )
