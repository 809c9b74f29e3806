"""torch.compile over a rank's generated programs (``TrainConfig.torch_compile``): Inductor sees the collectives.

Each generated GraphModule (a stage, a recomputation head or rest, the forward program) is rewritten into a
copy whose every call dynamo can trace, and that copy is compiled with Inductor (its C++ back end on CPU,
Triton on GPU); forward and backward are compiled together (AOTAutograd), so the backward the executor runs
is compiled code too; under a zero-bubble schedule each backward graph is compiled as two, B (input
gradients) and W (weight gradients), run at the schedule's ``B`` and ``W`` (runtime/build/compiled_split.py).
The rewrite:

- **collectives** become autograd functions over torch's functional all-reduce (``_reduce``: a start,
  ``_c10d_functional.all_reduce``, and its ``wait_tensor``, which Inductor's comm passes move apart) and an
  autopar op registered with ``torch.library`` (``autopar::gather``: the all-gather and its reassembly, with a
  fake kernel giving its output's shape), so dynamo traces through them and Inductor schedules and fuses the
  compute around them as nodes of its graph; a shard is plain slicing (the rank's coordinates are constants
  of its program). The process groups are named by a number into this module's table (``_COMMS``), so a
  compiled backward needs no ``use_comm`` in force when it runs. Megatron's fused f (``column_linears``) is
  emitted as f and its matmuls again: Inductor fuses those itself. An all-reduce computed from the inputs
  alone (a mean loss's count of labels) is moved ahead of the compute (``_hoist_input_reductions``), and a
  returned loss's deferred all-reduce is left out of the graph: ``CompiledCall`` starts it after the compiled
  forward and returns it in flight, waited at its first read as the eager program's (``runtime/comm/lazy.py``).
- **keyed dropout**: the mask is ``autopar::dropout_mask``, an op reading the site's current step and
  microbatch when it runs (``runtime/build/rng.py``), so no step recompiles the program; the multiply fuses.
- **vocab-parallel embedding and cross-entropy**: the rank's block of the vocabulary is a constant; the
  cross-entropy's three reductions are ``_reduce`` and its backward is autograd's (``vocab_cross_entropy``).
- anything else the rewrite does not know (ZeRO-3's unit gathers and releases) is called eagerly: the program
  is cut there (``_compiled``), the compute between compiled piece by piece, so each value goes after its last
  use as in the eager program (a dynamo graph break would hold it to the program's end); ``CompileLog.eager``
  lists each such call and why, and it is logged.

What the runtime's overlap becomes: a collective in a compiled program is waited at its result's first use
in Inductor's order (the eager program waits where it stands, but for two overlaps that the log states the
compiled form does not promise: Megatron f's gradient all-reduce behind its weight gradients, and ZeRO-3's
prefetch, which the graph breaks at its gathers keep). Gradient buckets are filled by the parameters'
accumulation hooks as before; a compiled backward delivers a region's gradients together at its end. Where a
stage's last backward of the step finishes its gradients in one graph (``ParallelModule._graph_buckets`` says
when), its buckets are reduced inside that compiled backward instead (``_BucketSync``: torch's functional
collectives, a start and a wait Inductor's comm passes move apart, so the backward computes between them).
With several microbatches the stage is compiled twice: its last microbatch runs the program with the buckets,
whose backward first adds what the earlier ones accumulated in ``.grad`` (``autopar::accumulated``: taken
from ``.grad`` and added in place, as autograd accumulates), so each bucket sums the step's whole gradient as
the eager bucket does, to the bit; the earlier microbatches run the program without them
(``{label}.accumulate``), which only accumulates.

A compile failure never gives a wrong result: the failing graph runs eagerly (the graph dynamo captured, op
for op), with a warning naming its first kernel or op and the error. The first call of each program is
timed apart from the later ones (``CompileLog``; logger ``autopar.compile``). Inductor's FX graph cache and
AOTAutograd's cache are on (torch's defaults, kept on here), in ``TORCHINDUCTOR_CACHE_DIR``
(default ``/tmp/torchinductor_<user>``): a second run of the same plan loads its kernels.
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autopar.ir.axes import data_axes, tensor_axes
from autopar.runtime.build import rng as keyed
from autopar.runtime.build.compiled_split import SplitLog, split_inner_compile, weight_side
from autopar.runtime.build.precision import cast_to
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.column_linear import MM, column_linears
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.comm.shards import shard_tensor, unshard_tensor
from autopar.runtime.comm.vocab_parallel import check_range, vocab_parallel_cross_entropy, vocab_parallel_embedding
from autopar.runtime.execute.stage_runner import Part

log = logging.getLogger("autopar.compile")

_COMMS: list[Comm] = []  # the process groups the compiled programs of this process name by number
_SITES: list[keyed.DropoutSite] = []  # the keyed dropout sites, likewise


# -- the ops the compiler sees ----------------------------------------------------------------------------
def _reduce(x: torch.Tensor, comm: int, axis: str, op: str) -> torch.Tensor:
    """All-reduce of ``x`` over ``axis`` of communicator ``comm``: ``sum``, ``avg`` or ``max``, as torch's
    functional collectives (a start, ``_c10d_functional.all_reduce``, and its ``wait_tensor``), so that
    Inductor's comm passes (``_COMM_OVERLAP``) start it as soon as its input is computed and wait where its
    result is first read, the graph computing in between (a loss's token count, from the labels alone, is
    summed while the forward runs). gloo has no average: a sum, divided."""
    c = _COMMS[comm]
    group = c.groups[axis].group_name
    y = torch.ops._c10d_functional.all_reduce(x.contiguous(), "max" if op == "max" else "sum", group)
    y = torch.ops._c10d_functional.wait_tensor(y)
    return y / c.sizes[axis] if op == "avg" else y


@torch.library.custom_op("autopar::gather", mutates_args=())
def _gather(x: torch.Tensor, comm: int, axis: str, dim: int, chunks: int) -> torch.Tensor:
    """All-gather of ``x`` over ``axis``, reassembled as ``Shard(dim, chunks)`` lays the shards out."""
    c = _COMMS[comm]
    parts = [torch.empty_like(x) for _ in range(c.sizes[axis])]
    dist.all_gather(parts, x.contiguous(), group=c.groups[axis])
    return unshard_tensor(parts, dim, chunks)


@_gather.register_fake
def _(x, comm, axis, dim, chunks):
    shape = list(x.shape)
    shape[dim] *= _COMMS[comm].sizes[axis]
    return torch.empty(shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("autopar::dropout_mask", mutates_args=())
def _dropout_mask(x: torch.Tensor, site: int) -> torch.Tensor:
    """Dropout site ``site``'s keep mask at its current step and microbatch, scaled by 1/(1-p), in x's dtype
    (zeros for p >= 1)."""
    s = _SITES[site]
    if s.p >= 1.0:
        return torch.zeros_like(x)
    return s.keep().to(x.dtype).mul_(1.0 / (1.0 - s.p))


@_dropout_mask.register_fake
def _(x, site):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("autopar::checked_index", mutates_args=())
def _checked_index(index: torch.Tensor, size: int, what: str, ignore: int | None) -> torch.Tensor:
    """``index`` (a copy: an op's output is never its input) once ``check_range`` found every entry in [0, size)
    or ``ignore``: it raises ``InputRangeError`` as the eager program does, and the compiled graph reads the
    checked copy, so the check is never removed as dead code."""
    check_range(index, size, what, ignore)
    return index.clone()


@_checked_index.register_fake
def _(index, size, what, ignore):
    return torch.empty_like(index)


# -- the collectives over them (the conventions of runtime/comm/collectives.py) -----------------------------
def _shard(x: torch.Tensor, c: Comm, axis: str, dim: int, chunks: int) -> torch.Tensor:
    return shard_tensor(x, dim, chunks, c.sizes[axis], c.coords[axis]).contiguous()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, op):
        ctx.scale = 1.0 / _COMMS[comm].sizes[axis] if op == "avg" else 1.0
        return _reduce(x, comm, axis, op)

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.scale if ctx.scale != 1.0 else g), None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.comm, ctx.axis, "sum"), None, None


class _AllGather(torch.autograd.Function):
    """An all_gather; backward this rank's shard of the gradient, with ``reduce_grad`` of the ranks' partial
    gradients summed first."""

    @staticmethod
    def forward(ctx, x, comm, axis, dim, chunks, reduce_grad):
        ctx.args = (comm, axis, dim, chunks)
        ctx.reduce_grad = reduce_grad
        return _gather(x, comm, axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        comm, axis, dim, chunks = ctx.args
        if ctx.reduce_grad:
            g = _reduce(g, comm, axis, "sum")
        return _shard(g, _COMMS[comm], axis, dim, chunks), None, None, None, None, None


class _LocalShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, dim, chunks):
        ctx.args = (comm, axis, dim, chunks)
        return _shard(x, _COMMS[comm], axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, *ctx.args), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, op, dim, chunks):
        ctx.args = (comm, axis, dim, chunks)
        ctx.scale = 1.0 / _COMMS[comm].sizes[axis] if op == "avg" else 1.0
        return _shard(_reduce(x, comm, axis, op), _COMMS[comm], axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        y = _gather(g, *ctx.args)
        return (y * ctx.scale if ctx.scale != 1.0 else y), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, src_dim, src_chunks, dim, chunks):
        ctx.args = (comm, axis, src_dim, src_chunks, dim, chunks)
        return _shard(_gather(x, comm, axis, src_dim, src_chunks), _COMMS[comm], axis, dim, chunks)

    @staticmethod
    def backward(ctx, g):
        comm, axis, src_dim, src_chunks, dim, chunks = ctx.args
        y = _shard(_gather(g, comm, axis, dim, chunks), _COMMS[comm], axis, src_dim, src_chunks)
        return y, None, None, None, None, None, None


@torch.library.custom_op("autopar::accumulated", mutates_args=())
def _accumulated(grads: list[torch.Tensor], take: int) -> list[torch.Tensor]:
    """Each of ``grads`` plus what its parameter (entry ``take`` of ``_TAKE``) holds in ``.grad``, which is taken
    (set to None, so that autograd's accumulation after the backward stores the bucket's sum there): the earlier
    microbatches' gradients, added in place as autograd's accumulation adds them (the same bits), or a copy of
    the gradient where ``.grad`` is None."""
    out = []
    for g, ref in zip(grads, _TAKE[take]):
        p = ref()
        acc = None if p is None else p.grad
        if p is not None:
            p.grad = None
        if acc is None:
            out.append(g.clone())
        elif acc.stride() == g.stride() and acc.dtype == g.dtype and not acc.is_sparse:
            out.append(acc.add_(g))
        else:  # the layout the compiled graph was told (its fake kernel's): a new tensor
            out.append(torch.add(acc.to(g.dtype), g, out=torch.empty_like(g)))
    return out


@_accumulated.register_fake
def _(grads, take):
    return [torch.empty_like(g) for g in grads]


_TAKE: list[list] = []  # per taking bucket, weak references to the parameters whose .grad it takes, in order


class _BucketSync(torch.autograd.Function):
    """A gradient bucket in the graph: the identity on the bucket's parameters forward; backward, once every
    one of their gradients is computed (the function's backward runs then), one coalesced all-reduce (sum) of
    them as torch's functional collectives, a start (``_c10d_functional.all_reduce_coalesced``) and a
    ``wait_tensor`` per gradient, which Inductor's comm passes sink to the gradients' use (the backward's end),
    so the backward above the bucket computes while its sums are in flight. In ``Comm.grad_dtype`` where set.
    ``take`` (an entry of ``_TAKE``, or -1): the gradients at ``positions`` first get what earlier microbatches
    accumulated in their parameters' ``.grad`` (``autopar::accumulated``), so the sums are of the step's whole
    gradient, as the eager buckets' are."""

    @staticmethod
    def forward(ctx, comm, axis, take, positions, *params):
        ctx.comm, ctx.axis, ctx.take, ctx.positions = comm, axis, take, positions
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        c = _COMMS[ctx.comm]
        dtype = c.grad_dtype
        grads = list(grads)
        if ctx.take >= 0:
            whole = _accumulated([grads[i] for i in ctx.positions], ctx.take)
            for i, g in zip(ctx.positions, whole):
                grads[i] = g
        send = [(g if dtype is None else g.to(dtype)).contiguous() for g in grads]
        sums = torch.ops._c10d_functional.all_reduce_coalesced(send, "sum", c.groups[ctx.axis].group_name)
        outs = [torch.ops._c10d_functional.wait_tensor(t) for t in sums]
        return (None, None, None, None, *(o.to(g.dtype) for o, g in zip(outs, grads)))


def bucket_sync(comm: int, axis: str, take: int, positions: tuple[int, ...], *params):
    return _BucketSync.apply(comm, axis, take, positions, *params)


def all_reduce(x, comm: int, axis: str, op: str = "sum", defer: bool = False):
    return _AllReduce.apply(x, comm, axis, op)  # defer: waited here (the compiled form's one sync point)


def grad_all_reduce(x, comm: int, axis: str):
    return _GradAllReduce.apply(x, comm, axis)


def all_gather(x, comm: int, axis: str, dim: int, chunks: int = 1, reduce_grad: bool = False):
    return _AllGather.apply(x, comm, axis, dim, chunks, reduce_grad)


def local_shard(x, comm: int, axis: str, dim: int, chunks: int = 1):
    return _LocalShard.apply(x, comm, axis, dim, chunks)


def reduce_scatter(x, comm: int, axis: str, op: str, dim: int, chunks: int = 1):
    return _ReduceScatter.apply(x, comm, axis, op, dim, chunks)


def all_to_all(x, comm: int, axis: str, src_dim: int, src_chunks: int, dim: int, chunks: int):
    return _AllToAll.apply(x, comm, axis, src_dim, src_chunks, dim, chunks)


_TRACEABLE_COLLECTIVES = {
    coll.all_reduce: all_reduce,
    coll.grad_all_reduce: grad_all_reduce,
    coll.all_gather: all_gather,
    coll.local_shard: local_shard,
    coll.reduce_scatter: reduce_scatter,
    coll.all_to_all: all_to_all,
}


def keyed_dropout(x: torch.Tensor, site: int) -> torch.Tensor:
    """``runtime/build/rng.keyed_dropout`` with the mask from ``autopar::dropout_mask`` (which reads p itself:
    a Python float read here would be traced as a symbolic scalar)."""
    if not _SITES[site].rng.training:
        return x
    return x * _dropout_mask(x.detach(), site)  # the mask carries no gradient


def embedding_block(weight: torch.Tensor, ids: torch.Tensor, block: int, padding_idx: int, vocab: int) -> torch.Tensor:
    """``vocab_parallel_embedding`` of the rank holding block ``block`` of the table (its rows), every id below
    ``vocab`` (the whole table's rows; negative: minus the ranks holding blocks, the rows that many times)."""
    rows = weight.shape[0]
    ids = _checked_index(ids, vocab if vocab > 0 else rows * -vocab, "token ids", None)
    start = block * rows
    outside = (ids < start) | (ids >= start + rows)
    local_pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else -1
    out = torch.ops.aten.embedding(weight, (ids - start).masked_fill(outside, 0), local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_cross_entropy(
    logits, target, comm: int, axes: list[str], reduction: int = 1, ignore_index: int = -100, classes=None
):
    """``vocab_parallel_cross_entropy`` in traceable ops: the row max, the softmax denominator and the target's
    logit all-reduced over ``axes`` (the max without a gradient: the loss does not depend on it; the sums as
    Megatron's g, whose backward is the identity), so autograd derives softmax minus the one-hot target;
    every label below ``classes`` (default: the local classes times the ranks) or ``ignore_index``."""
    c = _COMMS[comm]
    block = 0
    for a in axes:
        block = block * c.sizes[a] + c.coords[a]
    local = logits.shape[1]
    start = block * local
    whole = 1
    for a in axes:
        whole *= c.sizes[a]
    target = _checked_index(target, classes if classes is not None else local * whole, "labels", ignore_index)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    row_max = logits.detach().max(dim=1).values
    for a in axes:
        row_max = _reduce(row_max, comm, a, "max")
    shifted = logits - row_max.unsqueeze(1)
    denom = shifted.exp().sum(dim=1)
    ignored = target == ignore_index
    outside = (target < start) | (target >= start + local) | ignored
    idx = (target - start).masked_fill(outside, 0)
    picked = shifted.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
    for a in axes:
        denom = all_reduce(denom, comm, a, "sum")
        picked = all_reduce(picked, comm, a, "sum")
    loss = (denom.log() - picked).masked_fill(ignored, 0.0)
    if reduction == 1:  # mean over the rows that are not ignored
        return loss.sum() / (~ignored).sum()
    return loss.sum() if reduction == 2 else loss


def _column_matmul(kind: str, x, w, b):
    if kind == MM:
        return torch.ops.aten.mm.default(x, w) if b is None else torch.ops.aten.addmm.default(b, x, w)
    return torch.ops.aten.linear.default(x, w, b)


# -- the rewrite ------------------------------------------------------------------------------------------
@dataclass
class CompileLog:
    """What compiling a rank's programs did: per program, the calls run eagerly (and why), the seconds of its
    first call (tracing and compiling included) and of each later one, and graphs that failed to compile."""

    eager: dict[str, list[str]] = field(default_factory=dict)  # program label -> "call: why"
    first_s: dict[str, float] = field(default_factory=dict)
    later_s: dict[str, list[float]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # "label: the op or kernel: the error"
    plan_notes: list[str] = field(default_factory=list)  # eager_parts: what the plan's features leave eager
    # the gradient buckets reduced inside each program's backward graph (label -> their parameters, per bucket)
    graph_buckets: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    # per program, each graph with collectives as Inductor scheduled it: "start", "wait" or "compute" per kernel
    # (recorded when Inductor compiles the graph, not when its cache supplies it)
    schedules: dict[str, list[list[str]]] = field(default_factory=dict)
    # per program of a split backward: its backward graphs as B and W (runtime/build/compiled_split.py)
    split: dict[str, SplitLog] = field(default_factory=dict)

    def summary(self) -> str:
        first = sum(self.first_s.values())
        later = [sum(v) / len(v) for v in self.later_s.values() if v]
        lines = [
            f"torch.compile: {len(self.first_s)} programs, first calls {first:.2f} s in all"
            + (f", later calls {sum(later) * 1e3:.1f} ms per round" if later else "")
        ]
        for label, calls in self.eager.items():
            lines.append(f"  {label} runs eagerly: {'; '.join(calls)}")
        for label, buckets in self.graph_buckets.items():
            lines.append(f"  {label}: {len(buckets)} gradient buckets all-reduced in its backward graph (start/wait)")
        for label, split in self.split.items():
            for g in split.graphs:
                lines.append(
                    f"  {label}: backward compiled as B ({g['B']} input gradients) and W ({g['W']} weight gradients), "
                    f"{g['boundary']} tensors from B to W"
                )
        lines += [f"  compile failed, ran eagerly: {f}" for f in self.failed]
        lines += [f"  eager or not overlapped by the plan: {n}" for n in self.plan_notes]
        return "\n".join(lines)


_PASS_THROUGH = {cast_to, operator.getitem}


def _traceable(target) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    name = getattr(target, "__name__", "")
    return target in _PASS_THROUGH or name in ("_getitem", "_item")


def compilable(
    gm: fx.GraphModule,
    comm: Comm,
    label: str,
    log_: CompileLog,
    buckets: list[tuple[str, list[str]]] = (),
    take: bool = False,
) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters and buffers) whose calls dynamo can trace, as the module
    docstring says; the calls it leaves eager are noted in ``log_.eager[label]``. ``buckets``: gradient buckets
    (axis, the attribute names of their parameters, each read by a ``get_attr`` of ``gm``) whose all-reduce
    the backward graph runs itself (``_BucketSync``: every read of a bucket's parameters goes through it);
    ``take``: the gradient each bucket sums is the parameter's accumulated one, what earlier microbatches left
    in ``.grad`` added first (in the bucket its backward reaches first: a parameter's last)."""
    if comm not in _COMMS:
        _COMMS.append(comm)
    cid = next(i for i, c in enumerate(_COMMS) if c is comm)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    eager: list[str] = []
    reads = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    synced: dict[str, fx.Node] = {}  # a bucket's parameter -> its value through the bucket's sync
    deferred = _returned_deferred(gm)
    for n in gm.graph.nodes:
        if n in env:  # a bucket's parameter read early (below)
            continue
        if n in deferred:  # a returned loss's deferred all-reduce: run after the graph (``CompiledCall``)
            env[n] = env[n.args[0]]
            continue
        if buckets and not synced and n.op not in ("get_attr", "placeholder"):  # before the first computation
            for t in {t for _axis, names in buckets for t in names}:
                if reads[t] not in env:  # read later in gm (a mixed-precision program casts as it goes): now
                    env[reads[t]] = graph.node_copy(reads[t])
            last = {t: b for b, (_axis, names) in enumerate(buckets) for t in names}  # a parameter's last bucket
            for b, (axis, names) in enumerate(buckets):
                ins = [synced.get(t) or env[reads[t]] for t in names]
                at = tuple(i for i, t in enumerate(names) if take and last[t] == b)
                if at:
                    _TAKE.append([weakref.ref(operator.attrgetter(names[i])(gm)) for i in at])
                out = graph.call_function(bucket_sync, (cid, axis, len(_TAKE) - 1 if at else -1, at, *ins))
                for i, t in enumerate(names):
                    synced[t] = graph.call_function(operator.getitem, (out, i))
        if n.op != "call_function":
            env[n] = graph.node_copy(n, lambda a: synced.get(a.target, env[a]) if a.op == "get_attr" else env[a])
            continue
        args = fx.map_arg(n.args, lambda a: synced.get(a.target, env[a]) if a.op == "get_attr" else env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: synced.get(a.target, env[a]) if a.op == "get_attr" else env[a])
        t = n.target
        if t in _TRACEABLE_COLLECTIVES:
            new = graph.call_function(_TRACEABLE_COLLECTIVES[t], (args[0], cid, *args[1:]), kwargs)
        elif t is keyed.keyed_dropout:
            site = getattr(gm, n.args[1].target)
            _SITES.append(site)
            new = graph.call_function(keyed_dropout, (args[0], len(_SITES) - 1))
        elif t is vocab_parallel_embedding:
            block = 0
            for a in kwargs["axes"]:
                block = block * comm.sizes[a] + comm.coords[a]
            ranks = math.prod(comm.sizes[a] for a in kwargs["axes"])
            vocab = kwargs.get("vocab") or -ranks  # unknown: the local rows times the ranks (-ranks)
            new = graph.call_function(embedding_block, (args[0], args[1], block, kwargs.get("padding_idx", -1), vocab))
        elif t is vocab_parallel_cross_entropy:
            new = graph.call_function(vocab_cross_entropy, (args[0], args[1], cid, *args[2:]), kwargs)
        elif t is column_linears:
            x, weights, biases, kinds, axis = args
            f = graph.call_function(grad_all_reduce, (x, cid, axis))
            outs = [graph.call_function(_column_matmul, (k, f, w, b)) for k, w, b in zip(kinds, weights, biases)]
            new = graph.call_function(tuple, (outs,))
        elif _traceable(t):
            new = graph.call_function(t, args, kwargs)
        else:
            name = getattr(t, "__qualname__", repr(t))
            eager.append(f"{name} (not traceable by dynamo: a graph break there)")
            new = graph.call_function(_eager(t), args, kwargs)
        new.meta = dict(n.meta)
        env[n] = new
    _hoist_input_reductions(graph)
    graph.lint()
    # the dropout sites' get_attr nodes; an eager call returning nothing (ZeRO-3's release) is kept: dead code
    # to fx, it is what frees the unit's storage for reuse and notes its compute-dtype copies as tokens
    graph.eliminate_dead_code(lambda n: n.is_impure() or n.target in _EAGER.values())
    out = fx.GraphModule(gm, graph, class_name="CompiledRankModule")
    out.deferred = sorted(deferred.values())  # (output index, axis, op) of each all-reduce left to CompiledCall
    if eager:
        log_.eager[label] = sorted(set(eager))
    if buckets:
        log_.graph_buckets[label] = [tuple(names) for _axis, names in buckets]
    return out


def _hoist_input_reductions(graph: fx.Graph) -> None:
    """Move each all-reduce computed from the program's inputs alone (no parameter, no other collective: a
    mean loss's count of labels not ignored) and the ops computing its input to the front of ``graph``, so
    that Inductor starts it first and the forward computes while it is in flight (its wait sinks to the
    division that reads it). Integer work on the labels; the order of the collectives is kept."""
    anchor = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr")), None)
    moved: set[fx.Node] = set()
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not all_reduce:
            continue
        seen: list[fx.Node] = []
        stack, ok = [n], True
        while stack and ok:
            a = stack.pop()
            if a in seen or a in moved or a.op == "placeholder":
                continue
            collective = a is not n and a.target in (all_reduce, all_gather, reduce_scatter, all_to_all, bucket_sync)
            ok = a.op == "call_function" and not collective
            seen.append(a)
            stack.extend(x for x in a.all_input_nodes)
        if not ok:
            continue  # it stays; one hoisted past it is hoisted on every rank alike
        order = {x: i for i, x in enumerate(graph.nodes)}
        at = anchor  # before the first other op, but after every input it reads (a stage's labels come late)
        for x in {x for a in seen for x in a.all_input_nodes if x not in seen}:
            if order[x] >= order[at]:
                at = x.next
        for a in sorted(seen, key=order.__getitem__):  # in their order
            if order[a] < order[at]:
                continue  # early enough where it is
            if a is at:
                at = a.next
            else:
                at.prepend(a)
        moved.update(seen)


def _returned_deferred(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, str, str]]:
    """The deferred all-reduces (``defer=True``: a returned loss's, runtime/comm/lazy.py) whose one use is as an
    output of ``gm``'s flat tuple of outputs: node -> (its output index, axis, op). The compiled program
    returns their inputs and ``CompiledCall`` starts them after it, as the eager program does, so that their
    wait is deferred to the loss's first read (a backward reads none) instead of ending the forward."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out.args[0]
    if not isinstance(outs, (tuple, list)):
        return {}
    found: dict[fx.Node, tuple[int, str, str]] = {}
    for i, a in enumerate(outs):
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is coll.all_reduce):
            continue
        bound = inspect.signature(coll.all_reduce).bind(*a.args, **a.kwargs)
        bound.apply_defaults()
        args = bound.arguments
        if args["defer"] and args["pending"] is None and len(a.users) == 1 and outs.count(a) == 1:
            found[a] = (i, args["axis"], args["op"])
    return found


_EAGER: dict[Callable, Callable] = {}


def _eager(fn: Callable) -> Callable:
    """``fn`` behind ``torch.compiler.disable`` (one wrapper per function, so dynamo's caches stay small)."""
    if fn not in _EAGER:
        _EAGER[fn] = torch.compiler.disable(fn, recursive=True)
    return _EAGER[fn]


# -- compiling, with a fallback ---------------------------------------------------------------------------
def _inductor(label: str, log_: CompileLog, retains_graph: bool) -> Callable:
    """A dynamo back end: Inductor, or on an error the captured graph as it is (eager), with a warning.
    ``retains_graph``: the backward runs with ``retain_graph=True`` (a split backward's B), which AOTAutograd's
    donated buffers (a backward reusing its saved tensors' memory) forbid: they are off for its compile, and
    (AOTAutograd checks the flag again when the backward runs) in the whole process from then on."""
    from torch._dynamo.exc import RestartAnalysis, SkipFrame
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def backend(graph: fx.GraphModule, example_inputs):
        inner = compile_fx_inner
        if retains_graph:  # its backward as B and W (runtime/build/compiled_split.py), not in AOTAutograd's cache
            torch._functorch.config.donated_buffer = False
            weights = {i for i, x in enumerate(example_inputs) if weight_side(x)}
            inner = split_inner_compile(weights, log_.split.setdefault(label, SplitLog()), compile_fx_inner)
        _SCHEDULING[:] = [log_, label]
        try:  # the backward is lowered now, not at its first run, so its failure is caught here too
            with (
                torch._functorch.config.patch(
                    force_non_lazy_backward_lowering=True,
                    donated_buffer=not retains_graph,
                    enable_autograd_cache=not retains_graph,
                ),
                torch._inductor.config.patch(_COMM_OVERLAP),
            ):
                return compile_fx(graph, example_inputs, inner_compile=inner)
        except (RestartAnalysis, SkipFrame):
            raise  # dynamo's own control flow (trace again with other choices), not a failure
        except Exception as e:  # noqa: BLE001 - any compiler error: never a wrong result, eager instead
            where = _culprit(e, graph)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            note = f"{label}: {where}: {type(e).__name__}: {first[:300]}"
            log_.failed.append(note)
            log.warning("autopar.compile: %s", note, exc_info=e)  # the whole error, for a bug report
            warnings.warn(f"torch.compile failed on {note}; that graph runs eagerly", RuntimeWarning, stacklevel=2)
            return graph.forward

    return backend


_SCHEDULING: list = []  # [the log, the label] of the graph Inductor is compiling (``_note_schedule`` writes there)


def _note_schedule(snodes: list) -> list:
    """An Inductor comm pass that reorders nothing: it notes a graph's kernels in their final order ("start" a
    collective, "wait" its wait, "compute" any other kernel) in ``CompileLog.schedules``, where it has one."""
    from torch._inductor import comms

    def kind(n) -> str:
        return "start" if comms.contains_collective(n) else "wait" if comms.contains_wait(n) else "compute"

    kinds = [kind(n) for n in snodes]
    if "start" in kinds and _SCHEDULING:
        log_, label = _SCHEDULING
        log_.schedules.setdefault(label, []).append(kinds)
    return snodes


# Inductor's comm passes on every graph: a collective started as early as its inputs allow, its wait sunk to its
# first use (the functional collectives of ``_BucketSync``; autopar's own ops wait where they stand), then noted
_COMM_OVERLAP = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", _note_schedule],
}


def _culprit(e: Exception, graph: fx.GraphModule) -> str:
    """The op a compile error is about: Inductor's lowering target when the error names one, else the first op
    of the graph that fails to compile alone (``_fails_alone``: a C++ or Triton error names only its kernel's
    file), else the graph's ops."""
    target = getattr(e, "target", None) or getattr(getattr(e, "inner_exception", None), "target", None)
    if target is not None:
        return f"op {target}"
    seen: set = set()
    for n in graph.graph.nodes:
        one_tensor = isinstance(n.meta.get("example_value"), torch.Tensor)  # an op alone returns one tensor
        op = n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        if op and one_tensor and n.target not in seen:
            seen.add(n.target)
            if len(seen) > _MAX_ISOLATED:
                break
            if _fails_alone(n):
                return f"op {n.target}"
    ops = sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"})
    return f"a graph of {', '.join(ops[:8])}{' ...' if len(ops) > 8 else ''}"


_MAX_ISOLATED = 32  # distinct ops tried alone after a failure (each a small compile)


def _fails_alone(node: fx.Node) -> bool:
    """Whether Inductor fails to compile ``node``'s op alone, on zeros shaped like its inputs (no autograd)."""
    from torch._inductor.compile_fx import compile_fx

    g = fx.Graph()
    inputs: list[torch.Tensor] = []

    def place(a):
        v = a.meta.get("example_value")
        if not isinstance(v, torch.Tensor):
            raise _NotIsolable
        inputs.append(torch.zeros(v.shape, dtype=v.dtype, device=v.device))
        return g.placeholder(f"x{len(inputs)}")

    try:
        args = fx.map_arg(node.args, place)
        kwargs = fx.map_arg(node.kwargs, place)
    except _NotIsolable:
        return False
    g.output(g.call_function(node.target, args, kwargs))
    try:
        with torch.no_grad():
            compile_fx(fx.GraphModule(torch.nn.Module(), g), inputs)
    except Exception:  # noqa: BLE001 - what is asked is whether it fails
        return True
    return False


class _NotIsolable(Exception):
    """An input of the op is no tensor with a known shape."""


def _compiled(gm: fx.GraphModule, backend: Callable) -> Callable:
    """``gm`` through torch.compile with ``backend``. A program with calls left eager (``compilable``'s ``_eager``:
    ZeRO-3's gathers and releases) is cut into pieces (``_pieces``, ``split_module``): each compiled on its own,
    and fx's code of the pieces calls them and the eager calls in turn, dropping each value after its last use,
    as the eager program does. Left to dynamo, each eager call is a graph break whose code after it runs as a new
    frame taking the live values as arguments, and every such frame lasts to the program's end: every gathered
    unit and its compute copies would be held to the end of the forward, not one unit at a time
    (runtime/grads/zero3.py; a 3-block GPT-2 under ZeRO-3 bf16 on dp=2: 961,920 bytes gathered at once, the
    whole model in fp32 and bf16, where eager and these pieces hold 516,480, tests/test_torch_compile_zero3_bf16.py)."""
    eager = set(_EAGER.values())
    if not any(n.op == "call_function" and n.target in eager for n in gm.graph.nodes):
        return torch.compile(gm, backend=backend, dynamic=False)
    piece, kept = _pieces(gm, eager)
    split = split_module(gm, gm, piece.__getitem__, keep_original_order=True)
    for name, sub in list(split.named_children()):
        if name not in kept:
            setattr(split, name, torch.compile(sub, backend=backend, dynamic=False))
    return split


def _pieces(gm: fx.GraphModule, eager: set[Callable]) -> tuple[dict[fx.Node, int], set[str]]:
    """Each node's piece (split_module's partition: piece k is ``submod_k``) and the pieces of the eager calls: an
    eager call alone, the nodes between two together, but cut again before a computation reading another unit
    than the piece has read (a value computed from an eager call's output alone: a unit's whole parameters, their
    compute copies and views). A compiled piece is one autograd node whose backward unpacks all it saved at once:
    the last block and the head reading the root's copies in one piece would have the backward gather the root
    beside two blocks (the one computing, the one arriving), more than eager ever holds."""
    piece: dict[fx.Node, int] = {}
    kept: set[str] = set()
    unit: dict[fx.Node, fx.Node] = {}  # a value computed from one eager call's output alone -> that call
    k, after_eager, current = 0, True, None  # current: the unit the piece's computations have read
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        alone = n.op == "call_function" and n.target in eager
        units = {unit[a] for a in n.all_input_nodes if a in unit}
        new = alone or after_eager
        if alone:
            unit[n], current = n, None
        elif n.all_input_nodes and len(units) == 1 and all(a in unit for a in n.all_input_nodes):
            unit[n] = next(iter(units))  # the unit's side: no computation of the piece
        elif units:  # a computation reading another unit than the piece's: a piece of its own from here
            new = new or (current is not None and units != {current})
            current = next(iter(units)) if len(units) == 1 else None
        k += new
        piece[n] = k
        if alone:
            kept.add(f"submod_{k}")
        after_eager = alone
    return piece, kept


class CompiledCall:
    """A part's compiled program: times its first call apart from the later ones (``CompileLog``), then starts
    the all-reduces of ``deferred`` ((output index, axis, op), ``_returned_deferred``) on those outputs, waited
    at their first read as the eager program's are."""

    def __init__(self, fn: Callable, label: str, log_: CompileLog, comm: Comm | None = None, deferred=()):
        self.fn, self.label, self.log = fn, label, log_
        self.comm, self.deferred = comm, list(deferred)

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.fn(*args)
        if self.deferred:
            out = list(out)
            with use_comm(self.comm):
                for i, axis, op in self.deferred:
                    out[i] = coll.all_reduce(out[i], axis, op, defer=True)
            out = tuple(out)
        dt = time.perf_counter() - t0
        if self.label not in self.log.first_s:
            self.log.first_s[self.label] = dt
            log.info("autopar.compile: %s first call (traced and compiled) %.2f s", self.label, dt)
        else:
            self.log.later_s.setdefault(self.label, []).append(dt)
        return out


def compile_part(
    part: Part,
    comm: Comm,
    label: str,
    log_: CompileLog,
    retains_graph: bool = False,
    buckets=(),
    last_microbatch: int | None = None,
) -> None:
    """Run ``part`` through torch.compile (Inductor) from its next call on (``retains_graph``: ``_inductor``'s;
    ``buckets``: ``compilable``'s). ``last_microbatch``: with ``buckets``, a step runs the part on several
    microbatches and only that one's backward finishes the gradients: it runs the program whose backward
    reduces the buckets, the step's accumulated gradients taken in (``Part.last``), and the microbatches before
    it a program without them, which only accumulates (labelled ``{label}.accumulate``)."""
    many = bool(buckets) and last_microbatch is not None
    gm = compilable(part.module, comm, label, log_, list(buckets), take=many)
    for why in log_.eager.get(label, ()):
        log.info("autopar.compile: %s: %s", label, why)
    fn = _compiled(gm, _inductor(label, log_, retains_graph))
    call = CompiledCall(fn, label, log_, comm, gm.deferred)
    if not many:
        part.call = call
        return
    part.last = (last_microbatch, call)
    before = f"{label}.accumulate"
    gm = compilable(part.module, comm, before, log_)
    fn = _compiled(gm, _inductor(before, log_, retains_graph))
    part.call = CompiledCall(fn, before, log_, comm, gm.deferred)


def compile_parts(
    parts: dict[str, Part],
    comm: Comm,
    retains_graph: set[str] = frozenset(),
    buckets: dict | None = None,
    last: dict[str, int] | None = None,
) -> CompileLog:
    """Compile every part of a rank (label -> part; a part listed twice is compiled once), with one log;
    ``retains_graph``: the labels whose backward is split (``_inductor``); ``buckets``: label -> the gradient
    buckets its backward graph reduces (``compilable``); ``last``: label -> the microbatch whose backward that
    is, where a step runs several (``compile_part``'s ``last_microbatch``)."""
    log_ = CompileLog()
    done: set[int] = set()
    for label, part in parts.items():
        if id(part) not in done:
            done.add(id(part))
            retains = label in retains_graph
            compile_part(part, comm, label, log_, retains, (buckets or {}).get(label, ()), (last or {}).get(label))
    return log_


def runner_parts(runners: dict, label: str) -> dict[str, Part]:
    """The parts of a rank's stage runners by label (``{label}{stage}``, its recomputation head and rest)."""
    out: dict[str, Part] = {}
    for s, r in runners.items():
        out[f"{label}{s}"] = r.whole
        for x, (head, rest) in r.variants.items():
            out[f"{label}{s}.head{x}"] = head
            if rest is not None:
                out[f"{label}{s}.rest{x}"] = rest
    return out


def eager_parts(
    *,
    zero: int = 0,
    sub_pipeline_tp: bool = False,
    split_backward: bool = False,
    tensor_parallel: bool = False,
    data_parallel: bool = False,
    graph_buckets: bool = False,
) -> list[str]:
    """What of a ``torch_compile=True`` run stays eager or gives up a planned overlap, and why, from the plan's
    features alone (``autopar plan`` prints it before anything is compiled; ``compile_rank`` puts it in the
    compile log): each line ``part: why``; ``graph_buckets``: the compiled backwards reduce the buckets. An
    empty list: every program compiles whole, every overlap kept. A split backward (``split_backward``) is
    compiled as two graphs, B and W (runtime/build/compiled_split.py), and leaves nothing eager itself."""
    out: list[str] = []
    if zero == 3:
        out.append(
            "ZeRO-3 unit gathers and releases (Zero3Params._gather_unit/_release_unit): eager, a graph break at each "
            "(their prefetch is kept; the compute between them is compiled)"
        )
    if sub_pipeline_tp:
        out.append(
            "the training programs: eager whole (sub_pipeline_tp interprets them node by node at their collectives)"
        )
    if tensor_parallel and not sub_pipeline_tp:
        out.append("Megatron f's gradient all-reduce: waited where it stands (not behind the weight gradients)")
    if data_parallel and zero < 3 and not graph_buckets:
        out.append(
            "gradient buckets: a compiled backward delivers its region's gradients together at its end, so the "
            "buckets' all-reduces start then (eager: as each bucket fills); with no ZeRO, no recomputation, no "
            "split backward and no sub-microbatches the last microbatch's compiled backward all-reduces them "
            "itself, started early"
        )
    return out


def mesh_eager_parts(
    sizes: dict[str, int], zero: int, sub_pipeline_tp: bool, split_backward: bool, graph_buckets: bool = False
) -> list[str]:
    """``eager_parts`` of a mesh given as axis name -> size (dp*/tp* axes as their names say)."""
    used = [n for n, k in sizes.items() if k > 1]
    return eager_parts(
        zero=zero, sub_pipeline_tp=sub_pipeline_tp, split_backward=split_backward,
        tensor_parallel=bool(tensor_axes(used)), data_parallel=bool(data_axes(used)), graph_buckets=graph_buckets,
    )  # fmt: skip


def compile_rank(
    forward_runners: dict,
    train_runners: dict,
    comm: Comm,
    sub_pipelined: bool,
    split_backward: bool,
    notes: list[str] | tuple[str, ...] = (),
    buckets: dict | None = None,
    last: dict[int, int] | None = None,
) -> CompileLog:
    """Compile a rank's forward and training programs; the log says what runs eagerly. Sub-pipelined
    tensor parallelism interprets its training programs node by node (``runtime/execute/subpipeline.py``),
    so those stay eager there; ``split_backward``: the schedule runs B and W apart (retaining the graph);
    ``buckets``: per stage, the gradient buckets (axis, parameter attributes) its training program's backward
    graph all-reduces itself (``ParallelModule`` hands them over from its ``GradSync``); ``last``: per stage
    with several microbatches a step, the one whose backward that is (``compile_part``)."""
    parts = runner_parts(forward_runners, "forward")
    train = runner_parts(train_runners, "stage")
    if not sub_pipelined:
        parts |= train
    by_label = {f"stage{s}": b for s, b in (buckets or {}).items()}
    last_of = {f"stage{s}": mb for s, mb in (last or {}).items()}
    log_ = compile_parts(parts, comm, set(train) if split_backward else set(), by_label, last_of)
    log_.plan_notes = list(notes)
    if sub_pipelined:
        for label in runner_parts(train_runners, "stage"):
            log_.eager[label] = ["the whole program (sub_pipeline_tp interprets it at its collectives)"]
    log.info("%s", log_.summary())
    return log_


__all__ = [
    "CompileLog",
    "CompiledCall",
    "compilable",
    "eager_parts",
    "mesh_eager_parts",
    "compile_part",
    "compile_parts",
    "compile_rank",
    "runner_parts",
]
