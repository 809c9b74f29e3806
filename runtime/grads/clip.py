"""Global-norm gradient clipping over every shard of a compiled model, each gradient element counted once.

``torch.nn.utils.clip_grad_norm_`` on one device computes ``||g||_p`` over every parameter's gradient
and scales all of them by ``min(1, max_norm / (||g|| + 1e-6))``. On a mesh every rank holds pieces of
the gradients, some of them copies of each other, so each rank sums ``|g|^p`` (max for ``p = inf``)
over the elements it *owns* and the sums are all-reduced over every mesh axis:

- a parameter split over an axis (``S(dim)``): every coordinate owns its piece; replicated over an
  axis (``R``: data-parallel copies, tensor-parallel copies of a norm's weight): coordinate 0 owns it;
- a parameter held by several pipeline ranks (a tied embedding): the first of them owns it;
- ZeRO-2/MiCS (``ZeroOptimizer``): the reduced gradient lives in each group's flat slice, distinct over
  the ZeRO axes, copied over MiCS's replica axes (coordinate 0 owns it); each element inherits the
  ownership of its parameter on the other axes. ZeRO-3 slices the same way.

Then every gradient (owned or a copy) is scaled by the one coefficient, so replicas stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from autopar.errors import OptimizerError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import Program, Shard, Value
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.watch import guarded
from autopar.runtime.grads.zero import ZeroOptimizer, local_slice


def owned(
    v: Value, names: Sequence[str], coords: Mapping[str, int], apart: Sequence[str] = (), holders: Sequence[int] = ()
) -> bool:
    """Whether this rank owns its piece of parameter ``v``'s gradient (placements over the mesh axes
    ``names``) on every axis but ``apart`` (axes whose pieces differ whatever the placement: ZeRO's)
    and the pipeline axis (``holders``: the pipeline ranks holding a tied parameter, the first owns it)."""
    for p, a in zip(v.type.placements, names):
        if a == PIPELINE_AXIS or a in apart:
            continue
        if not isinstance(p, Shard) and coords.get(a, 0) != 0:
            return False
    return not holders or coords.get(PIPELINE_AXIS, 0) == holders[0]


def grad_pieces(
    params: Mapping[str, torch.nn.Parameter],
    program: Program,
    comm: Comm,
    optimizer,
    zero3,
    tied: Mapping[str, tuple[int, ...]],
) -> list[tuple[torch.Tensor, torch.Tensor | bool]]:
    """Every gradient this rank holds, with which of its elements this rank owns (a bool for all of
    them, or a mask). ZeRO-2's gradients are reduced into their slices first."""
    coords, values, axes = comm.coords, {v.name: v for v in program.inputs}, program.mesh.names
    out: list[tuple[torch.Tensor, torch.Tensor | bool]] = []
    managed: set[str] = set()
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.reduce_gradients()
        apart = optimizer.zero_axes + optimizer.replica_axes
        first_replica = all(coords[a] == 0 for a in optimizer.replica_axes)
        for f in optimizer.flats:
            if not f.params or f.master.grad is None:
                continue
            names = f.names
            managed |= set(names)
            mask = torch.zeros(f.padded, dtype=torch.bool, device=f.master.device)
            at = 0
            for n, p in zip(names, f.params):
                mask[at : at + p.numel()] = owned(values[n], axes, coords, apart, tied.get(n, ()))
                at += p.numel()
            out.append((f.master.grad, local_slice(mask, comm, optimizer.zero_axes) & first_replica))
    for n, p in params.items():
        if n in managed or p.grad is None:
            continue
        if zero3 is not None and zero3.manages(n):
            first = all(coords[a] == 0 for a in zero3.replica_axes)
            mine = first and owned(values[n], axes, coords, zero3.zero_axes + zero3.replica_axes, tied.get(n, ()))
        else:
            mine = owned(values[n], axes, coords, (), tied.get(n, ()))
        out.append((p.grad, mine))
    return out


@torch.no_grad()
def global_norm(
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor | bool]], norm_type: float, comm: Comm
) -> torch.Tensor:
    """The global ``norm_type``-norm of the gradients of ``pieces`` (from ``grad_pieces`` on every rank), in the
    gradients' dtype, the same on every rank; nothing is scaled. A collective over every mesh axis."""
    p = float(norm_type)
    if not (p > 0):
        raise OptimizerError(f"norm_type must be positive or inf, not {norm_type}")
    device = pieces[0][0].device if pieces else torch.device("cpu")
    dtype = pieces[0][0].dtype if pieces else torch.float32
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for g, mine in pieces:
        if mine is False:
            continue
        x = g.detach().abs().double()
        if isinstance(mine, torch.Tensor):
            x = x.reshape(-1)[mine]
        if x.numel() == 0:
            continue
        acc = torch.maximum(acc, x.max()) if math.isinf(p) else acc + x.pow(p).sum()
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for a, group in comm.groups.items():
        if comm.sizes[a] > 1:
            guarded(group, a, "all_reduce (gradient norm)", dist.all_reduce, acc, op=op, group=group)
    total = acc if math.isinf(p) else acc.pow(1.0 / p)
    return total.to(dtype)


def clip_grad_norm_(
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor | bool]],
    max_norm: float,
    norm_type: float,
    comm: Comm,
) -> torch.Tensor:
    """Scale every gradient of ``pieces`` (from ``grad_pieces`` on every rank) so that their global
    ``norm_type``-norm is at most ``max_norm``; returns that norm (before scaling) in the gradients'
    dtype, the same on every rank. A collective over every mesh axis."""
    total = global_norm(pieces, norm_type, comm)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in pieces:
        g.mul_(coef.to(g.dtype))
    return total


__all__ = ["clip_grad_norm_", "global_norm", "grad_pieces", "owned"]
