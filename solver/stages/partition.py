"""Contiguous partitions: split items 0..n-1 into runs minimizing the largest run's cost, within per-run limits.

The stage balance (``solver/stages/balance.py``) partitions a pipeline's subgraphs with these. Both optimizers
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
    """Whether some partition into ``stages`` non-empty runs fits, in O(n * stages) calls.

    Which runs fit depends on the stage (its microbatches in flight), so taking the longest run that
    fits stage by stage is not exact: a stage that takes one more item can leave the next stage an
    item that does not fit it, where a shorter run would have left that item to a later stage. So this
    keeps, stage by stage, every position the runs so far can end at. The fitting runs ending at ``i``
    start anywhere from the leftmost such start to ``i - 1`` (a run inside a run that fits also fits),
    and that leftmost start never moves left as ``i`` grows: two pointers and a prefix count."""
    reach = [True] + [False] * n  # reach[i]: items [0, i) split into the runs so far
    for s in range(stages):
        count = [0]
        for r in reach:
            count.append(count[-1] + r)  # count[i]: reachable ends before i
        nxt = [False] * (n + 1)
        lo = 0
        for i in range(1, n + 1):
            while lo < i and not fits(s, lo, i):
                lo += 1
            nxt[i] = lo < i and count[i] - count[lo] > 0
        reach = nxt
    return reach[n]


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
