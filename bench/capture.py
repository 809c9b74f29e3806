"""Capture and lower big presets on the meta device; report time, peak memory and IR size.

    .venv/bin/python bench/capture.py                       # gpt3-175b, llama-70b, gpt2-xl
    .venv/bin/python bench/capture.py gpt3-175b --repeat 3

Each measurement runs in a fresh process (peak RSS is per process). Merak reports 48.57 minutes to
trace and shard GPT-175B (0.48 min with its cache); torch.export alone took 9.7 s here.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def measure(model: str) -> dict:
    import torch

    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower

    t0 = time.perf_counter()
    spec = build(model, device="meta")
    t1 = time.perf_counter()
    captured = capture(spec.model, spec.args, spec.kwargs)
    t2 = time.perf_counter()
    prog = lower(captured)
    t3 = time.perf_counter()
    model_params = sum(p.numel() for p in {id(p): p for p in spec.model.parameters()}.values())
    return {
        "model": model,
        "build_s": t1 - t0,
        "export_s": t2 - t1,
        "lower_s": t3 - t2,
        "total_s": t3 - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ir_ops": len(prog.ops),
        "ir_params": sum(v.type.numel for v in prog.params),
        "model_params": model_params,
        "torch": torch.__version__,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["gpt3-175b", "llama-70b", "gpt2-xl"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    print(
        "| model | build (s) | torch.export (s) | lower to IR (s) | total (s) | peak RSS (MB) | IR ops "
        "| IR params = model params |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, __file__, "--one", model], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in ("build_s", "export_s", "lower_s", "total_s", "peak_rss_mb")
        }
        r = runs[0]
        same = "yes" if r["ir_params"] == r["model_params"] else f"NO ({r['ir_params']:,} vs {r['model_params']:,})"
        print(
            f"| {model} | {med['build_s']:.1f} | {med['export_s']:.1f} | {med['lower_s']:.1f} | "
            f"{med['total_s']:.1f} | "
            f"{med['peak_rss_mb']:.0f} | {r['ir_ops']:,} | {same} ({r['ir_params']:,}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
