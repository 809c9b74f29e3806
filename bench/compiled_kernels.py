"""One fused kernel priced beside its time under torch.compile on this CPU (issue 33): is a compiled elementwise
chain bound by its bytes, or, with a gelu in it, by the gelu's math?

    OMP_NUM_THREADS=1 python bench/compiled_kernels.py --spec calibrated.yaml [--shapes 1024x512,1024x1024]

Each chain (a bias add and a tanh gelu; a bias add and a multiply, the same bytes without transcendental math)
runs forward and backward on one thread, eager and under ``torch.compile`` (Inductor's C++ back end: the chain one
kernel forward, one backward), timed in thread CPU time (median of 15 after 3). Predicted: the captured chain's
kernel (``compute.compiled_works``) forward plus backward (``train_seconds``) on the spec's device table, with its
members' rate classes (``Work.rated``: the gelu's FLOPs at the table's transcendental rate) and without them (its
bytes and launch alone, as compiled kernels were priced before), and the eager ops one by one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from autopar.ir.core import MeshSpec
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec


class Gelu(torch.nn.Module):
    def forward(self, x, b):
        return torch.nn.functional.gelu(x + b, approximate="tanh")


class AddMul(torch.nn.Module):
    def forward(self, x, b):
        return (x + b) * 2


def cpu_seconds(fn, x, b, grad, repeats: int = 15) -> float:
    """Median thread CPU seconds of ``fn(x, b)``'s forward and backward (the gradients of x and b returned, not
    accumulated into ``.grad``: the chain's own work only)."""
    for _ in range(3):
        torch.autograd.grad(fn(x, b), (x, b), grad)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        torch.autograd.grad(fn(x, b), (x, b), grad)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def priced(model: torch.nn.Module, x, b, device: compute.Device) -> tuple[float, float, float]:
    """(compiled with rate classes, compiled by bytes alone, eager op by op): forward plus backward seconds."""
    prog = lower(capture(model, (x.detach(), b.detach())), MeshSpec())
    types = prog.types()
    works = compute.compiled_works(prog.ops, types, "fp32")
    fused = sum(compute.train_seconds(w, device) for w in works)
    bytes_only = sum(compute.train_seconds(replace(w, rated=()), device) for w in works)
    eager = sum(compute.train_seconds(compute.op_work(op, types, "fp32"), device) for op in prog.ops)
    return fused, bytes_only, eager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the cluster spec autopar calibrate wrote")
    ap.add_argument("--shapes", default="1024x512,1024x1024", help="rows x columns of the chain's input")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = compute.device_of(ClusterSpec.load(f"{args.spec}:nodes=1,devices_per_node=1"))
    print("| chain | shape | measured eager ms | measured compiled ms | predicted compiled ms (rates; bytes only) | "
          "predicted eager ms | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, cols, requires_grad=True)
        b = torch.randn(cols, requires_grad=True)
        grad = torch.randn(rows, cols)
        for model in (Gelu(), AddMul()):
            eager = cpu_seconds(model, x, b, grad)
            compiled = cpu_seconds(torch.compile(model), x, b, grad)
            fused, bytes_only, eager_price = priced(model, x, b, device)
            print(f"| {type(model).__name__} | {rows} x {cols} | {eager * 1e3:.2f} | {compiled * 1e3:.2f} | "
                  f"{fused * 1e3:.2f}; {bytes_only * 1e3:.2f} | {eager_price * 1e3:.2f} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
