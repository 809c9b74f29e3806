"""Search time and candidates for the whole-plan search on big presets (BENCHMARKS.md, issue 7).

    .venv/bin/python bench/search.py                 # gpt2-xl / 8, llama-70b / 64, gpt3-175b / 1024 GPUs
    .venv/bin/python bench/search.py --materialize   # also the plan: capture + the flow (ILP, split, stages)

Each model runs in a fresh process with an empty cache directory, so "cold" includes capturing the
model on the meta device and building every schedule; the same search is then repeated in that
process ("warm": profile and schedules cached, what a second `autopar plan` of the model costs
after the first, whose profile and schedules sit in ~/.cache/autopar).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RUNS = [
    ("gpt2-xl", "dgx-a100", 64),
    ("llama-70b", "dgx-a100:nodes=8", 512),
    ("gpt3-175b", "dgx-a100:nodes=128", 1536),
]
GiB = 2**30


def one(model: str, cluster: str, batch: int, materialize: bool) -> dict:
    from autopar.search import search_model

    t0 = time.perf_counter()
    cold = search_model(model, cluster, batch, top=5)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = search_model(model, cluster, batch, top=5)
    warm_s = time.perf_counter() - t0
    out = {
        "model": model,
        "cluster": cluster,
        "devices": warm.cluster.world_size,
        "global_batch": batch,
        "cold_seconds": cold_s,
        "cold_profile_seconds": cold.stats["profile_seconds"],
        "cold_search_seconds": cold.stats["search_seconds"],
        "warm_seconds": warm_s,
        "stats": warm.stats,
        "best": [warm.summary(e) for e in warm.best],
        "same_answer": [e.candidate for e in cold.best] == [e.candidate for e in warm.best],
    }
    if materialize:
        t0 = time.perf_counter()
        plan = warm.materialize()
        out["materialize_seconds"] = time.perf_counter() - t0
        shard, passes = plan.stats["shard"], plan.stats["pass_seconds"]
        out["stages"] = len(plan.pipeline["stage_plan"]["stages"]) if plan.pipeline.get("stage_plan") else 1
        out["layers_solved_once"] = shard["layers_solved_once"]
        out["ilp_seconds"] = shard["solve_seconds"]
        out["shard_seconds"] = passes["shard"]
        out["stage_seconds"] = passes.get("split", 0.0) + passes.get("assign-stages", 0.0)
        out["capture_seconds"] = plan.stats["capture_seconds"]
        out["plan_bytes"] = len(plan.to_json())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--materialize", action="store_true", help="also build the plan (capture + the flow)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "CLUSTER", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model, cluster, batch = args.one
        print(json.dumps(one(model, cluster, int(batch), args.materialize), default=str))
        return
    rows = []
    for model, cluster, batch in RUNS:
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, AUTOPAR_CACHE_DIR=os.path.join(d, "plans"))
            cmd = [sys.executable, __file__, "--one", model, cluster, str(batch)]
            cmd += ["--materialize"] if args.materialize else []
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        "| model | GPUs | batch | cold: profile + search s | warm search s | candidates | priced | "
        "over budget | dominated | pruned by bound | scored | simulations |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["stats"]
        print(
            f"| {r['model']} | {r['devices']} | {r['global_batch']} | {r['cold_profile_seconds']:.1f} + "
            f"{r['cold_search_seconds']:.1f} | {r['warm_seconds']:.1f} | {s['space']:,} | {s['priced']:,} | "
            f"{s['over_budget']:,} | {s['dominated']:,} | {s['pruned_by_bound']:,} | {s['scored']:,} | "
            f"{s['simulations']:,} |"
        )
    print("\n| model | best plan | step s | MFU | peak GiB/rank | simulated |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = r["best"][0]
        print(
            f"| {r['model']} | {b['configuration']} | {b['step_seconds']:.3f} | {b['mfu']:.1%} | "
            f"{b['peak_memory_bytes'] / GiB:.1f} | {b['simulated']} |"
        )
    if args.materialize:
        print(
            "\n| model | stages | layers solved once | capture s | shard pass s (ILP s) | split + stages s | "
            "plan total s | plan file MB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['stages']} | {r['layers_solved_once']} | {r['capture_seconds']:.1f} | "
                f"{r['shard_seconds']:.1f} ({r['ilp_seconds']:.1f}) | {r['stage_seconds']:.1f} | "
                f"{r['materialize_seconds']:.1f} | {r['plan_bytes'] / 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
