"""Expert parallelism's token dispatch and combine: dropless all-to-alls with split sizes from the router.

The generated code calls ``expert_dispatch`` and ``expert_combine`` (``passes/experts.py`` writes them into
the program) with the rows to move and the router's expert index of each row, ``idx``, as this rank holds
them. Rank r of an expert axis of n ranks holds experts ``[r E/n, (r+1) E/n)``; a row goes to the rank of
its expert. As in torchtitan's and Megatron-Core's token dispatchers:

1. the rows are ordered by destination (a stable sort, so each destination gets them in order) and counted;
2. the counts are exchanged first (an ``all_to_all_single`` of n integers), so every rank knows how many
   rows it receives from each, and the split sizes of the data's ``all_to_all_single`` follow: no row is
   dropped and no rank pads to a capacity;
3. ``expert_combine`` sends each row back with the two split lists swapped and puts it at its place.

The routing (order, send and receive counts) is computed once per index tensor and forward: the dispatches
and the combine of one routing share it (``_ROUTES``). Autograd: the backward of a dispatch is the combine of
the gradient and the backward of a combine is the dispatch (an all-to-all's adjoint is the inverse
all-to-all), each reusing the forward's routing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.comm.context import Comm, current_comm


@dataclass(frozen=True)
class Routing:
    """Where this rank's rows go on one expert axis: ``order`` sorts them by destination rank, ``send[j]`` of
    them go to rank j, ``recv[j]`` rows come from rank j; ``first``: this rank's first expert."""

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    first: int


# id(idx tensor) -> (a weak reference to it, {(axis, experts): Routing}); an entry leaves with its tensor
# (a tensor compares elementwise, so it cannot key a WeakKeyDictionary)
_ROUTES: dict[int, tuple[weakref.ref, dict[tuple[str, int], Routing]]] = {}
_LOCK = threading.Lock()  # the rank simulator's ranks are threads of one process


def _forget(key: int) -> None:
    with _LOCK:
        _ROUTES.pop(key, None)


def routing(c: Comm, idx: torch.Tensor, axis: str, experts: int) -> Routing:
    """The routing of ``idx`` on ``axis`` (computed, and its counts exchanged, once per index tensor)."""
    with _LOCK:
        entry = _ROUTES.get(id(idx))
        known = entry[1].get((axis, experts)) if entry is not None and entry[0]() is idx else None
    if known is not None:
        return known
    n, me = c.sizes[axis], c.coords[axis]
    per = experts // n
    dest = torch.div(idx.reshape(-1), per, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=c.groups[axis])  # the counts first: the data's split sizes
    route = Routing(order, send.tolist(), recv.tolist(), me * per)
    with _LOCK:
        key = id(idx)
        entry = _ROUTES.get(key)
        if entry is None or entry[0]() is not idx:
            entry = _ROUTES[key] = (weakref.ref(idx, lambda _: _forget(key)), {})
        entry[1][(axis, experts)] = route
    return route


def _send(c: Comm, x: torch.Tensor, axis: str, out_rows: int, out_splits: list[int], in_splits: list[int]):
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=c.groups[axis])
    return out


def _forward(c: Comm, x: torch.Tensor, route: Routing, axis: str) -> torch.Tensor:
    """This rank's rows to their experts' ranks: the received rows, grouped by source rank."""
    return _send(c, x[route.order], axis, sum(route.recv), route.recv, route.send)


def _back(c: Comm, y: torch.Tensor, route: Routing, axis: str) -> torch.Tensor:
    """Received rows back to the ranks they came from, each at its place there."""
    back = _send(c, y, axis, sum(route.send), route.send, route.recv)
    out = torch.empty_like(back)
    out[route.order] = back
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx, axis, experts, local_ids):
        c = ctx.comm = current_comm()
        route = ctx.route = routing(c, idx, axis, experts)
        ctx.axis = axis
        y = _forward(c, x, route, axis)
        return y - route.first if local_ids else y

    @staticmethod
    def backward(ctx, g):
        return _back(ctx.comm, g, ctx.route, ctx.axis), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, idx, axis, experts):
        c = ctx.comm = current_comm()
        route = ctx.route = routing(c, idx, axis, experts)
        ctx.axis = axis
        return _back(c, y, route, axis)

    @staticmethod
    def backward(ctx, g):
        return _forward(ctx.comm, g, ctx.route, ctx.axis), None, None, None


def expert_dispatch(
    x: torch.Tensor, idx: torch.Tensor, axis: str, experts: int, local_ids: bool = False
) -> torch.Tensor:
    """The rows of ``x`` (dim 0, one per entry of ``idx``) sent to the ranks of ``axis`` owning their experts
    (``idx``: each row's expert among ``experts``); ``local_ids``: ``x`` is ``idx`` itself, returned as
    each row's expert numbered among the receiving rank's own."""
    if current_comm().sizes[axis] == 1:
        return x
    if not x.is_floating_point():
        with torch.no_grad():
            return _Dispatch.forward(_NoCtx(), x, idx, axis, experts, local_ids)
    return _Dispatch.apply(x, idx, axis, experts, local_ids)


def expert_combine(y: torch.Tensor, idx: torch.Tensor, axis: str, experts: int) -> torch.Tensor:
    """Rows dispatched by ``expert_dispatch`` of ``idx`` (as this rank holds ``idx``) back in their rank's
    order."""
    if current_comm().sizes[axis] == 1:
        return y
    if not y.is_floating_point():
        with torch.no_grad():
            return _Combine.forward(_NoCtx(), y, idx, axis, experts)
    return _Combine.apply(y, idx, axis, experts)


class _AllToAll(torch.autograd.Function):
    """Rows sent by ``all_to_all_single`` with given split sizes; the backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, c, axis, out_splits, in_splits):
        ctx.c, ctx.axis, ctx.splits = c, axis, (out_splits, in_splits)
        return _send(c, x, axis, sum(out_splits), out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _send(ctx.c, g, ctx.axis, sum(in_splits), in_splits, out_splits), None, None, None, None


@dataclass(frozen=True)
class GroupedRouting:
    """Where the rows of this rank's block of a grouped matmul's sorted rows go on one expert axis: ``send[j]``
    of them (the first ``sent``, in order) to rank j, ``recv[j]`` from rank j; ``offs``: the local experts'
    cumulative row ends over what arrived; ``size``: the block's rows; ``keep``: under a capacity, the block's
    rows that are sent, in order (None: the first ``sent``, every row of a group).

    What arrives is sorted by expert as it comes: the sources are the axis's ranks in order, whose blocks are
    in the sorted rows' order (the axis is one digit of the block index), each sending its rows of this
    rank's experts sorted, and the rows of one expert precede the next one's over all the blocks."""

    send: list[int]
    recv: list[int]
    offs: torch.Tensor
    sent: int
    size: int
    keep: torch.Tensor | None = None


def kept_rows(offs: torch.Tensor, lo: int, size: int, capacity: int) -> torch.Tensor:
    """Which of the rows ``[lo, lo + size)`` of rows sorted by expert (groups ending at ``offs``) an expert of
    ``capacity`` keeps (a bool per row): each group's first ``capacity`` rows, in their sorted order; a row
    after the last group is no expert's."""
    ends = offs.to(torch.int64)
    pos = torch.arange(lo, lo + size, device=ends.device)
    group = torch.searchsorted(ends, pos, right=True)
    inside = group < ends.numel()
    starts = torch.cat([ends.new_zeros(1), ends])[group.clamp_max(ends.numel() - 1)]
    return inside & (pos - starts < capacity)


def capacity_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    kernel: Callable,
    rows: tuple[str, ...],
    capacity: int,
    **kwargs,
) -> torch.Tensor:
    """``kernel(x, w, offs)`` with each expert keeping its first ``capacity`` rows (``kept_rows``): the rows
    over capacity are dropped, their results zero (and so their gradients). ``x``: this rank's block of the
    sorted rows over the mesh axes ``rows`` (none: all of them), ``offs`` whole."""
    if offs is None:
        offs = kwargs.pop("offs")
    size, lo = x.shape[0], 0
    if rows:
        c = current_comm()
        block = 0
        for a in rows:
            block = block * c.sizes[a] + c.coords[a]
        lo = block * size
    local = (offs.to(torch.int64) - lo).clamp(0, size).to(offs.dtype)
    keep = kept_rows(offs, lo, size, capacity).unsqueeze(1)
    return kernel(x, w, local, **kwargs) * keep


# id(offs tensor) -> (a weak reference to it, {(axis, experts, rows, size, coords): GroupedRouting}); the dispatch, the
# grouped matmuls and the combine of one expert block read one offsets tensor and share its routing
_GROUPED: dict[int, tuple[weakref.ref, dict[tuple, GroupedRouting]]] = {}


def _forget_grouped(key: int) -> None:
    with _LOCK:
        _GROUPED.pop(key, None)


def grouped_routing(
    offs: torch.Tensor, axis: str, experts: int, rows: tuple[str, ...], size: int, capacity: int | None = None
) -> GroupedRouting:
    """The routing of this rank's block (``size`` rows; its block over the mesh axes ``rows``, outer first,
    ``axis`` among them) of rows sorted by expert whose groups end at ``offs`` (cumulative, over all the rows,
    whole on every rank): every rank reads from ``offs`` how many rows of each block belong to each group, so
    the split sizes need no exchange. Rank r of ``axis`` (n ranks) holds experts ``[r E/n, (r+1) E/n)``.
    ``capacity``: each expert takes its group's first ``capacity`` rows only (``kept_rows``), the others are
    not sent and their results are zero; None: dropless."""
    c = current_comm()
    key = (
        axis,
        experts,
        tuple(rows),
        size,
        capacity,
        tuple(c.coords.items()),
    )  # the rank's own (a simulated rank: a thread)
    with _LOCK:
        entry = _GROUPED.get(id(offs))
        known = entry[1].get(key) if entry is not None and entry[0]() is offs else None
    if known is not None:
        return known
    n, me = c.sizes[axis], c.coords[axis]
    per = experts // n
    blocks = []
    for i in range(n):  # the block index of each rank of the axis (this rank's other coordinates kept)
        b = 0
        for a in rows:
            b = b * c.sizes[a] + (i if a == axis else c.coords[a])
        blocks.append(b)
    with torch.no_grad():
        ends = offs.to(torch.int64)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        kept = ends if capacity is None else torch.minimum(ends, starts + capacity)  # each group's kept rows' end
        lo = torch.tensor(blocks, dtype=torch.int64, device=ends.device).unsqueeze(1) * size
        count = (torch.minimum(kept, lo + size) - torch.maximum(starts, lo)).clamp_min(0)  # [rank's block, group]
        by_rank = count.view(n, n, per).cpu()  # [source block, destination rank, its expert]
        send = by_rank[me].sum(1).tolist()
        mine = by_rank[:, me]  # [source, my expert]: the rows I receive, source by source, each by expert
        recv = mine.sum(1).tolist()
        local_offs = torch.cumsum(mine.sum(0), 0).to(device=offs.device, dtype=offs.dtype)
        keep = None
        if capacity is not None:
            keep = torch.nonzero(kept_rows(offs, blocks[me] * size, size, capacity)).reshape(-1)
    route = GroupedRouting(send, recv, local_offs, sum(send), size, keep)
    with _LOCK:
        k = id(offs)
        entry = _GROUPED.get(k)
        if entry is None or entry[0]() is not offs:
            entry = _GROUPED[k] = (weakref.ref(offs, lambda _: _forget_grouped(k)), {})
        entry[1][key] = route
    return route


def _grouped_dispatch(x: torch.Tensor, route: GroupedRouting, axis: str) -> torch.Tensor:
    rows = x[: route.sent] if route.keep is None else x[route.keep]
    return _AllToAll.apply(rows, current_comm(), axis, route.recv, route.send)


def _grouped_combine(y: torch.Tensor, route: GroupedRouting, axis: str) -> torch.Tensor:
    out = _AllToAll.apply(y, current_comm(), axis, route.send, route.recv)
    if route.keep is not None:  # the rows over capacity: dropped, zero
        return out.new_zeros((route.size, *out.shape[1:])).index_copy(0, route.keep, out)
    if route.sent < route.size:  # rows after the last group: no expert's, zero as the kernel leaves them
        out = torch.cat([out, out.new_zeros((route.size - route.sent, *out.shape[1:]))])
    return out


def expert_grouped_dispatch(
    x: torch.Tensor, offs: torch.Tensor, *, axis: str, experts: int, rows: tuple[str, ...], capacity: int | None = None
) -> torch.Tensor:
    """This rank's block of rows sorted by expert (``x``; ``offs``: the groups' cumulative row ends over all the
    rows, whole) sent to the ranks of ``axis`` owning their experts (one ``all_to_all_single``, dropless,
    variable splits; ``grouped_routing``): the rows of this rank's experts from every block, sorted by expert.
    The backward sends the gradient back (the inverse all-to-all). ``capacity``: rows over an expert's are not
    sent (``grouped_routing``)."""
    return _grouped_dispatch(x, grouped_routing(offs, axis, experts, rows, x.shape[0], capacity), axis)


def expert_grouped_combine(
    y: torch.Tensor,
    offs: torch.Tensor,
    *,
    axis: str,
    experts: int,
    rows: tuple[str, ...],
    size: int,
    capacity: int | None = None,
) -> torch.Tensor:
    """Rows dispatched by ``expert_grouped_dispatch`` (of a block of ``size`` rows) back to their block, each at
    its place there (the split sizes swapped); rows after the last group, and those over capacity, zero."""
    return _grouped_combine(y, grouped_routing(offs, axis, experts, rows, size, capacity), axis)


def expert_local_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    kernel: Callable,
    axis: str,
    experts: int,
    rows: tuple[str, ...],
    size: int,
    capacity: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """``kernel(x, w, offs)`` on rows dispatched by ``expert_grouped_dispatch`` (of blocks of ``size`` rows):
    ``w`` this rank's ``experts / n`` experts of ``axis``, the offsets this rank's (``grouped_routing``)."""
    if offs is None:
        offs = kwargs.pop("offs")
    return kernel(x, w, grouped_routing(offs, axis, experts, rows, size, capacity).offs, **kwargs)


def expert_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    kernel: Callable,
    axis: str,
    experts: int,
    rows: tuple[str, ...],
    capacity: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """``kernel(x, w, offs)`` (a grouped matmul, rows sorted by expert) with ``w`` this rank's ``experts / n``
    experts of ``axis`` and ``x`` this rank's block of the sorted rows (its block over the mesh axes ``rows``,
    outer first, ``axis`` among them); ``offs``: the groups' cumulative row ends over all the rows, whole.

    One grouped matmul alone: its rows dispatched to their experts' ranks, the kernel run there on the rank's
    experts, the results sent back (``expert_grouped_dispatch``, ``expert_local_grouped_mm``,
    ``expert_grouped_combine``). ``passes/experts.py`` writes an expert block's two grouped matmuls with one
    dispatch and one combine around both instead; this is the form of a program that has not been through it."""
    if offs is None:
        offs = kwargs.pop("offs")
    route = grouped_routing(offs, axis, experts, rows, x.shape[0], capacity)
    y = kernel(_grouped_dispatch(x, route, axis), w, route.offs, **kwargs)
    return _grouped_combine(y, route, axis)


class _NoCtx:
    """The ctx of an integer tensor's dispatch, which has no backward."""


FUNCTIONS = {
    "expert_dispatch": expert_dispatch,
    "expert_combine": expert_combine,
    "expert_grouped_dispatch": expert_grouped_dispatch,
    "expert_grouped_combine": expert_grouped_combine,
}

__all__ = [
    "FUNCTIONS",
    "GroupedRouting",
    "capacity_grouped_mm",
    "kept_rows",
    "Routing",
    "expert_combine",
    "expert_dispatch",
    "expert_grouped_combine",
    "expert_grouped_dispatch",
    "expert_grouped_mm",
    "expert_local_grouped_mm",
    "grouped_routing",
    "routing",
]
