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
- **the busiest rank, not the mean.** A rank's send buffer is its own rows; what it receives depends on
  the router. Priced is the busiest rank's receive under uniform routing: rows arriving at a rank are
  Binomial(N, 1/n) over the N rows of the whole axis, whose maximum over n ranks is about
  ``mu + sigma sqrt(2 ln n)`` (``busiest_rows``). A trained router is usually less balanced; an
  auxiliary balancing loss keeps it near this.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from autopar.ir.axes import is_expert_axis
from autopar.ir.core import MeshSpec, Placement, Shard, TensorType

INF = float("inf")

EXPERT_GATHER = "aten.index.Tensor"
# transformers' default experts kernel (grouped_mm): ``x[S, K]`` rows sorted by expert, ``w[E, K, N]``, ``offs[E]``
# the groups' cumulative row ends; expert-parallel when ``w`` is split on its experts and ``x`` by rows, the
# op then sending its rows to their experts' ranks and back inside itself (``runtime/comm/all_to_all.py``,
# ``expert_grouped_mm``): these are the op names other passes read (batch coupling, codegen)
EXPERT_GROUPED_MM = frozenset({"aten._grouped_mm", "transformers.grouped_mm_fallback"})
# all-to-alls of an expert-parallel grouped matmul per step: its rows there and back, forward and backward
ALL_TO_ALLS_PER_GROUPED_MM = 4
# all-to-alls of the gather's rows priced per step: forward and backward (the module docstring)
ALL_TO_ALLS_PER_GATHER = 2


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
    in_types: list[TensorType], in_placements, mesh: MeshSpec, terms: Callable[[int], tuple[float, float]]
) -> tuple[float, float]:
    """(bytes, seconds) per device of an expert-parallel grouped matmul's all-to-alls (0 where it is none): its
    rows sent to their experts' ranks at the local width K and the results back at the local width N, forward,
    and their gradients the other way in the backward (``ALL_TO_ALLS_PER_GROUPED_MM``), each at the busiest
    rank's rows (``busiest_rows``); the counts need no exchange (the offsets are whole on every rank).
    Impossible (``INF``) on an axis that is no expert axis."""
    axes = grouped_expert_axes(in_types, in_placements)
    if any(not is_expert_axis(mesh.names[a]) for a in axes):
        return INF, INF
    x, w, _ = in_types
    xp, wp, _ = in_placements
    sizes = mesh.sizes
    vol = sec = 0.0
    for a in axes:
        n = sizes[a]
        local_rows = x.shape[0] / _ways(xp, sizes, 0)
        width = x.shape[1] / _ways(xp, sizes, 1) + w.shape[2] / _ways(wp, sizes, 2)  # there (K) and back (N)
        nbytes = busiest_rows(round(local_rows * n), n) * width * x.itemsize
        per_byte, latency = terms(a)
        vol += 2 * nbytes * (n - 1) / n
        sec += 2 * nbytes * per_byte + ALL_TO_ALLS_PER_GROUPED_MM * latency
    return vol, sec


def _rows(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0 and p.chunks == 1


def busiest_rows(rows: int, n: int) -> float:
    """Expected rows of the busiest of n ranks when ``rows`` rows each go to a uniformly random rank:
    mean N/n plus sqrt(2 ln n) standard deviations of Binomial(N, 1/n), at most N."""
    if n <= 1:
        return float(rows)
    mean = rows / n
    sigma = math.sqrt(rows * (1 / n) * (1 - 1 / n))
    return min(float(rows), mean + sigma * math.sqrt(2 * math.log(n)))


def dispatch_bytes(table: TensorType, idx: TensorType, placements: tuple, sizes: tuple[int, ...], axis: int) -> float:
    """Bytes of one all-to-all of an expert-parallel gather's rows on ``axis`` at the busiest rank, for the
    table and indices read at ``placements`` (one tuple per mesh axis each): the axis's rows (the indices'
    local length times the axis size) at the table's local last width."""
    table_p, idx_p = placements
    local_rows = idx.shape[0] / _ways(idx_p, sizes, 0)
    width = table.shape[-1] / _ways(table_p, sizes, len(table.shape) - 1)
    return busiest_rows(round(local_rows * sizes[axis]), sizes[axis]) * width * table.itemsize


def gather_price(
    in_types: list[TensorType], in_placements, mesh: MeshSpec, terms: Callable[[int], tuple[float, float]]
) -> tuple[float, float]:
    """(bytes, seconds) per device of an expert-parallel gather's all-to-alls (0 where it is none):
    ``ALL_TO_ALLS_PER_GATHER`` of ``dispatch_bytes`` on its expert axis, each also paying the latency of the
    exchange of counts before it; impossible (``INF``) on an axis that is no expert axis (``ir/axes.py``).
    ``terms(axis)``: the axis's all-to-all (seconds per byte, latency) on the cluster."""
    axes = expert_axes(in_types, in_placements)
    if any(not is_expert_axis(mesh.names[a]) for a in axes):
        return INF, INF
    sizes = mesh.sizes
    vol = sec = 0.0
    for a in axes:
        n = sizes[a]
        nbytes = dispatch_bytes(in_types[0], in_types[1], in_placements, sizes, a)
        per_byte, latency = terms(a)
        vol += ALL_TO_ALLS_PER_GATHER * nbytes * (n - 1) / n
        sec += ALL_TO_ALLS_PER_GATHER * (nbytes * per_byte + 2 * latency)
    return vol, sec


def _ways(placements: tuple, sizes: tuple[int, ...], dim: int) -> int:
    """Into how many pieces ``placements`` cut tensor dim ``dim``."""
    return math.prod(n for p, n in zip(placements, sizes) if isinstance(p, Shard) and p.dim == dim)


__all__ = [
    "ALL_TO_ALLS_PER_GATHER",
    "ALL_TO_ALLS_PER_GROUPED_MM",
    "EXPERT_GATHER",
    "EXPERT_GROUPED_MM",
    "grouped_expert_axes",
    "grouped_price",
    "busiest_rows",
    "dispatch_bytes",
    "expert_axes",
    "gather_price",
]
