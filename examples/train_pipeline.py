"""Train a preset with pipeline, data and tensor parallelism: the model built on the meta device,
initialized shard by shard, any schedule; prints the loss, the measured bubble beside the simulated one,
and writes the measured Gantt chart and a checkpoint.

    torchrun --nproc-per-node 2 examples/train_pipeline.py --mesh pp=2
    torchrun --nproc-per-node 4 examples/train_pipeline.py --mesh pp=2,dp=2 --schedule interleaved --chunks 2
    torchrun --nproc-per-node 8 examples/train_pipeline.py --mesh pp=2,dp=2,tp=2 --schedule wave --zero 2

On CPU every process uses gloo and one thread; with CUDA, NCCL and one GPU per process.
"""

from __future__ import annotations

import argparse
import os
from fractions import Fraction

import torch
import torch.distributed as dist

import autopar
from autopar import checkpoint
from autopar.api import parse_mesh
from autopar.models.resolve import build
from autopar.schedule.action_costs import Costs
from autopar.schedule.simulator import simulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-gpt2:batch=8")
    p.add_argument("--mesh", default="pp=2")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "wave", "scp"))
    p.add_argument("--chunks", type=int, default=2, help="interleaved: model chunks per rank")
    p.add_argument("--waves", type=int, default=1, help="wave: waves")
    p.add_argument("--alpha1", default="0", help="scp: Merak's alpha_1 (stage-aware recomputation)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage over the dp axes (0, 1 or 2)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="out/pipeline", help="chart and checkpoint directory")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    axes = dict(parse_mesh(args.mesh).axes)
    mesh = autopar.init_mesh(**axes)
    spec = build(args.model, device="meta")  # no weights allocated: each rank initializes its shards
    opts = {
        "interleaved": {"chunks": args.chunks},
        "wave": {"waves": args.waves},
        "scp": {"alpha1": Fraction(args.alpha1)},
    }.get(args.schedule, {})
    batch = build(args.model, device="cpu", seed=0).kwargs  # example inputs of the global batch
    pipe = autopar.compile(
        spec.model,
        mesh,
        kwargs=batch,
        microbatches=args.microbatches,
        schedule=args.schedule,
        schedule_options=opts,
        zero=args.zero,
        seed=0,
    )
    pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        b = {k: torch.randint(0, 128, v.shape, generator=g) for k, v in batch.items()}
        loss = pipe.train_step(**b)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    measured = pipe.measured()
    simulated = simulate(pipe.schedule, Costs.uniform(pipe.schedule.num_stages))
    if dist.get_rank() == 0:
        from autopar.schedule.chart import save_gantt

        os.makedirs(args.out, exist_ok=True)
        save_gantt(measured, os.path.join(args.out, "measured.png"))
        print(
            f"bubble: measured {float(measured.bubble_ratio):.3f}, simulated with equal stages "
            f"{float(simulated.bubble_ratio):.3f}; chart in {args.out}/measured.png"
        )
    checkpoint.save(os.path.join(args.out, "ckpt"), pipe, pipe.optimizer, extra={"step": args.steps})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
