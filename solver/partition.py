"""Contiguous partitions: split items 0..n-1 into runs minimizing the largest run's cost, within per-run limits.

The stage balance (``solver/stages.py``) partitions a pipeline's subgraphs with these. Both optimizers
are dynamic programs over (runs placed, items covered), the classic linear-partition recurrence

    best[s][i] = min over j < i of max(best[s-1][j], cost(s-1, j, i))   if run s-1 fits [j, i)

exact (no rounding of costs, unlike a binary search on a time grid), with stage-dependent limits
(``fits`` sees the run's index). n <= a few hundred items by a few hundred runs is small: O(S n^2)
with pruning runs in milliseconds to a second. ``feasible`` answers "does any partition fit" greedily.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def min_max_partition(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None = None,
) -> tuple[float, list[int]]:
    """Split items 0..n-1 into ``stages`` non-empty contiguous runs minimizing the largest
    ``cost(stage, j, i)`` of a run [j, i), subject to ``fits(stage, j, i)``. Both must be monotone:
    a run inside a run that fits also fits and costs no more. Returns (optimum, start of each run);
    the optimum is ``math.inf`` (and the starts empty) when nothing fits."""
    # a run costing at least the best so far ends the widening: wider runs cost at least as much
    best, arg = _runs(n, stages, cost, fits, lambda c, b: c >= b, lambda prev, c: max(prev, c))
    if best == math.inf:
        return math.inf, []
    return best, _starts(arg, stages, n)


def _runs(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] | None,
    done: Callable[[float, float], bool],
    combine: Callable[[float, float], float],
) -> tuple[float, list[list[int]]]:
    """The linear-partition recurrence: ``best[s][i]`` = the least ``combine(best[s-1][j], cost(s-1, j, i))``
    over runs [j, i) widened leftwards while they fit and ``done(cost, best so far)`` is false. Returns the
    optimum over all n items and the argmin table."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            b, a = inf, -1
            for j in range(i - 1, s - 2, -1):  # widening the run [j, i) leftwards
                if fits is not None and not fits(s - 1, j, i):
                    break
                c = cost(s - 1, j, i)
                if done(c, b):
                    break
                v = combine(best[s - 1][j], c)
                if v < b:
                    b, a = v, j
            best[s][i], arg[s][i] = b, a
    return best[stages][n], arg


def _starts(arg: list[list[int]], stages: int, n: int) -> list[int]:
    out, i = [], n
    for s in range(stages, 0, -1):
        i = arg[s][i]
        out.append(i)
    return out[::-1]


def feasible(n: int, stages: int, fits: Callable[[int, int, int], bool]) -> bool:
    """Whether some partition into ``stages`` non-empty runs fits, in O(n + stages) calls.

    Greedy is exact: each stage takes the longest run that fits, leaving one item per stage still
    to come. By induction it ends at least as far right as any feasible partition does after the
    same number of stages, since a run inside a run that fits also fits."""
    start = 0
    for s in range(stages):
        cap = n - (stages - 1 - s)
        end = start
        while end < cap and fits(s, start, end + 1):
            end += 1
        if end == start:
            return False
        start = end
    return start == n


def even_partition(
    n: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    cap: float,
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[int]:
    """Among partitions whose every run costs at most ``cap``, the one with the least sum of squares."""
    _, arg = _runs(n, stages, cost, fits, lambda c, b: c > cap, lambda prev, c: prev + c * c)
    return _starts(arg, stages, n)


__all__ = ["even_partition", "feasible", "min_max_partition"]
