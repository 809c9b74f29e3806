"""Predicted vs measured step time on this CPU (issue 35): a small GPT's whole training step (forward, loss,
backward, Adam), one process and one thread, measured, beside the search's price of the same step
(``Analytic`` + the closed form for one rank: compute by ``solver/cluster/compute.py`` on a calibrated table,
plus the optimizer step) on the spec ``autopar calibrate`` wrote.

    OMP_NUM_THREADS=1 python bench/cpu_step.py --spec calibrated.yaml [--sizes 128,256,512] [--steps 5] \
        [--compile | --autopar]

``--compile``: the step compiled as a plan priced for ``torch_compile=True`` runs it: ``autopar.compile(model,
mesh, torch_compile=True)`` on a one-rank mesh (a gloo group of one process; Inductor's C++ backend), its forward
and backward programs compiled, torch's fused Adam from ``make_optimizer``; two warm-up steps (the first
compiles: set ``TORCHINDUCTOR_CACHE_DIR`` to keep the kernels between runs), and the price of the same step
compiled (``Analytic(compiled=True)``: ``compute.compiled_shares``' fused kernels). The compile log's eager parts
are printed, so that an eager fallback is seen. ``--autopar``: the same one-rank autopar module eager (its
runtime's own overhead in the step as in ``--compile``'s), priced eager.

Measured in wall time and in this thread's CPU time (``time.thread_time``), the load average beside: on a machine
others load, the wall time holds the time the process waited descheduled, which no price can know; `autopar
calibrate` times a CPU's compute in thread CPU time too, so the ratio printed is predicted / measured CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _launch import free_port, init_worker  # noqa: E402

from autopar.models.resolve import build  # noqa: E402
from autopar.search import Scorer, profile_model  # noqa: E402
from autopar.search.price import Analytic  # noqa: E402
from autopar.search.space import Candidate  # noqa: E402
from autopar.solver.cluster.spec import ClusterSpec  # noqa: E402


def spec_of(h: int, layers: int, seq: int, batch: int) -> str:
    return f"gpt2:n_layer={layers},n_embd={h},n_head=4,n_positions={seq},vocab_size=1024,seq={seq},batch={batch}"


def measure(spec: str, steps: int, compiled: bool = False, via_autopar: bool = False) -> tuple[float, float]:
    """(median wall seconds, median thread CPU seconds) of a step, torch's fused Adam as autopar's runtime steps;
    ``via_autopar``: the model through ``autopar.compile`` on one rank (``compiled``: with ``torch_compile=True``)."""
    m = build(spec, device="cpu")
    model = m.model.train()
    if via_autopar or compiled:
        import autopar

        if not dist.is_initialized():  # a one-process gloo group for the one-rank mesh
            init_worker(0, 1, free_port(), timeout=3600)
        model = autopar.compile(model, autopar.init_mesh("cpu", dp=1), m.args, m.kwargs, torch_compile=compiled)
        opt = model.make_optimizer(torch.optim.Adam, lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        out = model(*m.args, **m.kwargs)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if compiled:
        step()  # the first step compiles the forward, the second loads nothing new: both left out
        print(f"compile log: {model.compile_log}", flush=True)
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def predict(spec: str, batch: int, cluster: ClusterSpec, compiled: bool = False) -> float:
    an = Analytic(profile_model(spec), cluster, batch, precision="fp32", attention="fused", compiled=compiled)
    ev = Scorer().score(an.evaluate(Candidate(1, 1, 1, batch, 1, "none")))
    return ev.step_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the cluster spec autopar calibrate wrote")
    ap.add_argument("--sizes", default="128,256,512", help="hidden sizes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--compile", action="store_true", help="autopar's one-rank step compiled (torch_compile=True)")
    how.add_argument("--autopar", action="store_true", help="autopar's one-rank step eager")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cluster = ClusterSpec.load(f"{args.spec}:nodes=1,devices_per_node=1")
    print("| model | measured s/step: wall, CPU | predicted s/step | predicted / measured CPU | load |")
    print("|---|---|---|---|---|")
    for h in (int(x) for x in args.sizes.split(",")):
        spec = spec_of(h, args.layers, args.seq, args.batch)
        t, c = measure(spec, args.steps, args.compile, args.autopar)
        p = predict(spec, args.batch, cluster, args.compile)
        how = ", autopar compiled" if args.compile else ", autopar eager" if args.autopar else ""
        print(f"| GPT {args.layers} layers, hidden {h}, seq {args.seq}, batch {args.batch}{how} | {t:.4f}, {c:.4f} | "
              f"{p:.4f} | {p / c:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
