"""Search time with the chains' family bound (bubble, forced recomputation, per-rank sync) beside the previous one.

    OMP_NUM_THREADS=1 .venv/bin/python bench/search_bound.py [--repeats 2] [--skip-1t] [--old-1t]
    OMP_NUM_THREADS=1 .venv/bin/python bench/search_bound.py --only gpt3|1t [--bound chains] [--json]

Runs ``search_model`` on GPT-3 175B (dgx-a100, 128 nodes = 1,024 GPUs, global batch 1536) and on Megatron's
1T model (128 layers, hidden 25600, 160 heads; 384 nodes = 3,072 GPUs, global batch 3072), alternating the
two bounds (A B A B: ``bound="chains"``, ``Analytic.family_floor``, then ``bound="sync"``, the mean compute plus
the least dp sync, ``Analytic.family_bounds``) with a fresh simulator cache each run (the schedule text cache on
disk stays warm after the first run, as in use). Prints wall and CPU seconds, families pruned before pricing,
candidates priced and scored, and the plan found (it must be the same with either bound). ``--old-1t`` also
times the 1T search with the previous bound (1,326 s in issue 35's measurement). ``--only`` times one search once
with one bound (``--bound``, default chains) in this process and prints its row (``--json``: as JSON too): run it
in two checkouts in turn, each with its own interpreter, to time one tree against another (BENCHMARKS.md 24).
"""

from __future__ import annotations

import argparse
import json
import time

from autopar.search import Scorer, profile_model, search_model

GPT3 = ("gpt3-175b", "dgx-a100:nodes=128", 1536)
ONE_T = (
    "gpt2:n_layer=128,n_embd=25600,n_head=160,n_positions=2048,vocab_size=51200,seq=2048,batch=1",
    "dgx-a100:nodes=384",
    3072,
)


def run(case: tuple[str, str, int], tight: bool | str) -> dict:
    spec, cluster, B = case
    bound = tight if isinstance(tight, str) else "chains" if tight else "sync"
    t0, c0 = time.perf_counter(), time.process_time()
    res = search_model(spec, cluster, B, top=1, scorer=Scorer(), bound=bound)
    s = res.stats
    return {
        "bound": {"chains": "chains", "sync": "mean + dp sync"}.get(bound, bound),
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,  # what a shared machine's load does not inflate
        "families": s["families"],
        "families_pruned": s["families_pruned_by_bound"],
        "families_over_budget": s["families_over_budget"],
        "priced": s["priced"],
        "scored": s["scored"],
        "simulations": s["simulations"],
        "best": res.best[0].candidate.describe(),
        "step": res.best[0].step_time,
    }


def show(name: str, row: dict) -> None:
    print(
        f"{name:<10} {row['bound']:<18} {row['seconds']:>8.1f} s wall {row['cpu_seconds']:>7.1f} CPU-s  "
        f"families {row['families']:>4} "
        f"(pruned {row['families_pruned']:>4}, over budget {row['families_over_budget']:>3})  "
        f"priced {row['priced']:>7,}  scored {row['scored']:>4}  "
        f"sims {row['simulations']:>4}  best {row['best']} ({row['step']:.4g} s)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-1t", action="store_true")
    ap.add_argument("--old-1t", action="store_true", help="also time the 1T search with the previous bound")
    ap.add_argument("--only", choices=("gpt3", "1t"), help="time this one search once (with --bound) and stop")
    ap.add_argument("--bound", default="chains", help="the family bound of --only (search's BOUNDS)")
    ap.add_argument("--json", action="store_true", help="with --only, also print the row as one line of JSON")
    args = ap.parse_args()
    if args.only:
        case = GPT3 if args.only == "gpt3" else ONE_T
        profile_model(case[0])
        row = run(case, args.bound)
        show("GPT-3" if args.only == "gpt3" else "1T", row)
        if args.json:
            print(json.dumps(row), flush=True)
        return
    for spec, *_ in (GPT3, ONE_T):
        profile_model(spec)  # cached profiles: the search is what is timed
    for _ in range(args.repeats):
        for tight in (True, False):
            show("GPT-3", run(GPT3, tight))
    if not args.skip_1t:
        show("1T", run(ONE_T, True))
        if args.old_1t:
            show("1T", run(ONE_T, False))


if __name__ == "__main__":
    main()
