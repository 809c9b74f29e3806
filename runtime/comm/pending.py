"""Collectives in flight: ``Pending``, and each collective's forward and backward communication started.

Every collective that communicates is built from a ``Pending`` (``wait`` returns its result), so the
same code runs it synchronously (``start(...).wait()``, the autograd functions of
``runtime/comm/collectives.py``) or split in two, as sub-pipelined tensor parallelism does
(``collectives.ASYNC``, ``runtime/execute/subpipeline.py``). The gradient buckets' all-reduce is one too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autopar.runtime.comm import watch
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.shards import shard_tensor, unshard_tensor


class Pending:
    """A collective in flight: ``wait()`` waits for it once and returns its result (``finish`` turns
    the received buffers into the result)."""

    def __init__(self, work, finish: Callable[[], torch.Tensor], group=None, axis: str | None = None, op: str = ""):
        self.work, self.finish = work, finish
        # what a failed wait names (runtime/comm/watch.py): the group, its axis, the op, its number on the group
        self.where = (group, axis, op, watch.started(group)) if group is not None else None

    def wait(self) -> torch.Tensor:
        self.wait_only()
        return self.finish()

    def wait_only(self) -> None:
        """Wait for the collective (once) without turning its buffers into the result."""
        if self.work is not None:
            with record_function("autopar::wait"):  # the profiler's "waiting" (bench/profile_step.py)
                try:
                    if self.where is not None:  # after a first slice, a member's published failure ends it
                        watch.wait_collective(self.work, *self.where)
                    else:
                        self.work.wait()
                except RuntimeError as e:
                    err = watch.failure(e, *self.where) if self.where is not None else e
                    if err is e:
                        raise
                    raise err from e
            self.work = None


def start_gather(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int, then=None) -> Pending:
    parts = [torch.empty_like(x) for _ in range(c.sizes[axis])]
    work = dist.all_gather(parts, x.contiguous(), group=c.groups[axis], async_op=True)
    if then is None:
        return Pending(work, lambda: unshard_tensor(parts, dim, chunks), c.groups[axis], axis, "all_gather")
    return Pending(work, lambda: then(unshard_tensor(parts, dim, chunks)), c.groups[axis], axis, "all_gather")


def start_reduce(c: Comm, x: torch.Tensor, axis: str, op: str, then=None) -> Pending:
    y = x.contiguous().clone()
    work = dist.all_reduce(y, op=dist.ReduceOp.SUM, group=c.groups[axis], async_op=True)
    n = c.sizes[axis]

    def finish() -> torch.Tensor:
        z = y / n if op == "avg" else y
        return then(z) if then is not None else z

    return Pending(work, finish, c.groups[axis], axis, "all_reduce")


def gather(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int) -> torch.Tensor:
    return start_gather(c, x, axis, dim, chunks).wait()


def own_shard(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int) -> torch.Tensor:
    """This rank's shard of x in a storage of its own: a view (a dim-0 slice is contiguous) would keep the
    whole tensor alive for as long as the shard lives (a gradient kept as ``.grad``, an activation saved
    for backward), n times the shard's bytes."""
    y = shard_tensor(x, dim, chunks, c.sizes[axis], c.coords[axis])
    if y.is_contiguous() and y.untyped_storage().nbytes() == y.nbytes:
        return y
    return y.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# Each collective's forward and backward communication, started (the autograd functions of
# runtime/comm/collectives.py and the sub-pipelined interpreter both use these)


def fwd_all_reduce(c: Comm, x, axis, op="sum") -> Pending:
    return start_reduce(c, x, axis, op)


def fwd_all_gather(c: Comm, x, axis, dim, chunks=1, reduce_grad=False) -> Pending:
    return start_gather(c, x, axis, dim, chunks)


def bwd_gather_reduce_grad(c: Comm, g, axis, dim, chunks=1) -> Pending:
    """This rank's shard (``Shard(dim, chunks)``) of the sum over ``axis`` of every rank's ``g``: one
    reduce-scatter (``reduce_scatter_single``, on gloo too), the shard dim moved first for its layout; an interleaved
    shard is all-reduced and sliced."""
    if chunks != 1:
        return start_reduce(c, g, axis, "sum", then=lambda y: own_shard(c, y, axis, dim, chunks))
    send = g.movedim(dim, 0).contiguous()
    out = torch.empty((send.shape[0] // c.sizes[axis], *send.shape[1:]), dtype=send.dtype, device=send.device)
    work = dist.reduce_scatter_single(out, send, group=c.groups[axis], async_op=True)
    return Pending(work, lambda: out.movedim(0, dim), c.groups[axis], axis, "reduce_scatter")


def fwd_reduce_scatter(c: Comm, x, axis, op, dim, chunks=1) -> Pending:
    # gloo has no reduce_scatter: all-reduce and keep the local shard (same result)
    return start_reduce(c, x, axis, op, then=lambda y: own_shard(c, y, axis, dim, chunks))


def start_all_to_all(c: Comm, x: torch.Tensor, axis: str, src_dim: int, dim: int) -> Pending:
    """``x``, split on ``src_dim`` over ``axis``, resplit on ``dim`` by one all-to-all: piece j of ``dim`` goes to
    member j, the pieces received (each member's block of ``src_dim``) are joined along ``src_dim``."""
    n = c.sizes[axis]
    send = torch.stack([p.contiguous() for p in x.tensor_split(n, dim)])
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=c.groups[axis], async_op=True)
    return Pending(work, lambda: torch.cat(recv.unbind(0), src_dim), c.groups[axis], axis, "all_to_all")


def fwd_all_to_all(c: Comm, x, axis, src_dim, src_chunks, dim, chunks) -> Pending:
    if src_chunks == 1 and chunks == 1:
        return start_all_to_all(c, x, axis, src_dim, dim)
    return start_gather(c, x, axis, src_dim, src_chunks, then=lambda y: own_shard(c, y, axis, dim, chunks))


def bwd_grad_all_reduce(c: Comm, g, axis) -> Pending:
    return start_reduce(c, g, axis, "sum")


def bwd_local_shard(c: Comm, g, axis, dim, chunks=1) -> Pending:
    return start_gather(c, g, axis, dim, chunks)


def bwd_reduce_scatter(c: Comm, g, axis, op, dim, chunks=1) -> Pending:
    scale = 1.0 / c.sizes[axis] if op == "avg" else 1.0
    return start_gather(c, g, axis, dim, chunks, then=(lambda y: y * scale) if scale != 1.0 else None)


def bwd_all_to_all(c: Comm, g, axis, src_dim, src_chunks, dim, chunks) -> Pending:
    if src_chunks == 1 and chunks == 1:
        return start_all_to_all(c, g, axis, dim, src_dim)
    return start_gather(c, g, axis, dim, chunks, then=lambda y: own_shard(c, y, axis, src_dim, src_chunks))


def start_grad_bucket(params: list[torch.nn.Parameter], group, flat: torch.Tensor) -> Pending:
    """Start the all-reduce (sum) of ``params``' gradients in ``flat``, the bucket's buffer (kept from
    step to step, ``solver/sharding/buckets.py``; in mixed precision's ``reduce_dtype``): each gradient is copied
    into its slice unless it already is that slice, a missing one counts as zeros. ``wait()`` makes each
    gradient its slice of the sums (DDP's ``gradient_as_bucket_view``: no copy back; a copy where the
    dtypes differ) and returns ``flat``."""
    slices = [chunk.view_as(p) for p, chunk in zip(params, flat.split([p.numel() for p in params]))]
    for p, s in zip(params, slices):
        if p.grad is None:
            s.zero_()
        elif p.grad.data_ptr() != s.data_ptr():  # not already its slice
            s.copy_(p.grad)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish() -> torch.Tensor:
        for p, s in zip(params, slices):
            if s.dtype == p.dtype:
                p.grad = s
            elif p.grad is None:
                p.grad = s.to(p.dtype)
            else:
                p.grad.copy_(s)
        return flat

    return Pending(work, finish, group, None, "gradient all_reduce")
