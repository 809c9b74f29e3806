"""`autopar calibrate -o spec.yaml`: measure this machine and write the cluster spec the planner prices with."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autopar.api import calibration_dir
from autopar.errors import AutoparError
from autopar.runtime.measure.calibrate import calibrate
from autopar.solver.cluster.spec import calibration_file


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (matmul FLOP/s, bandwidth, collectives) and write a cluster spec",
        description=(
            "Spawn --ranks local processes on this machine's backend (NCCL, one GPU each, when CUDA has that "
            "many devices; else gloo on the CPU, one thread each, as autopar trains) and measure, on all of them "
            "at once: square-matmul FLOP/s, a matmul sweep over shapes (fitted into the device table of per-shape "
            "efficiency the planner prices each op with, solver/cluster/compute.py), elementwise-add memory "
            "bandwidth, and the latency and bandwidth of "
            "all_reduce, all_gather, reduce_scatter and send/recv (a least-squares fit of time against size, read "
            "through the ring model of docs/cluster_spec.md). Writes a cluster spec (YAML, or JSON by suffix) that "
            "`autopar plan --cluster FILE` and autopar.compile(options=ShardOptions(cluster=...)) accept. With "
            "--save it becomes the default for this machine: autopar.compile prices every plan with it (it is "
            "kept in autopar's cache directory, $AUTOPAR_CACHE_DIR). Takes about a minute (--quick: seconds)."
        ),
        epilog=(
            "examples: autopar calibrate -o local.yaml; autopar calibrate --save; "
            "autopar plan gpt2 --mesh dp=2 --cluster local.yaml"
        ),
    )
    p.add_argument("-o", "--output", default=None, help="write the spec here (.yaml/.yml, or .json)")
    p.add_argument("--save", action="store_true", help="also save it as this machine's default (cache directory)")
    p.add_argument("--ranks", type=int, default=2, help="local processes to measure with (default 2)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions: a rough spec in seconds")
    p.add_argument(
        "--sweep",
        default=None,
        help="matmul dimensions to sweep, comma-separated (every m, n, k combination; default 32,128,512,1024 "
        "on CPU, 256,1024,4096,8192 on GPU)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise AutoparError("--ranks must be at least 2: collectives need two processes")
    if not args.output and not args.save:
        raise AutoparError("say where the spec goes: -o spec.yaml, or --save for this machine's default")
    t0 = time.perf_counter()
    sweep = None
    if args.sweep:
        try:
            sweep = tuple(int(x) for x in args.sweep.split(","))
        except ValueError:
            raise AutoparError(
                f"--sweep {args.sweep!r}: give positive integers separated by commas, e.g. 64,256"
            ) from None
        if not sweep or min(sweep) < 1:
            raise AutoparError(f"--sweep {args.sweep!r}: give positive integers separated by commas, e.g. 64,256")
    spec, table = calibrate(args.ranks, quick=args.quick, sweep=sweep)
    print(f"measured in {time.perf_counter() - t0:.1f} s:")
    print(f"  matmul        {', '.join(f'{k} {v / 1e9:.1f} GFLOP/s' for k, v in spec.peak_flops.items())}")
    print(f"  elementwise   {spec.memory_bandwidth / 1e9:.2f} GB/s")
    for kind, (lat, bw) in spec.collectives.items():
        print(f"  {kind:14s}{lat * 1e6:8.1f} us per step, {bw / 1e9:6.2f} GB/s")
    targets = [args.output] if args.output else []
    if args.save:
        path = calibration_file(calibration_dir(), spec.backend)
        path.parent.mkdir(parents=True, exist_ok=True)
        targets.append(str(path))
    if table is not None:
        for dtype, c in table.matmul.items():
            print(
                f"  matmul curve  {dtype}: max_eff {c.max_eff:.3f}, half {c.half:.0f} (efficiency = max_eff * "
                "prod over m, n, k of x / (x + half))"
            )
        print(f"  launch        {table.launch_seconds * 1e6:.1f} us per kernel")
    for target in targets:
        out = spec
        if table is not None:  # the device table beside the spec, which names it
            device = Path(target).with_suffix(".device.yaml").resolve()
            table.save(device)
            out = spec.replace(device=str(device))
            print(f"wrote {device}")
        out.save(target)
        print(f"wrote {target}")
    return 0
