"""Stage layouts of the search: the profile's units [pre, layer 0..L-1, post] cut into S contiguous stages.

``balanced_layout`` minimizes the largest stage's forward FLOPs, the bottleneck found exactly by the stage
balancer's own partition (``solver/stages/partition.min_max_partition``); among the layouts that reach it, it takes
the one that fills later stages first, since the first stages hold more microbatches in flight (the
partition's own choice fills the earlier ones). ``even_layout`` is Megatron's, L / S layers per stage.

``balanced_v_layout`` (``solver/stages/v_layout.py``, shared with the flow's stage balancer) is for the V
placements (a wave with W = 1, ZB-V, DualPipeV): it minimizes the largest *rank's* FLOPs, the two
stages of a rank together. It takes seconds at pp = 64 (a bisection of sweeps over every middle), so the search
keeps each one on disk (``kept_v_layout``, ``kept.py``), keyed by the units' FLOPs, pp and the code.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.search.kept import kept
from autopar.solver.stages.partition import min_max_partition
from autopar.solver.stages.v_layout import Layout, balanced_v_layout


def balanced_layout(flops: Sequence[float], stages: int) -> Layout | None:
    """Contiguous ranges of the units (forward FLOPs ``flops``) minimizing the largest stage's FLOPs;
    None when there are more stages than units."""
    w, n = list(flops), len(flops)
    if stages > n:
        return None
    prefix = [0.0]
    for v in w:
        prefix.append(prefix[-1] + v)
    cap, _ = min_max_partition(n, stages, lambda s, j, i: prefix[i] - prefix[j])
    out: list[tuple[int, int]] = []
    stop = n
    for s in range(stages - 1, -1, -1):  # each stage from the last takes as many units as fit under the cap
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


def kept_v_layout(flops: Sequence[float], pp: int) -> Layout | None:
    """``balanced_v_layout(flops, pp)``, kept on disk (``kept.py``, ``cache_dir("layouts")``) by FLOPs and pp."""
    w = [float(f) for f in flops]
    return kept(
        "layouts", f"v-{pp}", (w, pp), lambda: balanced_v_layout(w, pp),
        lambda v: None if v is None else tuple((a, b) for a, b in v),
    )  # fmt: skip


__all__ = ["Layout", "balanced_layout", "balanced_v_layout", "even_layout", "kept_v_layout"]
