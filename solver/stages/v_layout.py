"""The V placement's balance (a wave with W = 1, ZB-V, DualPipeV: rank r holds stages r and 2P - 1 - r):
contiguous stages minimizing the largest *rank's* load, the two stages together, since a rank runs both of
its chunks for every microbatch and the slowest rank, not the slowest stage, sets the period. Balancing
each stage gives every stage 1/2P of the work only where the units allow it; with uneven units (a heavy
head or embedding) it can load one rank with two heavy stages (``tests/test_zero_bubble.py``). The search
(``autopar/search/stage_layout.py``) and the flow's stage balancer (``solver/stages/balance.py``) both use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Layout = tuple[tuple[int, int], ...]  # unit range [start, stop) of each stage


def balanced_v_layout(flops: Sequence[float], pp: int) -> Layout | None:
    """Contiguous ranges of the units for 2 ``pp`` stages in a V (rank r: stages r and 2 pp - 1 - r)
    minimizing the largest rank's FLOPs, and among those the largest stage's; None when there are more
    stages than units.

    Exact, by bisection on the caps: a sweep from the outermost rank inwards over the middles [i, j)
    still to cut (rank r takes [i0, i) and [j, j0)) marks the middles reachable with every rank so far
    within the rank cap and every stage within the stage cap: a range minimum of the outer middles'
    FLOPs over i0 in [a(i), i) and j0 in (j, b(j)] (sparse tables), O(pp n^2 log n) a sweep."""
    w, n = [float(v) for v in flops], len(flops)
    if 2 * pp > n:
        return None
    pre = np.concatenate([[0.0], np.cumsum(w)])
    span = pre[None, :] - pre[:, None]  # span[i, j]: FLOPs of units [i, j)
    total = float(pre[-1])
    rank_cap = _least(lambda c: _v_sweep(span, pre, pp, c, total), max(w), total)
    stage_cap = _least(lambda d: _v_sweep(span, pre, pp, rank_cap, d), max(w), rank_cap)
    levels = _v_sweep(span, pre, pp, rank_cap, stage_cap)
    assert levels is not None
    return _v_cuts(span, pre, levels, pp, rank_cap, stage_cap)


def _least(feasible, lo: float, hi: float) -> float:
    """The least cap in [lo, hi] (to float precision) for which ``feasible(cap)`` is not None."""
    hi *= 1 + 1e-12
    lo *= 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if feasible(mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _window_min(val: np.ndarray, lo: np.ndarray, hi: np.ndarray, axis: int) -> np.ndarray:
    """Along ``axis``, the minimum of ``val`` over the index window [lo[k], hi[k]] for every k (inf if empty)."""
    v = val if axis == 0 else val.T
    n = v.shape[0]
    tables = [v]
    while 2 ** len(tables) <= n:
        t, h = tables[-1], 2 ** (len(tables) - 1)
        tables.append(np.minimum(t[:-h], t[h:]))
    size = np.maximum(hi - lo + 1, 1)
    k = np.floor(np.log2(size)).astype(int)
    out = np.full(v.shape, np.inf)
    for e in np.unique(k):
        rows = np.nonzero((k == e) & (hi >= lo))[0]
        t = tables[e]
        out[rows] = np.minimum(t[lo[rows]], t[hi[rows] - 2**e + 1])
    return out if axis == 0 else out.T


def _stage_windows(pre: np.ndarray, stage_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """a(i), the least i0 with [i0, i) within ``stage_cap``, and b(j), the most j0 with [j, j0) within it."""
    cap = stage_cap * (1 + 1e-12)
    return np.searchsorted(pre, pre - cap, side="left"), np.searchsorted(pre, pre + cap, side="right") - 1


def _v_sweep(span: np.ndarray, pre: np.ndarray, pp: int, cap: float, stage_cap: float) -> list[np.ndarray] | None:
    """Per rank r (0..pp-1), the boolean matrix of middles [i, j) reachable with every rank before r within
    ``cap`` and every stage within ``stage_cap``; None when the innermost rank cannot take its middle."""
    n = span.shape[0] - 1
    idx = np.arange(n + 1)
    first, last = _stage_windows(pre, stage_cap)
    reach = np.zeros((n + 1, n + 1), dtype=bool)
    reach[0, n] = True
    levels = [reach]
    for r in range(pp - 1):
        val = np.where(reach, span, np.inf)
        over_j = _window_min(val, idx + 1, np.minimum(last, n), axis=1)  # [i0, j]: j0 in (j, b(j)]
        g = _window_min(over_j, first, idx - 1, axis=0)  # [i, j]: i0 in [a(i), i)
        room = idx[None, :] - idx[:, None] >= 2 * (pp - 1 - r)  # enough units left for the inner stages
        reach = room & (g - np.where(room, span, 0.0) <= cap * (1 + 1e-12))
        if not reach.any():
            return None
        levels.append(reach)
    return levels if _innermost(span, levels[-1], cap, stage_cap).any() else None


def _innermost(span: np.ndarray, reach: np.ndarray, cap: float, stage_cap: float) -> np.ndarray:
    """Middles the innermost rank can take whole, cut into two stages within ``stage_cap``."""
    n = span.shape[0] - 1
    idx = np.arange(n + 1)
    ok = reach & (idx[None, :] - idx[:, None] >= 2) & (span <= cap * (1 + 1e-12))
    for i, j in np.argwhere(ok):
        ok[i, j] = bool(np.any(np.maximum(span[i, i + 1 : j], span[i + 1 : j, j]) <= stage_cap * (1 + 1e-12)))
    return ok


def _v_cuts(
    span: np.ndarray, pre: np.ndarray, levels: list[np.ndarray], pp: int, cap: float, stage_cap: float
) -> Layout:
    """The stages of one V layout within both caps, traced back from the innermost rank outwards."""
    n, tol = span.shape[0] - 1, 1 + 1e-12
    first, last = _stage_windows(pre, stage_cap)
    i, j = (int(x) for x in np.argwhere(_innermost(span, levels[-1], cap, stage_cap))[0])
    mid = i + 1 + int(np.argmin(np.maximum(span[i, i + 1 : j], span[i + 1 : j, j])))
    left, right = [i], [j]
    for r in range(pp - 2, -1, -1):  # rank r's outer cuts: a reachable (i0, j0) around (i, j) within the caps
        i0, j0 = next(
            (a, b)
            for a in range(i)
            for b in range(n, j, -1)
            if levels[r][a, b] and span[a, b] - span[i, j] <= cap * tol and first[i] <= a and b <= last[j]
        )
        left.append(i0)
        right.append(j0)
        i, j = i0, j0
    cuts = left[::-1] + [mid] + right
    return tuple((cuts[s], cuts[s + 1]) for s in range(2 * pp))


__all__ = ["Layout", "balanced_v_layout"]
