"""Sharding rules of context parallelism: attention with the query sequence split over a mesh axis.

``scaled_dot_product_attention(q[..., Lq, E], k[..., Lk, E], v[..., Lk, Ev], mask[..., Lq, Lk])`` computes each
query row from the whole key/value sequence, so its rows split over ranks when every rank holds the whole
keys and values: the query (and the mask's query dim, when the mask has one) split on the sequence, the keys
and values replicated. The ILP reaches the replicated keys and values from sequence-split ones through an
all-gather (its resharding edge, priced per axis by the cost model; backward, each rank's partial gradient
of the keys and values is reduce-scattered, the gather's adjoint: ``insert-collectives`` folds the f into the
gathers, ``passes/collectives.reduce_scatter_gathered_grads``): the
all-gather form of context parallelism (Megatron-Core's ``all_gather`` CP, torchtitan's ``allgather``
rotation). Ring attention and Ulysses are not candidates yet: the resharding edges have no point-to-point or
all-to-all step (a sequence-to-heads reshard is an all-gather then a local slice), so neither form exists to
price. The eager ``softmax(q @ k^T + mask) @ v`` pattern (Gemma2's) splits the same way through the matmul,
softmax and pointwise rules: the scores' query rows split, the keys and values all-gathered.

A causal ``is_causal=True`` call (queries and keys of one length) splits too: codegen emits it as
``runtime/comm/context_attention.query_block_sdpa``, which builds each rank's mask on its global query rows
(SDPA's own would align to the local block). An SDPA call with ``dropout_p > 0`` never reaches these rules:
lowering makes it math attention with a keyed dropout of the probabilities (``passes/dropout.py``), which splits
on the query rows like the eager pattern, its mask keyed by global position, so cp ranks draw the one device's
rows (``tests/test_context_parallel.py``: LLaMA with attention dropout on cp=2 equals one device). The
candidates below refuse ``dropout_p > 0`` should such a call be built by hand.
"""

from __future__ import annotations

from autopar.ir.core import Placement, R, Shard, TensorType
from autopar.solver.sharding.one_axis import Ctx, OneD, Rule
from autopar.solver.sharding.rules import reductions


def _dropout_p(c: Ctx) -> float:
    args = c.op.args
    return float(args[4] if len(args) > 4 else c.op.kwargs.get("dropout_p", 0.0) or 0.0)


def _is_causal(c: Ctx) -> bool:
    args = c.op.args
    return bool(args[5] if len(args) > 5 else c.op.kwargs.get("is_causal", False))


def query_sequence(c: Ctx) -> list[OneD]:
    """The candidates splitting the query sequence of an attention (the module docstring)."""
    q = c.ins[0].shape
    seq = len(q) - 2
    if len(c.ins) < 3 or q[seq] % c.n or q[seq] < c.n or _dropout_p(c):
        return []
    if _is_causal(c) and c.ins[1].shape[-2] != q[seq]:  # a causal mask of queries and keys unequal in length
        return []
    ins = [Shard(seq), R, R]
    for t in c.ins[3:]:  # the mask: split on its query dim where it has one, else read whole
        md = len(t.shape) - 2
        ins.append(Shard(md) if md >= 0 and t.shape[md] == q[seq] else R)
    return [(tuple(ins), (Shard(seq),))]


def ring(c: Ctx) -> list[OneD]:
    """The ring-attention candidate: queries, keys and values split on the sequence alike (self-attention, the
    sequence in ``2n`` pieces for the load-balanced layout), the mask split on its query dim where it has one
    (with every key column); the result split like the queries."""
    if len(c.ins) < 3 or c.n == 1 or _dropout_p(c):
        return []
    q, k, v = (t.shape for t in c.ins[:3])
    seq = len(q) - 2
    if not (q[seq] == k[-2] == v[-2]) or q[seq] % (2 * c.n):
        return []
    ins = [Shard(seq), Shard(len(k) - 2), Shard(len(v) - 2)]
    for t in c.ins[3:]:
        if t.shape[-1] != k[-2]:  # a mask broadcast over the keys
            return []
        md = len(t.shape) - 2
        ins.append(Shard(md) if md >= 0 and t.shape[md] == q[seq] else R)
    return [(tuple(ins), (Shard(seq),))]


def is_ring(q: TensorType, k: TensorType, p_q: Placement | None, p_k: Placement | None) -> bool:
    """Whether an attention reading ``q`` and ``k`` at these placements on one axis is ring attention there (both
    split on their sequence dim)."""
    return p_q == Shard(len(q.shape) - 2) and p_k == Shard(len(k.shape) - 2)


def well_formed(ins: list[TensorType], placements: tuple) -> bool:
    """Whether an attention strategy (placements of its inputs on every axis) is one codegen emits: ring attention
    on at most one axis, and no other axis then splitting the query or key sequence."""
    if len(ins) < 3 or placements[0] is None or placements[1] is None:
        return True
    q, k = ins[0], ins[1]
    pq, pk = placements[0], placements[1]
    rings = [a for a in range(len(pq)) if is_ring(q, k, pq[a], pk[a])]
    if not rings:
        return True
    seq_q, seq_k = len(q.shape) - 2, len(k.shape) - 2
    others = [a for a in range(len(pq)) if a not in rings]
    splits = any(isinstance(pq[a], Shard) and pq[a].dim == seq_q for a in others) or any(
        isinstance(pk[a], Shard) and pk[a].dim == seq_k for a in others
    )
    return len(rings) == 1 and not splits


def attention_form(ins: list[TensorType], placements: tuple, axis: int) -> str | None:
    """The form of context parallelism an attention strategy (its inputs' placements on every axis) takes on mesh
    axis ``axis`` (``ShardOptions.context_attention``): "ring" where it splits the queries and keys on the
    sequence there, "all-gather" where it splits the queries only, "ulysses" where it splits them on the heads
    (reached from the sequence split by an all-to-all, ``ir/layout.py``), None otherwise."""
    if len(ins) < 3 or placements[0] is None or placements[1] is None:
        return None
    q, k = ins[0], ins[1]
    pq, pk = placements[0][axis], placements[1][axis]
    if len(q.shape) >= 3 and pq == Shard(len(q.shape) - 3) and pk == Shard(len(k.shape) - 3):
        return "ulysses"
    if pq != Shard(len(q.shape) - 2):
        return None
    return "ring" if is_ring(q, k, pq, pk) else "all-gather"


def _sdpa(c: Ctx) -> list[OneD]:
    return reductions.RULES["aten.scaled_dot_product_attention"](c) + query_sequence(c) + ring(c)


RULES: dict[str, Rule] = {"aten.scaled_dot_product_attention": _sdpa}
