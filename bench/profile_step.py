"""Where a training step's time goes, per rank: autopar's dp and tp plans beside DDP and DTensor TP (torch.profiler).

    .venv/bin/python bench/profile_step.py                      # dp, ddp, tp, dtensor-tp; issue 13's sizes
    .venv/bin/python bench/profile_step.py --systems autopar-dp,ddp --out bench/profiles

Each system (``bench/vs_torch.py``'s: same model, batch and 2 gloo ranks, one thread each) runs in
fresh processes: two warm-up steps, then ``--steps`` steps (forward, backward, AdamW step) under
``torch.profiler`` on every rank. Each rank's summary splits its step's wall time (the training
thread's view) into

- compute: self time of the ATen ops that are not communication;
- communication: self time of the collectives' calls (gloo ``c10d::``/``gloo:`` ops: on CPU the
  call copies and enqueues, gloo's own threads move the bytes);
- waiting: self time in ``wait`` calls of asynchronous collectives (a collective the rank needs
  before it can go on);
- other: the rest of the wall time (Python, autograd's engine, the interpreter of the generated
  modules, the optimizer's loop);

then the top ops by self time. The summaries (a few KB) are written to ``--out/<system>.txt`` and printed.
With ``--traces`` each rank's whole trace is kept too, gzipped, as ``--out/traces/<system>.rank<r>.json.gz``
(open in https://ui.perfetto.dev or chrome://tracing; 65-130 KB a rank per profiled step at issue 13's sizes).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from _launch import add_model_args, free_port, init_worker  # noqa: E402
from vs_torch_systems import build_system, family_of  # noqa: E402

SYSTEMS = ("autopar-dp", "ddp", "autopar-tp", "dtensor-tp")
COMM = ("c10d::", "gloo:", "allreduce", "all_reduce", "allgather", "all_gather", "broadcast", "barrier", "send", "recv")


def category(name: str) -> str:
    low = name.lower()
    if "wait" in low:
        return "waiting"
    if any(k in low for k in COMM):
        return "communication"
    if low.startswith("aten::"):
        return "compute"
    return "other"


def summarize(prof, wall: float, steps: int, rank: int, top: int) -> str:
    """One rank's summary: seconds per step by category and the ``top`` ops by self time."""
    rows = [(e.key, e.self_cpu_time_total / 1e6 / steps, e.count // steps) for e in prof.key_averages()]
    per_step = wall / steps
    totals = {"compute": 0.0, "communication": 0.0, "waiting": 0.0}
    for name, sec, _ in rows:
        c = category(name)
        if c in totals:
            totals[c] += sec
    totals["other"] = max(0.0, per_step - sum(totals.values()))
    lines = [f"rank {rank}: {per_step:.3f} s/step (wall, median of the profiled steps' mean)"]
    lines += [f"  {k:<14} {v:.3f} s  {100 * v / per_step:5.1f}%" for k, v in totals.items()]
    lines.append(f"  top {top} ops by self time per step (s, calls per step, category):")
    for name, sec, n in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"    {sec:8.4f}  {n:5d}  {category(name):<13}  {name}")
    return "\n".join(lines)


def keep_trace(prof, path: str) -> None:
    """Write ``prof``'s Chrome trace to ``path``, gzipped."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def run_one(rank: int, world: int, port: int, system: str, a, out: str) -> None:
    init_worker(rank, world, port, a.timeout)
    torch.manual_seed(0)
    module, opt, batch = build_system(system, family_of(system, ""), a, rank)

    def step() -> None:
        module(**batch).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        wall = time.perf_counter() - t0
    text = summarize(prof, wall, a.steps, rank, a.top)
    if a.traces:
        keep_trace(prof, os.path.join(a.out, "traces", f"{system}.rank{rank}.json.gz"))
    with open(f"{out}.{rank}", "w") as f:
        f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "profiles"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--traces", action="store_true", help="also keep each rank's trace, gzipped, in OUT/traces/")
    add_model_args(p)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.makedirs(a.out, exist_ok=True)
    for system in [s.strip() for s in a.systems.split(",") if s.strip()]:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "summary")
            mp.spawn(run_one, args=(a.ranks, free_port(), system, a, out), nprocs=a.ranks, join=True)
            parts = [open(f"{out}.{r}").read() for r in range(a.ranks)]
        header = (
            f"{system}: {a.ranks} gloo ranks, 1 thread each; {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, "
            f"batch {a.batch} x {a.seq}; {a.steps} profiled steps after 2 warm-up steps\n"
        )
        text = header + "\n".join(parts)
        with open(os.path.join(a.out, f"{system}.txt"), "w") as f:
            f.write(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
