"""One optimizer step on issue 13's model, per torch implementation: for-loop, foreach, fused (one thread).

    .venv/bin/python bench/optimizer_kernels.py                       # GPT-2 (4 layers, hidden 256, vocab 4096)
    .venv/bin/python bench/optimizer_kernels.py --family llama --repeats 50

``make_optimizer`` takes torch's fused kernel unless told otherwise (``runtime/grads/optimizer.py:fused_by_default``);
this is the measurement behind that default. Each optimizer class steps the model's parameters (float32,
random gradients) with each implementation it has, the implementations alternating step by step after 5
warm-up steps; the table gives the median step in ms and each implementation's time over the for-loop's.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _launch import add_model_args  # noqa: E402
from vs_torch_systems import model_spec  # noqa: E402

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-4}),
    "Adam": (torch.optim.Adam, {"lr": 1e-4}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per implementation")
    add_model_args(p)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from autopar.models.resolve import build  # deferred: the model zoo imports transformers

    model = build(model_spec(a.family, a), device="cpu", seed=0).model
    shapes = [q.shape for q in model.parameters()]
    print(f"{a.family}: {len(shapes)} tensors, {sum(s.numel() for s in shapes):,} parameters; one thread")
    print("\n| optimizer | implementation | ms per step (median) | / for-loop |\n|---|---|---|---|")
    for name, (cls, kw) in OPTIMIZERS.items():
        kinds = [k for k in IMPLEMENTATIONS if k != "fused" or "fused" in inspect.signature(cls).parameters]
        opts = {}
        for k in kinds:
            params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
            for q in params:
                q.grad = torch.randn_like(q)
            opts[k] = cls(params, **kw, **IMPLEMENTATIONS[k])
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(5 + a.repeats):
            for k in kinds if i % 2 == 0 else kinds[::-1]:
                t0 = time.perf_counter()
                opts[k].step()
                if i >= 5:
                    times[k].append(time.perf_counter() - t0)
        base = statistics.median(times["for-loop"])
        for k in kinds:
            m = statistics.median(times[k])
            print(f"| {name} | {k} | {m * 1e3:.2f} | {m / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
