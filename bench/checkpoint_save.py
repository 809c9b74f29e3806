"""What a checkpoint costs the training loop: a blocking save against an asynchronous one, per step.

One process (gloo, a world of one), GPT-2 with ``--layers`` layers of width ``--hidden`` and GPT-2's
vocabulary, AdamW (two states per parameter: the checkpoint is about 3x the model). The variants
alternate (A B A B ..., shared/BENCHMARKING.md); each saves after every training step, and what is
timed is how long the loop is held: a blocking ``checkpoint.save``; for ``asynchronous=True`` the
call (staging every piece to host memory) plus the ``wait()`` of the previous save at the next one
(whatever of its write the step did not cover). Reported: median (min) of the step alone and of each
variant's hold.

    .venv/bin/python bench/checkpoint_save.py --layers 2 --hidden 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import autopar
    from autopar.models.resolve import build
    from autopar.runtime.checkpoint import save_load as checkpoint

    spec = build(f"gpt2:n_layer={args.layers},n_embd={args.hidden},n_head=4,batch=2,seq=64", device="cpu", seed=0)
    pipe = autopar.compile(spec.model, autopar.init_mesh("cpu", dp=1), kwargs=spec.kwargs)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-4)
    pipe.train_step(**spec.kwargs)
    root = Path(tempfile.mkdtemp())
    steps, blocking, asynchronous = [], [], []
    pending = None
    for i in range(args.repeats):
        t = time.perf_counter()
        pipe.train_step(**spec.kwargs)
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        checkpoint.save(root / f"b{i}", pipe, opt, step=i)
        blocking.append(time.perf_counter() - t)
        t = time.perf_counter()
        if pending is not None:
            pending.wait()
        pending = checkpoint.save(root / f"a{i}", pipe, opt, step=i, asynchronous=True)
        hold = time.perf_counter() - t
        t = time.perf_counter()
        pipe.train_step(**spec.kwargs)  # the step the background write overlaps
        steps.append(time.perf_counter() - t)
        asynchronous.append(hold)
    pending.wait()
    size = sum(f.stat().st_size for f in (root / "b0").iterdir()) / 2**20
    params = sum(p.numel() for p in pipe.parameters()) / 1e6

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f})"

    print(f"| {params:.1f} M | {size:.0f} MiB | {fmt(steps)} | {fmt(blocking)} | {fmt(asynchronous)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
