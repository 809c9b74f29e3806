"""Stage layouts of the search: the profile's units [pre, layer 0..L-1, post] cut into S contiguous stages.

``balanced_layout`` minimizes the largest stage's forward FLOPs (a bisection on the bottleneck; later
stages are filled first, since the first stages hold more microbatches in flight); ``even_layout`` is
Megatron's, L / S layers per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

Layout = tuple[tuple[int, int], ...]  # unit range [start, stop) of each stage


def balanced_layout(flops: Sequence[float], stages: int) -> Layout | None:
    """Contiguous ranges of the units (forward FLOPs ``flops``) minimizing the largest stage's FLOPs;
    None when there are more stages than units."""
    w, n = list(flops), len(flops)
    if stages > n:
        return None
    lo, hi = max(w), sum(w)
    for _ in range(100):  # bisection on the bottleneck
        mid = (lo + hi) / 2
        if _parts(w, mid) <= stages:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    cap = hi
    out: list[tuple[int, int]] = []
    stop = n
    for s in range(stages - 1, -1, -1):
        start, total = stop, 0.0
        while start > s and total + w[start - 1] <= cap * (1 + 1e-12):
            start -= 1
            total += w[start]
        if s == 0:
            start = 0
        out.append((start, stop))
        stop = start
    out.reverse()
    if any(a >= b for a, b in out):
        return None
    return tuple(out)


def even_layout(is_layer: Sequence[bool], stages: int) -> Layout | None:
    """Megatron's: L / S layers per stage, the pre units on the first, the post units on the last;
    None when S does not divide L."""
    layers = [i for i, x in enumerate(is_layer) if x]
    L = len(layers)
    if L % stages or not layers:
        return None
    k = L // stages
    cuts = [0] + [layers[s * k] for s in range(1, stages)] + [len(is_layer)]
    return tuple((cuts[s], cuts[s + 1]) for s in range(stages))


def _parts(w: Sequence[float], cap: float) -> int:
    """Contiguous runs needed so that each sums to at most ``cap`` (inf if one item exceeds it)."""
    parts, total = 1, 0.0
    for v in w:
        if v > cap * (1 + 1e-12):
            return 1 << 30
        if total + v > cap * (1 + 1e-12):
            parts += 1
            total = v
        else:
            total += v
    return parts


__all__ = ["Layout", "balanced_layout", "even_layout"]
