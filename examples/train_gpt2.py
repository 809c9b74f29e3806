"""Train a small GPT-2 on 4 CPU processes (dp=2 x tp=2, gloo) with autopar, beside a single process.

    make demo                                     # the same as: python examples/train_gpt2.py
    python examples/train_gpt2.py --steps 60 --mesh dp=4
    python examples/train_gpt2.py --dump-dir out/demo/ir   # IR after each pass + each rank's code

On rank 0 ``autopar.compile`` logs what its plan does on each mesh axis: by default each axis does what its
name says (tp: Megatron's column/row-parallel layout, dp: batch split and gradients all-reduced).

The corpus is byte-level text made of the Python standard library's own source files (already on
every machine with Python; nothing is downloaded). The script runs the single-process reference
first, then launches the parallel run with torchrun and prints both losses side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from autopar.data import text_corpus as corpus

VOCAB = 256  # bytes


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield {"input_ids": window[:, :-1].contiguous(), "labels": window[:, :-1].contiguous()}


def build_model(args):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        activation_function="gelu_pytorch_tanh", loss_type="ForCausalLM",
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def train(model, args, progress: bool, desc: str) -> list[float]:
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    data = corpus()
    bar = tqdm(total=args.steps, desc=desc, disable=not progress, unit="step", dynamic_ncols=True)
    for b in batches(data, args.steps, args.batch, args.seq, args.seed):
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        bar.update()
    bar.close()
    return losses


def worker(args) -> None:
    """One torchrun rank."""
    import torch.distributed as dist

    import autopar
    from autopar.api import parse_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # compile logs what the plan does on each mesh axis (rank 0, logger "autopar"): show it
    logging.basicConfig(format="[rank 0] %(message)s")
    logging.getLogger("autopar").setLevel(logging.INFO)
    axes = dict(parse_mesh(args.mesh).axes)
    mesh = autopar.init_mesh("cpu", **axes)
    model = build_model(args)
    example = next(batches(corpus(), 1, args.batch, args.seq, args.seed))
    t0 = time.perf_counter()
    compiled = autopar.compile(model, mesh, kwargs=example, dump_dir=args.dump_dir)
    del model  # each rank keeps only its shards
    if rank == 0:
        local = sum(p.numel() for p in compiled.parameters())
        print(f"[rank 0] planned and sharded in {time.perf_counter() - t0:.1f} s; holds {local:,} parameters")
    t0 = time.perf_counter()
    losses = train(compiled, args, progress=rank == 0, desc=f"autopar {args.mesh}")
    if rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "seconds": time.perf_counter() - t0}))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mesh", default="dp=2,tp=2", help="mesh axes; the product is the number of processes")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-dir", default=None, help="write the IR after each pass and each rank's generated code")
    p.add_argument("--out", default="out/demo/parallel.json", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    from autopar.api import parse_mesh

    world = parse_mesh(args.mesh).size
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(f"corpus: {len(corpus()):,} bytes of Python standard library source; "
          f"GPT-2 with {args.n_layer} layers, hidden {args.n_embd}, "
          f"batch {args.batch} x seq {args.seq}")  # fmt: skip
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    reference = train(build_model(args), args, progress=True, desc="single process")
    ref_seconds = time.perf_counter() - t0

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           __file__, "--worker", *sys.argv[1:], "--out", args.out]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    subprocess.run(cmd, check=True, env=env)
    parallel = json.loads(Path(args.out).read_text())

    print(f"\n{'step':>5} {'autopar ' + args.mesh:>20} {'single process':>16} {'rel. diff':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(parallel["losses"], reference), 1):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        if i <= 3 or i % 10 == 0 or i == len(reference):
            print(f"{i:>5} {a:>20.6f} {b:>16.6f} {rel:>10.1e}")
    print(f"\nloss {reference[0]:.3f} -> {reference[-1]:.3f} "
          f"(uniform over bytes would be {math.log(VOCAB):.3f}); "
          f"largest relative loss difference {worst:.1e} over {len(reference)} steps")  # fmt: skip
    print(f"time: single process {ref_seconds:.1f} s, {world} gloo processes {parallel['seconds']:.1f} s "
          "(2 CPU cores shared; this demo shows exactness, not speed)")  # fmt: skip
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
