"""Benchmark pipeline-split: capture + split time and peak memory, and the balance of stage plans.

python bench/pipeline_split.py timing --model gpt3-175b --repeats 3
    fresh processes, alternating an empty split cache (no cache) and the cache the previous
    run filled; prints a markdown table of medians and minima beside Merak's Table 2
python bench/pipeline_split.py balance
    gpt2-xl and llama-70b at pp = 4, 8, 16 (and interleaved / waves at pp = 4) on dgx-a100
python bench/pipeline_split.py once --model gpt3-175b --cache-dir DIR
    one measurement in this process, as JSON (what ``timing`` runs in each child)

autopar is imported inside ``once`` and ``balance``, not at the top: ``once`` times a cold import of it
(and must set AUTOPAR_CACHE_DIR first), and ``timing`` never needs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MERAK_MINUTES = {"no cache": 48.57, "cache": 0.48}  # Merak Table 2, GPT-175B, graph sharding
MERAK_GPT2_STAGES = [27, 26, 24, 21]  # Merak Sec. 4.2: GPT-2 (98 subgraphs) over 4 stages


def once(model: str, cache_dir: str) -> dict:
    os.environ["AUTOPAR_CACHE_DIR"] = cache_dir
    t0 = time.perf_counter()
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.pipeline_split import split_program
    from autopar.passes.split_cache import program_fingerprint

    t_import = time.perf_counter()
    spec = build(model, device="meta")
    t_build = time.perf_counter()
    captured = capture(spec.model, spec.args, spec.kwargs)
    t_capture = time.perf_counter()
    prog = lower(captured)
    t_lower = time.perf_counter()
    # a full collection over capture's heap otherwise lands in whichever step allocates next
    gc.collect()
    t_gc = time.perf_counter()
    split = split_program(prog)
    t_split = time.perf_counter()
    program_fingerprint(prog)  # the part of split_s that a cache hit still pays
    t_fp = time.perf_counter()
    return {
        "model": model,
        "ops": len(prog.ops),
        "subgraphs": len(split),
        "source": split.source,
        "import_s": t_import - t0,
        "build_s": t_build - t_import,
        "capture_s": t_capture - t_build,
        "lower_s": t_lower - t_capture,
        "split_s": t_split - t_gc,
        "fingerprint_s": t_fp - t_split,
        "capture_plus_split_s": t_split - t_gc + t_lower - t_build,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def timing(model: str, repeats: int) -> None:
    runs: dict[str, list[dict]] = {"no cache": [], "cache": []}
    with tempfile.TemporaryDirectory() as root:
        for r in range(repeats):
            cache = Path(root) / f"run{r}"  # empty: the first child splits and fills it
            for kind in ("no cache", "cache"):
                cmd = [sys.executable, __file__, "once", "--model", model, "--cache-dir", str(cache)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                want = "computed" if kind == "no cache" else "disk"
                assert res["source"] == want, res
                runs[kind].append(res)
                print(kind, json.dumps(res), file=sys.stderr)
    first = runs["no cache"][0]
    print(f"{model}: {first['ops']} ops -> {first['subgraphs']} subgraphs; {repeats} fresh processes each\n")
    print(
        "| | capture (s) | lower (s) | split (s) | of which fingerprint (s) | capture+lower+split (s) "
        "| peak RSS (MB) | Merak (min) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, rs in runs.items():

        def cell(key: str, rs: list[dict] = rs) -> str:
            xs = [r[key] for r in rs]
            return f"{statistics.median(xs):.3g} (min {min(xs):.3g})"

        print(
            f"| {kind} | {cell('capture_s')} | {cell('lower_s')} | {cell('split_s')} | {cell('fingerprint_s')} | "
            f"{cell('capture_plus_split_s')} | {cell('peak_rss_mb')} | {MERAK_MINUTES[kind]} |"
        )


def balance() -> None:
    from autopar.errors import StageMemoryError
    from autopar.ir.core import MeshSpec
    from autopar.models.resolve import build
    from autopar.passes.assign_stages import assign_stages
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.schedule.placement import schedule_of

    cases = [("gpt2-xl", None), ("llama-70b:batch=1", MeshSpec((("tp", 8),)))]
    print(
        "| model | mesh | schedule | pp | stages | subgraphs per stage | max/mean | slowest stage (ms) "
        "| peak rank memory (GiB) | assign (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, mesh in cases:
        spec = build(model, device="meta")
        prog = lower(capture(spec.model, spec.args, spec.kwargs), mesh)
        shapes = [(4, 1, None), (8, 1, None), (16, 1, None), (4, 2, None), (4, 1, 1)]
        for pp, chunks, waves in shapes:
            try:
                _, plan, _ = assign_stages(prog, pp, chunks, waves, None, cluster="dgx-a100")
            except StageMemoryError as e:
                need = e.smallest_budget_bytes / 2**30
                print(
                    f"| {model} | {mesh or '-'} | {schedule_of(pp, chunks, waves)} | {pp} | - | does not fit "
                    f"80 GiB (needs {need:.0f} GiB per device) | | | | |"
                )
                continue
            sizes = [s.last - s.first + 1 for s in plan.stages]
            print(
                f"| {model} | {mesh or '-'} | {plan.schedule} | {pp} | {plan.num_stages} | "
                f"{', '.join(map(str, sizes))} | {plan.balance:.3f} | {plan.bottleneck_seconds * 1e3:.1f} | "
                f"{max(plan.rank_memory()) / 2**30:.1f} | {plan.assign_seconds:.2f} |"
            )
    print(f"\nMerak's GPT-2 (98 subgraphs) over 4 stages: {', '.join(map(str, MERAK_GPT2_STAGES))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("once")
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--cache-dir", required=True)
    p = sub.add_parser("timing")
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--repeats", type=int, default=3)
    sub.add_parser("balance")
    args = parser.parse_args()
    if args.cmd == "once":
        print(json.dumps(once(args.model, args.cache_dir)))
    elif args.cmd == "timing":
        timing(args.model, args.repeats)
    else:
        balance()


if __name__ == "__main__":
    main()
