"""Where a CPU training step's time goes that the compute model misses (issue 35): the step measured op by op beside
the price of the same ops.

    OMP_NUM_THREADS=1 python bench/cpu_ops.py --spec calibrated.yaml [--sizes 128,256] [--steps 5]

A small GPT (``bench/cpu_step.py``'s) trains in one process on one thread as autopar's runtime trains a rank:
forward, loss, backward, torch's fused Adam (``runtime/grads/optimizer.fused_by_default``). Measured in thread CPU
time (``time.thread_time``: what the machine's load does not add, the time the process is descheduled): the whole
step, and under a ``TorchDispatchMode`` every ATen op's own CPU time (forward and backward alike: autograd runs
the backward on this thread), summed per class: matmuls (mm, addmm, bmm), attention (SDPA and its backward), the
optimizer's kernel, views (free in the model) and every other op ("elementwise": the model prices them by bytes
moved). What the ops leave of the step is framework time: Python, the modules, autograd's engine.

Predicted: the captured program's ops priced by ``solver/cluster/compute.py`` on the spec's device table,
forward plus backward (``train_seconds``), per class, and the optimizer step as the search prices it
(``Analytic.optimizer_seconds``); kernels launched beside ops measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from cpu_step import spec_of  # noqa: E402

from autopar.ir.core import VIEW_OPS, MeshSpec  # noqa: E402
from autopar.models.resolve import build  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.lower import lower  # noqa: E402
from autopar.search import profile_model  # noqa: E402
from autopar.search.price import Analytic  # noqa: E402
from autopar.solver.cluster import compute  # noqa: E402
from autopar.solver.cluster.spec import ClusterSpec  # noqa: E402

CLASSES = ("matmul", "attention", "elementwise", "views", "optimizer", "framework")
MATMUL_NAMES = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")
VIEW_NAMES = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "unsqueeze", "squeeze",
              "slice", "select", "alias", "detach", "reshape", "split", "split_with_sizes", "unbind", "chunk",
              "_reshape_alias", "narrow", "unflatten", "flatten", "lift_fresh"}  # fmt: skip


def op_class(name: str) -> str:
    """The class of an ATen op by its name (``aten.mm.default`` -> ``matmul``)."""
    base = name.split(".")[1] if name.startswith("aten.") else name
    if base in MATMUL_NAMES:
        return "matmul"
    if "scaled_dot_product" in base:
        return "attention"
    if base in VIEW_NAMES:
        return "views"
    if base.startswith("_fused_adam"):
        return "optimizer"
    return "elementwise"


class OpTimes(TorchDispatchMode):
    """Thread CPU seconds and calls of every ATen op run under it, per class."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        dt = time.thread_time() - t0
        c = op_class(str(func))
        self.seconds[c] += dt
        self.calls[c] += 1
        return out


def trainer(spec: str):
    m = build(spec, device="cpu")
    model = m.model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        out = model(*m.args, **m.kwargs)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return m, step


def measure(spec: str, steps: int) -> tuple[float, dict[str, float], dict[str, int]]:
    """(median thread CPU seconds of a step, per class median op seconds, per class op calls)."""
    _, step = trainer(spec)
    step()
    step()
    whole = []
    per: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = {}
    for _ in range(steps):  # alternating, a plain step then one op by op, so that both see the same load
        t0 = time.thread_time()
        step()
        whole.append(time.thread_time() - t0)
        with OpTimes() as rec:
            step()
        for c in CLASSES:
            per[c].append(rec.seconds.get(c, 0.0))
        calls = dict(rec.calls)
    return statistics.median(whole), {c: statistics.median(v) for c, v in per.items()}, calls


def predict(spec: str, batch: int, cluster: ClusterSpec) -> tuple[dict[str, float], dict[str, float]]:
    """(per class forward + backward seconds, per class kernels launched: forward once, backward twice)."""
    m = build(spec, device="meta")
    prog = lower(capture(m.model, m.args, m.kwargs), MeshSpec())
    types = prog.types()
    device = compute.device_of(cluster)
    secs: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for op in prog.ops:
        w = compute.op_work(op, types, "fp32", "fused")
        c = (
            "views"
            if op.target in VIEW_OPS
            else {"attention": "attention", "matmul": "matmul"}.get(w.kind, "elementwise")
        )
        secs[c] += compute.train_seconds(w, device)
        kernels[c] += 3 * w.ops
    an = Analytic(profile_model(spec), cluster, batch, precision="fp32", attention="fused")
    secs["optimizer"] = an.optimizer_seconds(sum(v.type.numel for v in prog.params), 0, 1)
    kernels["optimizer"] = 1
    return dict(secs), dict(kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the cluster spec autopar calibrate wrote")
    ap.add_argument("--sizes", default="128,256", help="hidden sizes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cluster = ClusterSpec.load(f"{args.spec}:nodes=1,devices_per_node=1")
    for h in (int(x) for x in args.sizes.split(",")):
        spec = spec_of(h, args.layers, args.seq, args.batch)
        whole, per, calls = measure(spec, args.steps)
        pred, kernels = predict(spec, args.batch, cluster)
        per["framework"] = whole - sum(per[c] for c in CLASSES if c != "framework")
        total = sum(pred.values())
        load = os.getloadavg()[0]
        print(f"\nGPT {args.layers} layers, hidden {h}, seq {args.seq}, batch {args.batch}: step {whole * 1e3:.1f} ms "
              f"CPU measured, {total * 1e3:.1f} ms predicted ({total / whole:.2f}), load {load:.1f}")  # fmt: skip
        print("| class | measured CPU ms | ops run | predicted ms | kernels priced | predicted / measured |")
        print("|---|---|---|---|---|---|")
        for c in CLASSES:
            p, t = pred.get(c, 0.0), per.get(c, 0.0)
            ratio = f"{p / t:.2f}" if t > 0 else "-"
            print(f"| {c} | {t * 1e3:.2f} | {calls.get(c, '')} | {p * 1e3:.2f} | {kernels.get(c, 0):.0f} | {ratio} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
