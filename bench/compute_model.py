"""The compute model (solver/cluster/compute.py) against the old constant efficiency and against measured op times.

1. Megatron-LM's Table 1 (bench/megatron_table1.py, Megatron's configurations: full recomputation, its t, p, d,
   best b and v), priced on dgx-a100 by the device table's per-shape curves and by the old constant 0.5 of peak
   (``efficiency=0.5``, the replaced ``EFFICIENCY``), both with attention unfused as Megatron of 2021 ran it:
   predicted TFLOP/s per GPU (Eq. 3) beside the published.
2. On this CPU (one thread, as autopar trains): matmuls of several shapes and an elementwise add, measured
   (median of 7) beside ``compute.seconds`` on the local-cpu preset and on a freshly calibrated table
   (``--spec FILE``, from ``autopar calibrate -o FILE``), as predicted / measured.

    python bench/compute_model.py [--spec calibrated.yaml] [--rows 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from megatron_table1 import TABLE1, predict  # noqa: E402

from autopar.search import profile_model  # noqa: E402
from autopar.solver.cluster import compute  # noqa: E402
from autopar.solver.cluster.spec import ClusterSpec  # noqa: E402


def table1(rows: int) -> None:
    import megatron_table1 as mt

    print("| model | t p d | published TFLOP/s | constant 0.5 | error | device table | error |")
    print("|---|---|---|---|---|---|---|")
    errs = {"old": [], "new": []}
    real = mt.Analytic
    for row in TABLE1[:rows]:
        prof = profile_model(row.spec)
        new = predict(row, prof)
        mt.Analytic = lambda *a, **k: real(*a, **{**k, "efficiency": 0.5})  # the replaced EFFICIENCY = 0.5
        try:
            old = predict(row, prof)
        finally:
            mt.Analytic = real
        errs["old"].append(old.error)
        errs["new"].append(new.error)
        print(
            f"| {row.billions}B | {row.t} {row.p} {row.d} | {row.tflops} | {old.tflops:.1f} | {old.error:+.1%} | "
            f"{new.tflops:.1f} | {new.error:+.1%} |"
        )
    for k, name in (("old", "constant 0.5"), ("new", "device table")):
        e = [abs(x) for x in errs[k]]
        print(f"{name}: mean |error| {statistics.mean(e):.1%}, max {max(e):.1%}")


def _median(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_ops(specs: list[str]) -> None:
    torch.set_num_threads(1)
    devices = {s: compute.device_of(ClusterSpec.load(s)) for s in specs}
    print("| op | measured ms | " + " | ".join(f"predicted / measured ({s})" for s in specs) + " |")
    print("|---|---|" + "---|" * len(specs))
    for m, n, k in [
        (32, 32, 32),
        (128, 128, 128),
        (512, 512, 512),
        (2048, 64, 64),
        (64, 2048, 2048),
        (1024, 1024, 1024),
    ]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = _median(lambda a=a, b=b: torch.mm(a, b))
        w = compute.Work("matmul", 2.0 * m * n * k, 4.0 * (m * k + k * n + m * n), m, n, k, "fp32")
        ratios = " | ".join(f"{compute.seconds(w, d) / t:.2f}" for d in devices.values())
        print(f"| mm {m}x{k} @ {k}x{n} | {t * 1e3:.3f} | {ratios} |")
    for numel in (1 << 12, 1 << 20, 1 << 24):
        x, y = torch.randn(numel), torch.randn(numel)
        t = _median(lambda x=x, y=y: x + y)
        w = compute.Work("elementwise", float(numel), 12.0 * numel, dtype="fp32")
        ratios = " | ".join(f"{compute.seconds(w, d) / t:.2f}" for d in devices.values())
        print(f"| add {numel} | {t * 1e3:.3f} | {ratios} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", action="append", default=[], help="a calibrated spec to compare (repeatable)")
    ap.add_argument("--rows", type=int, default=len(TABLE1))
    ap.add_argument("--skip-table1", action="store_true")
    args = ap.parse_args()
    print(f"machine: {os.uname().nodename}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    if not args.skip_table1:
        table1(args.rows)
    cpu_ops(["local-cpu", *args.spec])


if __name__ == "__main__":
    main()
