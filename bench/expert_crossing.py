"""The rows a grouped matmul's busiest expert rank receives from the others, measured on the runtime's own
split sizes, beside ``solver/sharding/experts.py``'s estimate (``expert_rows``) and the gather's rule.

    .venv/bin/python bench/expert_crossing.py            # BENCHMARKS.md section 19, "Planning expert parallelism"

``runtime/comm/all_to_all.py``'s ``expert_grouped_mm`` runs on every rank of the mesh in turn with its all-to-all
replaced by a recorder (no processes: the split sizes are computed from the offsets alone); each trial routes
1,024 rows a rank to 2 experts per ep rank drawn at random, the first rank's experts ``skew`` times as likely;
the figure is the mean over 20 trials of the busiest rank's rows from other ranks.
"""

from __future__ import annotations

import itertools
import types

import torch

from autopar.ir.core import Shard
from autopar.runtime.comm import all_to_all as a2a
from autopar.solver.sharding.experts import busiest_rows, expert_rows

LAYOUTS = [(("ep",), (2,)), (("ep",), (4,)), (("ep",), (8,)), (("dp", "ep"), (2, 2)), (("ep", "dp"), (2, 2))]


class _Splits:
    calls: list = []

    @staticmethod
    def apply(x, c, axis, out_splits, in_splits):
        _Splits.calls.append(list(out_splits))
        return x.new_zeros(sum(out_splits), *x.shape[1:])


def measure(names, sizes, experts: int, local: int, probs: torch.Tensor, trials: int, gen) -> float:
    n = sizes[names.index("ep")]
    total = 0.0
    for _ in range(trials):
        ids = torch.multinomial(probs, local * len(list(itertools.product(*(range(s) for s in sizes)))), True,
                                generator=gen)  # fmt: skip
        offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
        most = 0
        for coords in itertools.product(*(range(s) for s in sizes)):
            comm = types.SimpleNamespace(sizes=dict(zip(names, sizes)), coords=dict(zip(names, coords)))
            a2a.current_comm = lambda comm=comm: comm
            _Splits.calls.clear()
            x, w = torch.zeros(local, 1), torch.zeros(experts // n, 1, 1)
            a2a.expert_grouped_mm(x, w, offs, kernel=lambda x, w, o: x, axis="ep", experts=experts, rows=names)
            recv = _Splits.calls[0]
            most = max(most, sum(recv) - recv[comm.coords["ep"]])
        total += most
    return total / trials


def main() -> None:
    saved = a2a._AllToAll, a2a.current_comm
    a2a._AllToAll = _Splits
    try:
        gen = torch.Generator().manual_seed(0)
        print("| mesh (rows split, outer first) | skew | busiest rank / mean | measured rows from others | "
              "expert_rows | gather's rule (every row from a random rank) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for names, sizes in LAYOUTS:
            n = sizes[names.index("ep")]
            experts, local = 2 * n, 1024
            for skew in (1.0, 1.5):
                probs = torch.ones(experts)
                probs[:2] *= skew
                probs /= probs.sum()
                imbalance = float(probs[:2].sum()) * n
                measured = measure(names, sizes, experts, local, probs, 20, gen)
                placements = tuple(Shard(0) for _ in names)
                priced = expert_rows(local, placements, sizes, names.index("ep"), imbalance)[1]
                rule = busiest_rows(local * n, n, imbalance) * (n - 1) / n
                mesh = " x ".join(f"{a}={s}" for a, s in zip(names, sizes))
                print(f"| {mesh} | {skew} | {imbalance:.3f} | {measured:.1f} | {priced:.1f} | {rule:.1f} |")
    finally:
        a2a._AllToAll, a2a.current_comm = saved


if __name__ == "__main__":
    main()
