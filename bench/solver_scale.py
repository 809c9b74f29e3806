"""ILP size and solve time for whole models on a 64-device mesh (repeated layers solved once).

    .venv/bin/python bench/solver_scale.py                      # gpt2-xl and gpt3-175b on dp=8,tp=8
    .venv/bin/python bench/solver_scale.py llama-70b --mesh dp=4,tp=16

Each model runs in a fresh process. Peer figure (shared/BENCHMARKING.md): meta-pytorch/autoparallel
on this machine, transformer blocks of dim 6144 on an (8, 8) mesh: 1 layer 67k variables 5.8 s;
4 layers 159k variables 45 s with its layer clustering (202 s without).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(model: str, mesh: str) -> dict:
    from autopar.api import parse_mesh
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.shard import ShardOptions, shard
    from autopar.solver.cluster.spec import ClusterSpec
    from autopar.solver.sharding.solve import build_problem

    spec = build(model, device="meta")
    t0 = time.perf_counter()
    captured = capture(spec.model, spec.args, spec.kwargs)
    t1 = time.perf_counter()
    prog = lower(captured, parse_mesh(mesh))
    opts = ShardOptions(cluster=ClusterSpec.load("dgx-a100"))
    t2 = time.perf_counter()
    _, groups, _, _ = build_problem(prog, opts)
    t3 = time.perf_counter()
    res = shard(prog, opts)  # builds again and solves
    t4 = time.perf_counter()
    return {
        "model": model,
        "mesh": mesh,
        "layers": res.solution.layers,
        "ops": len(prog.ops),
        "decisions": len(groups),
        "variables": res.solution.variables,
        "constraints": res.solution.constraints,
        "capture_s": t1 - t0,
        "build_s": t3 - t2,
        "solve_s": res.solution.seconds,
        "plan_s": t4 - t3,
        "status": res.solution.status,
        "memory_gib": res.memory_bytes / 2**30,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["gpt2-xl", "gpt3-175b"])
    p.add_argument("--mesh", default="dp=8,tp=8")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.mesh)))
        return 0
    print("| model | mesh | layers solved once | ops | decisions | ILP variables | constraints | capture (s) "
          "| build ILP (s) | CBC solve (s) | shard pass total (s) | status |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        out = subprocess.run(
            [sys.executable, __file__, "--one", model, "--mesh", args.mesh], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {model} | {r['mesh']} | {r['layers']} | {r['ops']:,} | {r['decisions']:,} | {r['variables']:,} "
            f"| {r['constraints']:,} | {r['capture_s']:.1f} | {r['build_s']:.1f} | {r['solve_s']:.2f} "
            f"| {r['plan_s']:.1f} | {r['status']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
