"""Megatron-LM Table 1 (rows up to 145.6B): autopar's predicted TFLOP/s per GPU beside the reported ones,
and the plan autopar's search picks for the same cluster and batch within the same memory.

    .venv/bin/python bench/calibrate_megatron.py            # markdown tables for BENCHMARKS.md
    .venv/bin/python bench/calibrate_megatron.py --json     # one JSON object

Each model is captured once on the meta device (one sample; cached under ~/.cache/autopar/profiles),
so a second run takes only the search time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from megatron_table1 import TABLE1, predict, row_summary

from autopar.search import Scorer, SearchSpace, profile_model, search
from autopar.solver.cluster.spec import ClusterSpec

GiB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", type=int, default=len(TABLE1), help="first N rows of Table 1")
    args = ap.parse_args()
    scorer = Scorer()
    out = []
    for row in TABLE1[: args.rows]:
        t0 = time.perf_counter()
        prof = profile_model(row.spec)
        profile_s = time.perf_counter() - t0
        pred = predict(row, prof, scorer)
        meg = pred.evaluation
        cluster = ClusterSpec.load(row.cluster)
        # the search's space plus Megatron's own v, within the memory Megatron's configuration needs
        space = SearchSpace(chunks=tuple(sorted(set(SearchSpace().chunks) | {meg.candidate.chunks} - {1})))
        t0 = time.perf_counter()
        res = search(prof, cluster, row.batch, budget_bytes=meg.memory, space=space, scorer=scorer, spec=row.spec)
        search_s = time.perf_counter() - t0
        best = res.best[0]
        d = row_summary(pred)
        d.update(
            profile_seconds=profile_s,
            simulated=meg.simulated,
            autopar=res.summary(best) | {"tflops_per_gpu_eq3": res.tflops_eq3(best)},
            speedup=meg.step_time / best.step_time,
            search_seconds=search_s,
            search_stats=res.stats,
        )
        out.append(d)
    if args.json:
        print(json.dumps(out, indent=1, default=_jsonable))
        return
    print("| params (B) | t | p | d | GPUs | batch | b, v (cost model's best) | reported TFLOP/s | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in out:
        print(
            f"| {d['billions']} | {d['t']} | {d['p']} | {d['d']} | {d['gpus']} | {d['batch']} | "
            f"b={d['b']}, v={d['v']} | {d['reported_tflops']} | {d['predicted_tflops']:.1f} | {d['error']:+.1%} |"
        )
    errs = [abs(d["error"]) for d in out]
    print(f"\nmean |error| {sum(errs) / len(errs):.1%}, max |error| {max(errs):.1%}\n")
    print("| params (B) | compute s | TP all-reduce s | bubble + p2p s | DP sync s | step s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for d in out:
        b = d["breakdown"]
        print(
            f"| {d['billions']} | {b['compute']:.2f} | {b['tp_comm']:.2f} | {b['bubble_and_p2p']:.2f} | "
            f"{b['dp_sync']:.2f} | {b['step']:.2f} | {d['memory_gib']:.1f} |"
        )
    print()
    print(
        "| params (B) | Megatron's config (predicted) | autopar's plan | autopar TFLOP/s | speedup | "
        "memory Megatron / autopar GiB | search s | candidates | scored |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for d in out:
        a = d["autopar"]
        s = d["search_stats"]
        print(
            f"| {d['billions']} | {d['step_seconds']:.2f} s, {d['predicted_tflops']:.1f} TFLOP/s | "
            f"{a['configuration']} | {a['tflops_per_gpu_eq3']:.1f} | {d['speedup']:.3f}x | "
            f"{d['memory_gib']:.1f} / {a['peak_memory_bytes'] / GiB:.1f} | {d['search_seconds']:.1f} | "
            f"{s['space']:,} | {s['scored']:,} |"
        )


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


if __name__ == "__main__":
    main()
