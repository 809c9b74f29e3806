"""Autograd-aware collectives over named mesh axes (Megatron's f and g, DTensor's redistributions).

Convention (Megatron's): a replicated tensor's gradient is whole and equal on every rank of the
axis; a sharded tensor's gradient is the matching shard; a partial tensor's gradient is whole.
Each op's backward keeps that convention:

    all_reduce       P -> R   fwd: sum (avg)          bwd: identity (1/n for avg)       Megatron g
    grad_all_reduce  R -> R   fwd: identity           bwd: all-reduce sum               Megatron f
    all_gather       S -> R   fwd: gather             bwd: keep the local shard
    local_shard      R -> S   fwd: keep local shard   bwd: gather
    reduce_scatter   P -> S   fwd: reduce, shard      bwd: gather
    all_to_all       S -> S'  fwd: gather, reshard    bwd: the reverse

The generated per-rank GraphModules call these functions; the process groups come from the
``Comm`` installed with ``use_comm`` (one per compiled module, set around its forward).

Every collective that communicates is built from a ``Pending`` (the collective in flight; ``wait``
returns its result), so the same code runs it synchronously (``start(...).wait()``) or split in two,
as sub-pipelined tensor parallelism does (``ASYNC``, ``runtime/subpipeline.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autopar.errors import CaptureError
from autopar.ir.core import Shard
from autopar.runtime.lazy import Deferred


class TorchPeers:
    """How a pipeline reaches its peers on torch.distributed: global ranks, point-to-point batches on the
    default group (as NCCL and gloo pair ranks), groups from ``new_group``. The rank simulator
    (``runtime/ranksim.py``) gives its ranks its own ``SimPeers`` with the same methods."""

    @staticmethod
    def global_rank(group, member: int) -> int:
        """The global rank of ``group``'s member ``member``."""
        return dist.get_global_rank(group, member)

    @staticmethod
    def posts_independently() -> bool:
        """Whether each send and receive is its own op, so a receive may be posted before the list says:
        gloo's are; NCCL's batch is one group call on a stream that an early receive would hold up."""
        return dist.is_initialized() and dist.get_backend() == "gloo"

    @staticmethod
    def batch_isend_irecv(ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """Post ``(is a send, tensor, peer's global rank)``. NCCL needs them as one
        ``torch.distributed.batch_isend_irecv`` (one group call, so paired ops cannot deadlock); gloo runs
        a batch op by op anyway, so there each is issued directly, without the coalescing manager's fixed
        cost per batch on every action's path."""
        if TorchPeers.posts_independently():
            return [(dist.isend if s else dist.irecv)(t, peer) for s, t, peer in ops]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, t, peer) for s, t, peer in ops])

    @staticmethod
    def new_group(ranks: list[int]):
        """A process group of ``ranks`` (global); every rank calls it for every group, in the same order."""
        return dist.new_group(ranks)


@dataclass
class Comm:
    """For each mesh axis name: its process group, this rank's coordinate and the axis size; ``peers``:
    point-to-point and new groups (torch.distributed's, or the rank simulator's)."""

    groups: dict[str, object]
    coords: dict[str, int]
    sizes: dict[str, int]
    peers: object = field(default_factory=TorchPeers)
    grad_dtype: torch.dtype | None = None  # gradient reductions' dtype (mixed precision's reduce_dtype)

    @classmethod
    def from_device_mesh(cls, mesh) -> Comm:
        names = mesh.mesh_dim_names
        coords = mesh.get_coordinate()
        return cls(
            groups={n: mesh.get_group(n) for n in names},
            coords=dict(zip(names, coords)),
            sizes={n: mesh.size(i) for i, n in enumerate(names)},
        )


# Per thread: the rank simulator (runtime/ranksim.py) runs every simulated rank in its own thread.
_LOCAL = threading.local()


def _stack() -> list[Comm]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def use_comm(comm: Comm):
    _stack().append(comm)
    try:
        yield comm
    finally:
        _stack().pop()


def current_comm() -> Comm:
    if not _stack():
        raise RuntimeError("autopar collectives called outside a compiled module's forward")
    return _stack()[-1]


# ---------------------------------------------------------------------------------------------
# Local shard arithmetic (also used to slice parameters and inputs)


def shard_tensor(x: torch.Tensor, dim: int, chunks: int, n: int, coord: int) -> torch.Tensor:
    """Rank ``coord``'s shard of x for Shard(dim, chunks) over n ranks."""
    if chunks == 1:
        return x.tensor_split(n, dim)[coord]
    return torch.cat([piece.tensor_split(n, dim)[coord] for piece in x.chunk(chunks, dim)], dim)


def local_inputs(values, flat: list, comm: Comm, names: tuple[str, ...], device, what: str = "shape") -> list:
    """This rank's shard of each tensor in ``flat`` (the flattened call inputs), for the program inputs
    ``values`` in order: checked against the compiled shape, moved to ``device``, sliced as each
    input's placements over the mesh axes ``names`` say."""

    out = []
    for v, x in zip(values, (x for x in flat if isinstance(x, torch.Tensor))):
        if tuple(x.shape) != v.type.shape:
            raise CaptureError(
                f"input {v.name} has {what} {list(x.shape)} but the model was compiled for "
                f"{list(v.type.shape)}; compile again for the new shape"
            )
        local = x.to(device)
        for p, name in zip(v.type.placements, names):
            if isinstance(p, Shard):
                local = shard_tensor(local, p.dim, p.chunks, comm.sizes[name], comm.coords[name])
        out.append(local.contiguous())
    return out


def unshard_tensor(shards: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """Inverse of shard_tensor given every rank's shard in coordinate order."""
    if chunks == 1:
        return torch.cat(shards, dim)
    pieces = [s.chunk(chunks, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim) for j in range(chunks)], dim)


class Pending:
    """A collective in flight: ``wait()`` waits for it once and returns its result (``finish`` turns
    the received buffers into the result)."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        self.wait_only()
        return self.finish()

    def wait_only(self) -> None:
        """Wait for the collective (once) without turning its buffers into the result."""
        if self.work is not None:
            with record_function("autopar::wait"):  # the profiler's "waiting" (bench/profile_step.py)
                self.work.wait()
            self.work = None


def _start_gather(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int, then=None) -> Pending:
    parts = [torch.empty_like(x) for _ in range(c.sizes[axis])]
    work = dist.all_gather(parts, x.contiguous(), group=c.groups[axis], async_op=True)
    if then is None:
        return Pending(work, lambda: unshard_tensor(parts, dim, chunks))
    return Pending(work, lambda: then(unshard_tensor(parts, dim, chunks)))


def _start_reduce(c: Comm, x: torch.Tensor, axis: str, op: str, then=None) -> Pending:
    y = x.contiguous().clone()
    work = dist.all_reduce(y, op=dist.ReduceOp.SUM, group=c.groups[axis], async_op=True)
    n = c.sizes[axis]

    def finish() -> torch.Tensor:
        z = y / n if op == "avg" else y
        return then(z) if then is not None else z

    return Pending(work, finish)


def _gather(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int) -> torch.Tensor:
    return _start_gather(c, x, axis, dim, chunks).wait()


def _local(c: Comm, x: torch.Tensor, axis: str, dim: int, chunks: int) -> torch.Tensor:
    """This rank's shard of x in a storage of its own: a view (a dim-0 slice is contiguous) would keep the
    whole tensor alive for as long as the shard lives (a gradient kept as ``.grad``, an activation saved
    for backward), n times the shard's bytes."""
    y = shard_tensor(x, dim, chunks, c.sizes[axis], c.coords[axis])
    if y.is_contiguous() and y.untyped_storage().nbytes() == y.nbytes:
        return y
    return y.clone(memory_format=torch.contiguous_format)


def _reduce(c: Comm, x: torch.Tensor, axis: str, op: str) -> torch.Tensor:
    return _start_reduce(c, x, axis, op).wait()


# ---------------------------------------------------------------------------------------------
# Each collective's forward and backward communication, started (the autograd functions below and
# the sub-pipelined interpreter both use these)


def _fwd_all_reduce(c: Comm, x, axis, op="sum") -> Pending:
    return _start_reduce(c, x, axis, op)


def _fwd_all_gather(c: Comm, x, axis, dim, chunks=1) -> Pending:
    return _start_gather(c, x, axis, dim, chunks)


def _fwd_reduce_scatter(c: Comm, x, axis, op, dim, chunks=1) -> Pending:
    # gloo has no reduce_scatter: all-reduce and keep the local shard (same result)
    return _start_reduce(c, x, axis, op, then=lambda y: _local(c, y, axis, dim, chunks))


def _fwd_all_to_all(c: Comm, x, axis, src_dim, src_chunks, dim, chunks) -> Pending:
    return _start_gather(c, x, axis, src_dim, src_chunks, then=lambda y: _local(c, y, axis, dim, chunks))


def _bwd_grad_all_reduce(c: Comm, g, axis) -> Pending:
    return _start_reduce(c, g, axis, "sum")


def _bwd_local_shard(c: Comm, g, axis, dim, chunks=1) -> Pending:
    return _start_gather(c, g, axis, dim, chunks)


def _bwd_reduce_scatter(c: Comm, g, axis, op, dim, chunks=1) -> Pending:
    scale = 1.0 / c.sizes[axis] if op == "avg" else 1.0
    return _start_gather(c, g, axis, dim, chunks, then=(lambda y: y * scale) if scale != 1.0 else None)


def _bwd_all_to_all(c: Comm, g, axis, src_dim, src_chunks, dim, chunks) -> Pending:
    return _start_gather(c, g, axis, dim, chunks, then=lambda y: _local(c, y, axis, src_dim, src_chunks))


# ---------------------------------------------------------------------------------------------
# Autograd functions


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, op, pending=None, defer=False):
        c = current_comm()
        ctx.scale = 1.0 / c.sizes[axis] if op == "avg" else 1.0
        work = pending or _fwd_all_reduce(c, x, axis, op)
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
        return _bwd_grad_all_reduce(ctx.comm, g, ctx.axis).wait(), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, chunks, pending=None):
        ctx.comm, ctx.args = current_comm(), (axis, dim, chunks)
        return (pending or _fwd_all_gather(ctx.comm, x, axis, dim, chunks)).wait()

    @staticmethod
    def backward(ctx, g):
        return _local(ctx.comm, g, *ctx.args), None, None, None, None


class _LocalShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, chunks):
        ctx.comm, ctx.args = current_comm(), (axis, dim, chunks)
        return _local(ctx.comm, x, axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        return _bwd_local_shard(ctx.comm, g, *ctx.args).wait(), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, op, dim, chunks, pending=None):
        c = ctx.comm = current_comm()
        ctx.args = (axis, op, dim, chunks)
        return (pending or _fwd_reduce_scatter(c, x, axis, op, dim, chunks)).wait()

    @staticmethod
    def backward(ctx, g):
        return _bwd_reduce_scatter(ctx.comm, g, *ctx.args).wait(), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, src_dim, src_chunks, dim, chunks, pending=None):
        c = ctx.comm = current_comm()
        ctx.args = (axis, src_dim, src_chunks, dim, chunks)
        return (pending or _fwd_all_to_all(c, x, *ctx.args)).wait()

    @staticmethod
    def backward(ctx, g):
        return (_bwd_all_to_all(ctx.comm, g, *ctx.args).wait(), None, None, None, None, None, None)


def all_reduce(
    x: torch.Tensor, axis: str, op: str = "sum", pending: Pending | None = None, defer: bool = False
) -> torch.Tensor:
    """The sum (or average) over ``axis``; ``defer``: returned in flight, waited for at its first read
    (``runtime/lazy.py``: a returned loss, which a backward does not read)."""
    return _AllReduce.apply(x, axis, op, pending, defer)


def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, axis)


def all_gather(x: torch.Tensor, axis: str, dim: int, chunks: int = 1, pending: Pending | None = None) -> torch.Tensor:
    return _AllGather.apply(x, axis, dim, chunks, pending)


def local_shard(x: torch.Tensor, axis: str, dim: int, chunks: int = 1) -> torch.Tensor:
    return _LocalShard.apply(x, axis, dim, chunks)


def reduce_scatter(
    x: torch.Tensor, axis: str, op: str, dim: int, chunks: int = 1, pending: Pending | None = None
) -> torch.Tensor:
    return _ReduceScatter.apply(x, axis, op, dim, chunks, pending)


def all_to_all(
    x: torch.Tensor,
    axis: str,
    src_dim: int,
    src_chunks: int,
    dim: int,
    chunks: int,
    pending: Pending | None = None,
) -> torch.Tensor:
    return _AllToAll.apply(x, axis, src_dim, src_chunks, dim, chunks, pending)


@dataclass(frozen=True)
class AsyncForm:
    """A collective split in two for sub-pipelined tensor parallelism (``runtime/subpipeline.py``).

    ``forward(comm, x, **kwargs)`` starts the forward communication and ``op(x, **kwargs,
    pending=...)`` lands it with the op's autograd backward (``None``: the forward does not
    communicate); ``backward(comm, g, **kwargs)`` starts the communication of the gradient of the
    input from that of the output (``None``: the backward is local)."""

    forward: Callable[..., Pending] | None
    backward: Callable[..., Pending] | None


ASYNC: dict[Callable, AsyncForm] = {
    all_reduce: AsyncForm(_fwd_all_reduce, None),  # Megatron g: backward identity
    all_gather: AsyncForm(_fwd_all_gather, None),  # backward keeps the local shard
    reduce_scatter: AsyncForm(_fwd_reduce_scatter, _bwd_reduce_scatter),
    all_to_all: AsyncForm(_fwd_all_to_all, _bwd_all_to_all),
    grad_all_reduce: AsyncForm(None, _bwd_grad_all_reduce),  # Megatron f: forward identity
    local_shard: AsyncForm(None, _bwd_local_shard),
}


FUNCTIONS = {
    "all_reduce": all_reduce,
    "grad_all_reduce": grad_all_reduce,
    "all_gather": all_gather,
    "local_shard": local_shard,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
}


def start_grad_bucket(params: list[torch.nn.Parameter], group, flat: torch.Tensor) -> Pending:
    """Start the all-reduce (sum) of ``params``' gradients in ``flat``, the bucket's buffer (kept from
    step to step, ``solver/buckets.py``; in mixed precision's ``reduce_dtype``): each gradient is copied
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

    return Pending(work, finish)
