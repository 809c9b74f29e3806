"""Autograd-aware collectives over named mesh axes (Megatron's f and g, DTensor's redistributions).

Convention (Megatron's): a replicated tensor's gradient is whole and equal on every rank of the
axis; a sharded tensor's gradient is the matching shard; a partial tensor's gradient is whole.
Each op's backward keeps that convention:

    all_reduce       P -> R   fwd: sum (avg)          bwd: identity (1/n for avg)       Megatron g
    grad_all_reduce  R -> R   fwd: identity           bwd: all-reduce sum               Megatron f
    all_gather       S -> R   fwd: gather             bwd: keep the local shard
                                                      (reduce_grad: reduce-scatter, the gather's adjoint)
    local_shard      R -> S   fwd: keep local shard   bwd: gather
    reduce_scatter   P -> S   fwd: reduce, shard      bwd: gather
    all_to_all       S -> S'  fwd: gather, reshard    bwd: the reverse

The generated per-rank GraphModules call these functions (``FUNCTIONS``); the process groups come
from the ``Comm`` installed with ``use_comm`` (``runtime/comm/context.py``; one per compiled module, set
around its forward).

Each op's communication is started as a ``Pending`` (``runtime/comm/pending.py``), so the same code runs
it synchronously here or split in two, as sub-pipelined tensor parallelism does (``ASYNC``,
``runtime/execute/subpipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.runtime.comm import pending as inflight  # by module: tests replace its functions
from autopar.runtime.comm.context import current_comm
from autopar.runtime.comm.lazy import Deferred


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, op, pending=None, defer=False):
        c = current_comm()
        ctx.scale = 1.0 / c.sizes[axis] if op == "avg" else 1.0
        work = pending or inflight.fwd_all_reduce(c, x, axis, op)
        return Deferred(x, work.wait) if defer else work.wait()

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.scale if ctx.scale != 1.0 else g), None, None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.comm, ctx.axis = current_comm(), axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return inflight.bwd_grad_all_reduce(ctx.comm, g, ctx.axis).wait(), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, chunks, pending=None, reduce_grad=False):
        ctx.comm, ctx.args, ctx.reduce_grad = current_comm(), (axis, dim, chunks), reduce_grad
        return (pending or inflight.fwd_all_gather(ctx.comm, x, axis, dim, chunks)).wait()

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:  # each rank's gradient of the whole is a partial sum: its shard of their sum
            return inflight.bwd_gather_reduce_grad(ctx.comm, g, *ctx.args).wait(), None, None, None, None, None
        return inflight.own_shard(ctx.comm, g, *ctx.args), None, None, None, None, None


class _LocalShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, chunks):
        ctx.comm, ctx.args = current_comm(), (axis, dim, chunks)
        return inflight.own_shard(ctx.comm, x, axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        return inflight.bwd_local_shard(ctx.comm, g, *ctx.args).wait(), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, op, dim, chunks, pending=None):
        c = ctx.comm = current_comm()
        ctx.args = (axis, op, dim, chunks)
        return (pending or inflight.fwd_reduce_scatter(c, x, axis, op, dim, chunks)).wait()

    @staticmethod
    def backward(ctx, g):
        return inflight.bwd_reduce_scatter(ctx.comm, g, *ctx.args).wait(), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, src_dim, src_chunks, dim, chunks, pending=None):
        c = ctx.comm = current_comm()
        ctx.args = (axis, src_dim, src_chunks, dim, chunks)
        return (pending or inflight.fwd_all_to_all(c, x, *ctx.args)).wait()

    @staticmethod
    def backward(ctx, g):
        return (inflight.bwd_all_to_all(ctx.comm, g, *ctx.args).wait(), None, None, None, None, None, None)


def all_reduce(
    x: torch.Tensor, axis: str, op: str = "sum", pending: inflight.Pending | None = None, defer: bool = False
) -> torch.Tensor:
    """The sum (or average) over ``axis``; ``defer``: returned in flight, waited for at its first read
    (``runtime/comm/lazy.py``: a returned loss, which a backward does not read)."""
    return _AllReduce.apply(x, axis, op, pending, defer)


def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, axis)


def all_gather(
    x: torch.Tensor,
    axis: str,
    dim: int,
    chunks: int = 1,
    pending: inflight.Pending | None = None,
    reduce_grad: bool = False,
) -> torch.Tensor:
    """The whole of ``x`` from every rank's shard of ``dim``. Backward each rank keeps its shard of the
    gradient, whole and equal on every rank by the convention; with ``reduce_grad`` (a gather whose readers'
    gradients differ by rank: context parallelism's keys and values, ``passes/collectives.py``) the ranks'
    partial gradients are reduce-scattered, the gather's adjoint, in place of Megatron's f's all-reduce and
    the slice."""
    return _AllGather.apply(x, axis, dim, chunks, pending, reduce_grad)


def local_shard(x: torch.Tensor, axis: str, dim: int, chunks: int = 1) -> torch.Tensor:
    return _LocalShard.apply(x, axis, dim, chunks)


def reduce_scatter(
    x: torch.Tensor, axis: str, op: str, dim: int, chunks: int = 1, pending: inflight.Pending | None = None
) -> torch.Tensor:
    return _ReduceScatter.apply(x, axis, op, dim, chunks, pending)


def all_to_all(
    x: torch.Tensor,
    axis: str,
    src_dim: int,
    src_chunks: int,
    dim: int,
    chunks: int,
    pending: inflight.Pending | None = None,
) -> torch.Tensor:
    return _AllToAll.apply(x, axis, src_dim, src_chunks, dim, chunks, pending)


@dataclass(frozen=True)
class AsyncForm:
    """A collective split in two for sub-pipelined tensor parallelism (``runtime/execute/subpipeline.py``).

    ``forward(comm, x, **kwargs)`` starts the forward communication and ``op(x, **kwargs,
    pending=...)`` lands it with the op's autograd backward (``None``: the forward does not
    communicate); ``backward(comm, g, **kwargs)`` starts the communication of the gradient of the
    input from that of the output (``None``: the backward is local)."""

    forward: Callable[..., inflight.Pending] | None
    backward: Callable[..., inflight.Pending] | None


ASYNC: dict[Callable, AsyncForm] = {
    all_reduce: AsyncForm(inflight.fwd_all_reduce, None),  # Megatron g: backward identity
    all_gather: AsyncForm(inflight.fwd_all_gather, None),  # backward keeps the local shard
    reduce_scatter: AsyncForm(inflight.fwd_reduce_scatter, inflight.bwd_reduce_scatter),
    all_to_all: AsyncForm(inflight.fwd_all_to_all, inflight.bwd_all_to_all),
    grad_all_reduce: AsyncForm(None, inflight.bwd_grad_all_reduce),  # Megatron f: forward identity
    local_shard: AsyncForm(None, inflight.bwd_local_shard),
}


FUNCTIONS = {
    "all_reduce": all_reduce,
    "grad_all_reduce": grad_all_reduce,
    "all_gather": all_gather,
    "local_shard": local_shard,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
}
