"""The pairs of bench/torch_compile_vs_peers.py on GPUs: autopar ``torch_compile=True`` beside DDP and FSDP2 under
``torch.compile`` and beside autopar eager, bf16 (fp32 masters), step time and MFU.

    torchrun --nproc-per-node 8 bench/gpu/torch_compile_pairs.py                  # GPT-2 medium, every pair
    torchrun --nproc-per-node 1 bench/gpu/torch_compile_pairs.py --pairs self --model gpt2 --batch 8 --seq 512

Every system is built in the same processes (one GPU each, NCCL) and the pair's two alternate by rounds, A B A B,
--repeats rounds of --steps timed steps after --warmup (the first compiles); a pair's line is the median of its
per-round ratios (A / B; < 1: autopar faster) with their min-max, and each system's MFU by Megatron's formula
over the device's dense bf16 peak (bench/gpu/train_gpt2.py). With one GPU the dp mesh has one rank (DDP and
FSDP2 then only wrap). Exits non-zero without CUDA. Not run on the CPU machines (no GPU was lent while it was
written); ``python bench/gpu/torch_compile_pairs.py --help`` works anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from train_gpt2 import megatron_flops, peak_flops, real_inputs  # noqa: E402

PAIRS = {
    "dp": ("autopar-compiled", "ddp-compiled"),
    "zero3": ("autopar-zero3-compiled", "fsdp2-compiled"),
    "self": ("autopar-compiled", "autopar-eager"),
}


def build(system: str, a):
    """The step function of ``system`` on this rank's GPU, and the model's config (for the FLOP count)."""
    import autopar
    from autopar.models.resolve import build as build_model

    spec_text = f"{a.model}:embd_pdrop=0,attn_pdrop=0,resid_pdrop=0,batch={a.batch},seq={a.seq}"
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    if system.startswith("autopar"):
        spec = build_model(spec_text, device="meta", seed=0)
        batch = real_inputs(spec, "cuda")
        cm = autopar.compile(
            spec.model, autopar.init_mesh("cuda", dp=world), kwargs=batch, precision="bf16",
            zero=3 if "zero3" in system else 0, torch_compile=system.endswith("-compiled"),
        )  # fmt: skip
        opt = cm.make_optimizer(torch.optim.AdamW, lr=1e-4)
        return (lambda: cm.train_step(**batch)), spec.model.config
    spec = build_model(spec_text, device="cuda", seed=0)
    model = spec.model
    local = {k: v.chunk(world)[rank].cuda() for k, v in spec.kwargs.items()}
    if system == "ddp-compiled":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp)
        wrapped = fully_shard(model, mp_policy=mp)
    fn = torch.compile(wrapped)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=system == "ddp-compiled"):  # FSDP2 casts itself
            loss = fn(**local).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, spec.model.config


def timed(step, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="dp,zero3,self")
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/torch_compile_pairs.py: no CUDA device; run it on a GPU machine with torchrun")
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    peak = peak_flops(a.peak_tflops) * dist.get_world_size()
    rows = []
    for pair in a.pairs.split(","):
        systems = PAIRS[pair]
        built = {s: build(s, a) for s in systems}
        for s in systems:
            for _ in range(a.warmup):
                built[s][0]()
        rounds: dict[str, list[float]] = {s: [] for s in systems}
        for _ in range(a.repeats):
            for s in systems:  # A B A B
                rounds[s].append(timed(built[s][0], a.steps))
        c = built[systems[0]][1]
        flops = megatron_flops(a.batch, a.seq, c.n_layer, c.n_embd, c.vocab_size)
        ratios = [x / y for x, y in zip(rounds[systems[0]], rounds[systems[1]])]
        row = {
            "pair": pair,
            "systems": systems,
            "ratio": statistics.median(ratios),
            "range": (min(ratios), max(ratios)),
            "s_per_step": {s: statistics.median(v) for s, v in rounds.items()},
            "mfu": {s: flops / statistics.median(v) / peak for s, v in rounds.items()},
        }
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
        del built
        torch.cuda.empty_cache()
    if dist.get_rank() == 0 and a.json:
        with open(a.json, "a") as f:
            where = {"device": torch.cuda.get_device_name(), "ranks": dist.get_world_size()}
            for row in rows:
                f.write(json.dumps({**row, **where}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
