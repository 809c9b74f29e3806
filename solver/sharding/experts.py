"""Expert parallelism in the strategy problem: which gathers are expert-parallel, and their price.

A mixture-of-experts block gathers rows of its expert tables by the router's choice: Hugging Face's
``batched_mm`` kernel lowers to ``aten.index.Tensor(W, [idx])`` with ``W[E, out, in]`` the stacked
experts and ``idx[N]`` the expert of each (token, slot) row, then multiplies each gathered matrix with its
row. A gather is *expert-parallel* on a mesh axis when its table is split over the axis on the expert dim
(``S(0)``) and its indices by rows (``S(0)``): each rank holds E/n experts, and the rows are sent to the
rank that owns their expert, computed there and sent back (``passes/experts.py`` writes the dispatch and
combine into the program, ``runtime/comm/all_to_all.py`` runs them). The rule offering the strategy is in
``solver/sharding/rules/experts.py``; this module prices it for ``CostModel.inherent``.

The price is an estimate made before the router has seen a token:

- **what moves.** Each expert-parallel gather is priced as the all-to-all of its rows at the table's last
  width (``W.shape[-1]``: the vector the gathered matrix multiplies), forward and again in the backward
  (the gradient of an all-to-all is the inverse one). An expert MLP has two tables, gate/up with last width
  the hidden size h and down with the intermediate size i, gathered by one routing: their prices sum to
  2 x rows x (h + i) where the block moves 4 x rows x h (hidden rows dispatched and combined, forward and
  backward) plus the router's indices and weights. The estimate is exact when i equals h, over-prices
  wider experts and under-prices narrower ones; pricing each gather a dispatch and a combine of its own
  would count the block's one dispatch and one combine twice.
- **an expert block moves its rows once.** transformers' ``grouped_mm`` kernel runs an expert MLP as two
  grouped matmuls (gate/up, down) over the same sorted rows and offsets, the activation row by row between
  them. ``passes/experts.py`` dispatches the rows once before gate/up and combines them once after down
  (``mark_expert_blocks`` marks the pair on the lowered program, ``attrs["ep_block"]``): the first grouped
  matmul is priced the dispatch of its rows at its input width K, the last the combine of its result at
  its output width N, each forward and again backward (``ALL_TO_ALLS_PER_GROUPED_MM`` per side); a grouped
  matmul of no block both. In the program the exchanges are ops of their own
  (``expert_grouped_dispatch``, ``expert_grouped_combine``), priced the same, and the grouped matmuls
  reading dispatched rows (``attrs["ep_rows"]``) nothing. The ILP's price assumes the plan keeps the rows
  between the two on the expert axis alone; where it reshards them there (a tensor-parallel split of the
  rows between), the program combines and dispatches again and ``CostModel.program_comm`` prices that.
- **the busiest rank, not the mean.** A rank's send buffer is its own rows; what it receives depends on
  the router. Priced is the busiest rank's rows (``busiest_rows``): under uniform routing the rows arriving
  at a rank are Binomial(N, 1/n) over the N rows of the whole axis, whose maximum over n ranks is about
  ``mu + sigma sqrt(2 ln n)``; a skewed router sends the busiest rank ``imbalance`` times the mean
  (``TrainingSetup.router_imbalance``, default ``DEFAULT_IMBALANCE`` = 1: uniform routing, what an auxiliary
  balancing loss aims at), so the busiest rank holds ``min(N, imbalance mu + sigma sqrt(2 ln n))`` rows.
  A grouped matmul's experts' computation is priced at the rows of its busiest rank too (``expert_load``,
  read by ``CostModel.op_seconds``); the batched_mm kernel's matmuls after the gather are priced at the mean.
- **a capacity caps the busiest rank.** With a capacity factor c (``TrainingSetup.capacity_factor``; GShard's
  and Switch's, ``passes/experts.py`` ``set_capacity``) each expert keeps at most c times its mean rows and the
  rows over it are dropped before the dispatch: a rank's E/n experts take at most c times the rank's mean, so
  the busiest rank's rows are ``min(imbalance mu + sigma sqrt(2 ln n), c mu, N)`` (``busiest_rows``), the
  router's skew priced at ``min(imbalance, c)``. Only grouped matmuls take a capacity (the batched_mm
  gather is dropless): its exchanges and computation are priced so. Not priced: a dropped row still takes its
  place in the sorted order, so the rows after it shift into the next blocks (what crosses is priced at the
  capped rows, as if the blocks were cut at the kept rows).
- **what crosses the links.** Of the busiest rank's rows, those that were already on it do not move
  (``expert_rows``). The gather's rows are in token order, each from a uniformly random rank: (n-1)/n of
  them arrive from others. A grouped matmul's rows are sorted by expert over the whole batch and split in
  contiguous blocks (``runtime/comm/all_to_all.py``, ``grouped_routing``): under balanced routing block b
  holds the rows of the experts of the b-th slice of the sorted order (``block_owners``), so with the expert
  axis the outermost of the rows' axes every rank's block is of its own experts: it keeps them all and
  receives only the rows beyond its block, ``busiest - local`` (the router's imbalance and its sampling
  noise). With the expert axis inside another rows axis (dp outer), the blocks of one expert group are of a
  few ranks' experts: those ranks receive (and compute) the group's rows, the others send theirs; and the
  busiest expert rank's rows beyond its slice of the sorted order lie in one group's blocks, so they scale
  with all the rows, not one group's (``expert_rows``). Measured against the runtime's own split sizes
  (``tests/test_expert_pricing.py``) on 2, 4 and 8 ranks and both 2 x 2 layouts, with and without skew, the
  estimate is within 0.8-1.6 of the mean of the busiest rank's rows from others.
  Pricing every row as crossing (the gather's rule) made a grouped expert split cost more than splitting
  the experts' widths, which moves whole activations, so the ILP never chose it (tests/test_expert_parallel.py,
  ``test_free_ilp_splits_the_grouped_experts_over_ep``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

from autopar.ir.axes import is_expert_axis
from autopar.ir.core import MeshSpec, Placement, Shard, TensorType

INF = float("inf")

EXPERT_GATHER = "aten.index.Tensor"
# transformers' default experts kernel (grouped_mm): ``x[S, K]`` rows sorted by expert, ``w[E, K, N]``, ``offs[E]``
# the groups' cumulative row ends; expert-parallel when ``w`` is split on its experts and ``x`` by rows, its
# rows then sent to their experts' ranks and back around its expert block (``passes/experts.py``,
# ``runtime/comm/all_to_all.py``): these are the op names other passes read (batch coupling, codegen)
EXPERT_GROUPED_MM = frozenset({"aten._grouped_mm", "transformers.grouped_mm_fallback"})
# an expert block's exchanges as ops of the program (passes/experts.py, runtime/comm/all_to_all.py)
GROUPED_DISPATCH, GROUPED_COMBINE = "expert_grouped_dispatch", "expert_grouped_combine"
# op attributes: a grouped matmul's place in its expert block (first, inner, last; none: alone), and
# ``ep_rows=dispatched`` on one that reads rows an expert_grouped_dispatch sent
EP_BLOCK, EP_ROWS = "ep_block", "ep_rows"
# all-to-alls per step of one exchange of an expert block's rows (its dispatch, or its combine): forward and
# the inverse one backward; a grouped matmul alone runs both exchanges (4), the first of a block the dispatch,
# the last the combine (2 each)
ALL_TO_ALLS_PER_GROUPED_MM = 2
_SIDES = {None: ("in", "out"), "first": ("in",), "last": ("out",), "inner": ()}


def exchange_sides(block: str | None) -> tuple[str, ...]:
    """The exchanges a grouped matmul at place ``block`` of its expert block (``attrs["ep_block"]``) runs: "in"
    (its rows dispatched), "out" (its results combined), both for one alone, none inside a block."""
    return _SIDES[block]


# all-to-alls of the gather's rows priced per step: forward and backward (the module docstring)
ALL_TO_ALLS_PER_GATHER = 2
# the busiest rank's expected rows over the mean that the router's skew adds (1: uniform routing)
DEFAULT_IMBALANCE = 1.0


def expert_axes(in_types: list[TensorType], in_placements) -> list[int]:
    """The mesh axes on which ``aten.index.Tensor(table, [idx])`` read at ``in_placements`` is expert-parallel:
    the table split on its expert dim (0) and the indices, one row dim, split by rows."""
    if len(in_types) != 2 or in_placements is None or any(p is None for p in in_placements):
        return []
    table, idx = in_placements
    if len(in_types[1].shape) != 1 or len(in_types[0].shape) < 2:
        return []
    return [a for a, (p, q) in enumerate(zip(table, idx)) if _rows(p) and _rows(q)]


def grouped_expert_axes(in_types: list[TensorType], in_placements) -> list[int]:
    """The mesh axes on which a grouped matmul ``(x[S, K], w[E, K, N], offs[E])`` read at ``in_placements`` is
    expert-parallel: ``w`` split on its expert dim, ``x`` by rows in contiguous blocks, ``offs`` whole."""
    if len(in_types) != 3 or in_placements is None or any(p is None for p in in_placements):
        return []
    if len(in_types[0].shape) != 2 or len(in_types[1].shape) != 3 or len(in_types[2].shape) != 1:
        return []
    x, w, offs = in_placements
    return [a for a, (p, q, o) in enumerate(zip(x, w, offs)) if _rows(p) and _rows(q) and not isinstance(o, Shard)]


def grouped_price(
    in_types: list[TensorType],
    in_placements,
    mesh: MeshSpec,
    terms: Callable[[int], tuple[float, float]],
    imbalance: float = DEFAULT_IMBALANCE,
    attrs: dict | None = None,
    capacity: float | None = None,
) -> tuple[float, float]:
    """(bytes, seconds) per device of an expert-parallel grouped matmul's all-to-alls (0 where it is none): by
    its place in its expert block (``attrs["ep_block"]``, the module docstring), the dispatch of its rows at
    the local width K and the combine of its result at the local width N, each ``ALL_TO_ALLS_PER_GROUPED_MM``
    (forward, backward) at the busiest rank's rows that cross the links (``expert_rows``, under the
    ``capacity`` factor where there is one); the counts need no exchange (the offsets are whole on every rank).
    None when it reads dispatched rows (``attrs["ep_rows"]``: the program's dispatch and combine ops are priced,
    ``grouped_exchange_price``). Impossible (``INF``) on an axis that is no expert axis. ``terms(axis)``: the
    axis's all-to-all (seconds per byte of a buffer, latency) on the cluster."""
    attrs = attrs or {}
    axes = grouped_expert_axes(in_types, in_placements)
    if any(not is_expert_axis(mesh.names[a]) for a in axes):
        return INF, INF
    if attrs.get(EP_ROWS):
        return 0.0, 0.0
    x, w, _ = in_types
    xp, wp, _ = in_placements
    sizes = mesh.sizes
    sides = _SIDES[attrs.get(EP_BLOCK)]
    width = 0.0
    if "in" in sides:  # the rows dispatched at K
        width += x.shape[1] / _ways(xp, sizes, 1)
    if "out" in sides:  # the results combined at N
        width += w.shape[2] / _ways(wp, sizes, 2)
    vol = sec = 0.0
    for a in axes:
        v, t = _exchanges(
            len(sides),
            x.shape[0] / _ways(xp, sizes, 0),
            xp,
            width,
            x.itemsize,
            sizes,
            a,
            terms(a),
            imbalance,
            capacity,
        )
        vol, sec = vol + v, sec + t
    return vol, sec


def grouped_exchange_price(
    in_types: list[TensorType],
    mesh: MeshSpec,
    axis: str,
    terms: Callable[[int], tuple[float, float]],
    imbalance: float = DEFAULT_IMBALANCE,
    capacity: float | None = None,
) -> tuple[float, float]:
    """(bytes, seconds) per device of an ``expert_grouped_dispatch`` or ``expert_grouped_combine`` of rows
    ``in_types[0]`` on ``axis``: ``ALL_TO_ALLS_PER_GROUPED_MM`` all-to-alls (forward, backward) of the busiest
    rank's rows that cross the links at the rows' local width, what ``grouped_price`` prices for that side of
    the block."""
    a = mesh.index(axis)
    x = in_types[0]
    p = x.placements
    local_rows, width = x.shape[0] / _ways(p, mesh.sizes, 0), x.shape[1] / _ways(p, mesh.sizes, 1)
    return _exchanges(1, local_rows, p, width, x.itemsize, mesh.sizes, a, terms(a), imbalance, capacity)


def _exchanges(
    count: int,
    local_rows: float,
    placements: tuple,
    width: float,
    itemsize: int,
    sizes: tuple[int, ...],
    axis: int,
    terms: tuple[float, float],
    imbalance: float,
    capacity: float | None = None,
) -> tuple[float, float]:
    """(bytes, seconds) of ``count`` exchanges of an expert block's rows on ``axis``, ``ALL_TO_ALLS_PER_GROUPED_MM``
    all-to-alls each, of rows ``local_rows`` on each rank placed ``placements``, at ``width`` elements a row in
    all (the exchanges' widths summed): the busiest rank's rows from others (``expert_rows``)."""
    per_byte, latency = terms
    crossing = expert_rows(local_rows, placements, sizes, axis, imbalance, capacity)[1] * width * itemsize
    k = ALL_TO_ALLS_PER_GROUPED_MM
    return k * crossing, k * (crossing * _per_link_byte(per_byte, sizes[axis]) + count * latency)


@functools.lru_cache(maxsize=4096)
def block_owners(placements: tuple, sizes: tuple[int, ...], axis: int) -> tuple[tuple[int, bool], ...]:
    """Per rank of the mesh axes holding a grouped matmul's rows placed ``placements`` (sorted by expert, split in
    contiguous blocks over the mesh axes splitting dim 0, outer first, as ``grouped_routing`` numbers them):
    under balanced routing, how many blocks of its group on ``axis`` hold rows of its own experts, and whether its
    own block is one. Block b of B holds the b-th slice of the sorted order, the experts of rank ``b n // B``;
    with ``axis`` the outermost rows axis every rank's block is its own (``(1, True)`` each), with ``axis``
    inside another, one rank of each group holds the rows of several blocks and another none."""
    row_axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if axis not in row_axes:
        return ()
    blocks, n, j = math.prod(sizes[a] for a in row_axes), sizes[axis], row_axes.index(axis)

    def owner(coords) -> int:
        b = 0
        for a, c in zip(row_axes, coords):
            b = b * sizes[a] + c
        return b * n // blocks

    out = []
    for coords in itertools.product(*(range(sizes[a]) for a in row_axes)):
        group = [owner((*coords[:j], i, *coords[j + 1 :])) for i in range(n)]
        out.append((group.count(coords[j]), owner(coords) == coords[j]))
    return tuple(out)


def expert_rows(
    local_rows: float,
    placements: tuple,
    sizes: tuple[int, ...],
    axis: int,
    imbalance: float = DEFAULT_IMBALANCE,
    capacity: float | None = None,
) -> tuple[float, float]:
    """(the most rows one rank of an expert axis computes, the most it receives from the other ranks of the axis)
    for a grouped matmul whose ranks each hold ``local_rows`` rows placed ``placements``, sorted by expert over
    all of them. Under balanced routing a rank computes the rows of the blocks of its group that hold its
    experts' slice of the sorted order (``block_owners``); the busiest expert rank's rows beyond its slice,
    ``busiest_rows`` of all the rows less their mean, lie in the blocks after it and are priced as reaching one
    rank; a rank holds at most its group's rows, and receives all but its own block's."""
    n = sizes[axis]
    owners = block_owners(placements, sizes, axis)
    rows = local_rows * len(owners)  # every block's rows, over the whole mesh
    excess = busiest_rows(round(rows), n, imbalance, capacity) - rows / n
    load = crossing = 0.0
    for k, kept in owners:
        held = min(n * local_rows, k * local_rows + excess)
        load, crossing = max(load, held), max(crossing, held - local_rows * kept)
    return load, crossing


def expert_load(
    target: str,
    in_types: list[TensorType],
    in_placements,
    sizes: tuple[int, ...],
    imbalance: float = DEFAULT_IMBALANCE,
    capacity: float | None = None,
) -> float:
    """How many times the mean rank's share of an op's computation its busiest rank computes: for an
    expert-parallel grouped matmul, the most rows one rank's experts take (``expert_rows``) over the rows each
    rank holds, on each expert axis; 1 for any other op."""
    if target not in EXPERT_GROUPED_MM:
        return 1.0
    load = 1.0
    for a in grouped_expert_axes(in_types, in_placements):
        local_rows = in_types[0].shape[0] / _ways(in_placements[0], sizes, 0)
        if local_rows:
            load *= expert_rows(local_rows, in_placements[0], sizes, a, imbalance, capacity)[0] / local_rows
    return load


def _per_link_byte(per_byte: float, n: int) -> float:
    """Seconds per byte crossing the links, from an all-to-all's seconds per byte of a rank's whole buffer
    (``ClusterSpec.collective_terms``: (n-1)/n of a buffer leaves the rank)."""
    return per_byte * n / (n - 1) if n > 1 else 0.0


def _rows(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0 and p.chunks == 1


def busiest_rows(rows: int, n: int, imbalance: float = DEFAULT_IMBALANCE, capacity: float | None = None) -> float:
    """Expected rows of the busiest of n ranks when ``rows`` rows go to their experts' ranks: ``imbalance``
    times the mean N/n (the router's skew; 1: each row to a uniformly random rank) plus sqrt(2 ln n) standard
    deviations of Binomial(N, 1/n) (the sampling noise), at most N; with a ``capacity`` factor c at most c times
    the mean (each expert keeps c times its mean rows, the rest dropped: the module docstring)."""
    if imbalance < 1:
        raise ValueError(f"a router imbalance of {imbalance} is below 1: the busiest rank holds at least the mean")
    if capacity is not None and not capacity > 0:
        raise ValueError(f"a capacity factor of {capacity} is not positive (None: dropless)")
    mean = rows / max(n, 1)
    cap = float(rows) if capacity is None else min(float(rows), capacity * mean)
    if n <= 1:
        return cap
    sigma = math.sqrt(rows * (1 / n) * (1 - 1 / n))
    return min(cap, imbalance * mean + sigma * math.sqrt(2 * math.log(n)))


def dispatch_bytes(
    table: TensorType,
    idx: TensorType,
    placements: tuple,
    sizes: tuple[int, ...],
    axis: int,
    imbalance: float = DEFAULT_IMBALANCE,
) -> float:
    """Bytes of one all-to-all of an expert-parallel gather's rows on ``axis`` at the busiest rank, for the
    table and indices read at ``placements`` (one tuple per mesh axis each): the axis's rows (the indices'
    local length times the axis size) at the table's local last width."""
    table_p, idx_p = placements
    local_rows = idx.shape[0] / _ways(idx_p, sizes, 0)
    width = table.shape[-1] / _ways(table_p, sizes, len(table.shape) - 1)
    return busiest_rows(round(local_rows * sizes[axis]), sizes[axis], imbalance) * width * table.itemsize


def gather_price(
    in_types: list[TensorType],
    in_placements,
    mesh: MeshSpec,
    terms: Callable[[int], tuple[float, float]],
    imbalance: float = DEFAULT_IMBALANCE,
) -> tuple[float, float]:
    """(bytes, seconds) per device of an expert-parallel gather's all-to-alls (0 where it is none):
    ``ALL_TO_ALLS_PER_GATHER`` of ``dispatch_bytes`` on its expert axis ((n-1)/n of them crossing the links:
    rows in token order come from every rank alike), each also paying the latency of the exchange of counts
    before it; impossible (``INF``) on an axis that is no expert axis (``ir/axes.py``).
    ``terms(axis)``: the axis's all-to-all (seconds per byte, latency) on the cluster."""
    axes = expert_axes(in_types, in_placements)
    if any(not is_expert_axis(mesh.names[a]) for a in axes):
        return INF, INF
    sizes = mesh.sizes
    vol = sec = 0.0
    for a in axes:
        n = sizes[a]
        nbytes = dispatch_bytes(in_types[0], in_types[1], in_placements, sizes, a, imbalance)
        per_byte, latency = terms(a)
        vol += ALL_TO_ALLS_PER_GATHER * nbytes * (n - 1) / n
        sec += ALL_TO_ALLS_PER_GATHER * (nbytes * per_byte + 2 * latency)
    return vol, sec


def _ways(placements: tuple, sizes: tuple[int, ...], dim: int) -> int:
    """Into how many pieces ``placements`` cut tensor dim ``dim``."""
    return math.prod(n for p, n in zip(placements, sizes) if isinstance(p, Shard) and p.dim == dim)


__all__ = [
    "ALL_TO_ALLS_PER_GATHER",
    "DEFAULT_IMBALANCE",
    "ALL_TO_ALLS_PER_GROUPED_MM",
    "EXPERT_GATHER",
    "EP_BLOCK",
    "EP_ROWS",
    "EXPERT_GROUPED_MM",
    "GROUPED_COMBINE",
    "GROUPED_DISPATCH",
    "grouped_exchange_price",
    "grouped_expert_axes",
    "grouped_price",
    "busiest_rows",
    "dispatch_bytes",
    "expert_axes",
    "expert_load",
    "gather_price",
    "block_owners",
    "exchange_sides",
    "expert_rows",
]
