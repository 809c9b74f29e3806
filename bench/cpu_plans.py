"""Every plan the search ranks for N local ranks, predicted step beside measured, predicted ranking beside measured
(issue 35).

    OMP_NUM_THREADS=1 python bench/cpu_plans.py --spec calibrated.yaml [--models gpt2,llama] [--top 4] [--rounds 2]

For each model (``bench/vs_torch_systems.py``'s GPT-2 and LLaMA at ``--layers/--hidden/...``), ``search_model`` ranks
the plans for ``--ranks`` ranks of the spec's machine (fp32, global batch ``--batch``) and keeps the ``--top``
best; each is then compiled with ``autopar.compile`` on its mesh, ZeRO stage and pipeline (as ``vs_torch.py
--pairs search`` runs the best one) and trained for ``--steps`` steps (after one) on ``--ranks`` gloo processes
with ``train_step``. The plans run alternating (round 1: plan 1, 2, ..., round 2: plan 1, 2, ...), each in fresh
processes. Per step, each rank's wall time and thread CPU time; a plan's step is the median over steps of the slowest
rank, medians over rounds. The load average is printed beside. On a GPU (``--spec`` of a calibrated NCCL machine and
as many GPUs as ranks) the same script runs on NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _launch import add_model_args, free_port, init_worker  # noqa: E402
from vs_torch_systems import LossOnly, model_spec  # noqa: E402


def launch_of(c) -> dict:
    """How to run a search candidate (``vs_torch_systems.prepare_search``'s form)."""
    launch = {"axes": {k: n for k, n in c.mesh().items() if n > 1} or {"dp": 1}, "zero": c.zero, "mics": c.mics_group}
    if c.pp > 1:
        launch["pipeline"] = {"microbatches": c.microbatches, "schedule": c.schedule}
        launch["pipeline"]["schedule_options"] = {"chunks": c.chunks} if c.chunks > 1 else {}
    elif c.microbatches > 1:  # without a pp axis the microbatches accumulate gradients (TrainConfig.microbatches)
        launch["pipeline"] = {"microbatches": c.microbatches}
    return launch


def worker(
    rank: int, world: int, port: int, spec: str, launch: dict, steps: int, out: str, timeout: float, ops: bool = False
) -> None:
    import autopar
    from autopar.models.resolve import build
    from autopar.passes.shard import ShardOptions
    from autopar.solver.sharding.cost import TrainingSetup

    init_worker(rank, world, port, timeout)
    m = build(spec, device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    kwargs = dict(launch.get("pipeline", {}))
    kwargs["options"] = ShardOptions(setup=TrainingSetup(zero=launch["zero"], mics_group=launch["mics"] or None))
    cm = autopar.compile(model, autopar.init_mesh("cpu", **launch["axes"]), kwargs=batch, **kwargs)
    cm.make_optimizer(torch.optim.AdamW, lr=1e-4)
    cm.train_step(**batch)
    wall, cpu, classes = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        cm.train_step(**batch)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if ops:  # then a step op by op (every rank alike, so that the collectives pair): its ATen ops' CPU time
            from cpu_ops import OpTimes

            with OpTimes() as rec:
                cm.train_step(**batch)
            classes.append(dict(rec.seconds))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "classes": classes}, f)


def run_plan(
    spec: str, launch: dict, world: int, steps: int, timeout: float, ops: bool = False
) -> tuple[float, float, dict[str, float]]:
    """(wall, CPU) seconds of a step: per step the slowest rank, the median over steps; with ``ops``, rank 0's ATen
    ops' CPU seconds a step per class (``bench/cpu_ops.py``'s), medians over steps."""
    with tempfile.TemporaryDirectory() as d:
        args = (world, free_port(), spec, launch, steps, d, timeout, ops)
        mp.spawn(worker, args=args, nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
    wall = statistics.median(max(r["wall"][i] for r in ranks) for i in range(steps))
    cpu = statistics.median(max(r["cpu"][i] for r in ranks) for i in range(steps))
    names = {c for step in ranks[0]["classes"] for c in step}
    classes = {c: statistics.median(step.get(c, 0.0) for step in ranks[0]["classes"]) for c in sorted(names)}
    return wall, cpu, classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the cluster spec autopar calibrate wrote")
    ap.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama, bert, moe")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--ops",
        action="store_true",
        help="after each timed step one more op by op: rank 0's ATen ops' CPU time per class",
    )
    add_model_args(ap)
    a = ap.parse_args()
    from autopar.search import search_model
    from autopar.solver.cluster.spec import ClusterSpec

    cluster = ClusterSpec.load(f"{a.spec}:nodes=1,devices_per_node={a.ranks}")
    for family in a.models.split(","):
        spec = model_spec(family, a)
        searched = model_spec(family, a).replace(f",batch={a.batch}", "")
        result = search_model(searched, cluster, global_batch=a.batch, precision="fp32", top=a.top)
        plans = [(ev.candidate.describe(), ev.step_time, launch_of(ev.candidate)) for ev in result.best[: a.top]]
        measured: dict[int, list[tuple[float, float, dict]]] = {i: [] for i in range(len(plans))}
        for _ in range(a.rounds):
            for i, (_, _, launch) in enumerate(plans):
                measured[i].append(run_plan(spec, launch, a.ranks, a.steps, a.timeout, a.ops))
        rows = []
        for i, (name, pred, _) in enumerate(plans):
            wall = statistics.median(m[0] for m in measured[i])
            cpu = statistics.median(m[1] for m in measured[i])
            rows.append((i + 1, name, pred, wall, cpu))
            if a.ops:
                ops = {c: statistics.median(m[2].get(c, 0.0) for m in measured[i]) for c in measured[i][0][2]}
                parts = ", ".join(f"{c} {v * 1e3:.1f}" for c, v in sorted(ops.items(), key=lambda kv: -kv[1]))
                print(f"plan {i + 1} rank 0 ATen ops, CPU ms a step: {parts}; all ops {sum(ops.values()) * 1e3:.1f}")
        by_wall = {r[0]: k + 1 for k, r in enumerate(sorted(rows, key=lambda r: r[3]))}
        by_cpu = {r[0]: k + 1 for k, r in enumerate(sorted(rows, key=lambda r: r[4]))}
        print(f"\n{family} ({spec}) on {a.ranks} ranks, load {os.getloadavg()[0]:.1f}:")
        print("| predicted rank | plan | predicted s/step | measured wall, CPU s/step | predicted / wall, / CPU |"
              " measured rank (wall, CPU) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for rank, name, pred, wall, cpu in rows:
            print(f"| {rank} | {name} | {pred:.4f} | {wall:.4f}, {cpu:.4f} | {pred / wall:.2f}, {pred / cpu:.2f} | "
                  f"{by_wall[rank]}, {by_cpu[rank]} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
