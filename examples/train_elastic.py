"""Train under torchrun with a checkpoint every few steps, so a job that loses a rank restarts and goes on.

A template for a fault-tolerant run of a compiled model, on one node or many (docs/user_guide.md,
"Multi-node launch, restarts and SLURM", has the cluster and SLURM commands):

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1    # restarts need a fresh store each (autopar.api.check_restartable)
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_elastic.py --mesh pp=2 \\
        --steps 20 --every 5 --ckpt-dir out/elastic --fail-at 1:8
    # two nodes: this on every node, HOST the first one (here: twice on this machine, HOST 127.0.0.1)
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id job1 \\
        --max-restarts 3 examples/train_elastic.py --mesh pp=2 --steps 20 --every 5 --ckpt-dir out/elastic
    python examples/train_elastic.py --reference --steps 20    # the same training in one process, no autopar

Every rank compiles the model for ``--mesh`` (the plan comes from the cache after a restart), resumes
from the newest committed checkpoint under ``--ckpt-dir`` if there is one (model, optimizer,
learning-rate schedule and the data position), and checkpoints every ``--every`` steps. When a process
dies, torchrun stops the others and starts the group again (``--max-restarts``); it resumes from the
last checkpoint, and a save cut short is never taken for one (``checkpoint.latest`` skips it). The
steps after the resume are the steps the lost run would have taken: the data of step ``n`` depends
on ``n`` alone. ``--fail-at RANK:STEP`` tries it: that rank kills itself (SIGKILL) in the middle of
that step, after its first stage forward, on the first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0: torchrun counts a restart on the node whose process died; the other nodes rejoin uncounted).

The checkpoint directory must be visible to every node (a shared file system): each rank writes its
own shards, and on resume reads those of the mesh it runs on now, whatever mesh saved them. The model
is a MODEL string (``autopar.models.resolve``: a preset with overrides, or ``path/to/file.py:fn``), built with
real weights from ``--seed`` on every rank; on CPU every process uses gloo and one thread, with CUDA
NCCL and one GPU per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="tiny-gpt2:batch=8", help="MODEL string: preset[:overrides] or file.py:fn")
    p.add_argument("--mesh", default="pp=2", help="mesh axes; their product is the number of processes")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved", "wave", "scp"))
    p.add_argument("--microbatches", type=int, default=2, help="the batch is cut into this many microbatches")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the dp axes")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (resumed runs included)")
    p.add_argument("--every", type=int, default=5, help="checkpoint after every this many steps")
    p.add_argument("--keep", type=int, default=2, help="keep this many newest checkpoints (0: all)")
    p.add_argument("--ckpt-dir", default="out/elastic", help="checkpoints go to CKPT_DIR/step-N")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate after the warmup")
    p.add_argument("--warmup", type=int, default=4, help="steps of linear learning-rate warmup")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective or transfer may wait")
    p.add_argument(
        "--losses",
        default=None,
        help="rank 0 appends a JSON line per step: the step this run started from, the step, its loss",
    )
    p.add_argument("--export", default=None, help="at the end, the whole model to this safetensors file")
    p.add_argument("--fail-at", default=None, metavar="RANK:STEP", help="kill RANK in STEP (first attempt only)")
    p.add_argument("--reference", action="store_true", help="train the plain model in this one process instead")
    args = p.parse_args(argv)
    for name, least in (("steps", 1), ("every", 1), ("microbatches", 1), ("warmup", 1), ("keep", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name} must be at least {least}, not {getattr(args, name)}")
    if args.fail_at is not None:
        rank, _, step = args.fail_at.partition(":")
        if not (rank.isdigit() and step.isdigit() and 1 <= int(step) <= args.steps):
            p.error(f"--fail-at takes RANK:STEP with STEP in 1..{args.steps} (--steps), not {args.fail_at!r}")
        args.fail_at = (int(rank), int(step))
    return args


class Data:
    """The batch of every step, drawn from ``(seed, step)`` alone, and the position: a ``Stateful``
    object the checkpoint carries, so a resumed run reads the batches the lost one would have."""

    def __init__(self, example: tuple[tuple, dict], vocab: int, seed: int):
        self.example, self.vocab, self.seed = example, vocab, seed
        self.step = 0  # steps done: the next batch is step + 1's

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]

    def batch(self, step: int) -> tuple[tuple, dict]:
        """Step ``step``'s inputs, shaped like the example ones: token ids below the vocabulary, or normals."""
        g = torch.Generator().manual_seed((self.seed << 32) + step)

        def draw(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.dtype.is_floating_point:
                return torch.randn(x.shape, generator=g, dtype=x.dtype)
            return torch.randint(0, self.vocab, x.shape, generator=g, dtype=x.dtype)

        return pytree.tree_map(draw, self.example)


def build(args: argparse.Namespace) -> tuple[Any, Data]:
    """The model with real weights from the seed, and its data."""
    from autopar.models.resolve import build as build_model

    spec = build_model(args.model, device="cpu", seed=args.seed)
    vocab = getattr(getattr(spec.model, "config", None), "vocab_size", None) or 2
    return spec, Data((spec.args, spec.kwargs), vocab, args.seed)


def schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``--warmup`` steps, then the constant rate."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))


def reference(args: argparse.Namespace) -> tuple[list[float], torch.nn.Module]:
    """The same training of the plain model in one process, uninterrupted: the losses and the trained model."""
    spec, data = build(args)
    model = spec.model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = schedule(opt, args)
    losses = []
    for step in range(1, args.steps + 1):
        a, kw = data.batch(step)
        loss = pytree.tree_leaves(model(*a, **kw))[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, model


def _kill_after_first_forward(why: str) -> Callable[[], None]:
    """From now on, the first module this process runs ends it with SIGKILL once its forward returned (as a
    lost node would: no exception, no cleanup), saying ``why`` first; returns the remover."""

    def hook(*_: Any) -> None:
        print(why, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    return torch.nn.modules.module.register_module_forward_hook(hook).remove


def _prune(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest committed checkpoints under ``root`` (rank 0)."""
    from autopar.errors import CheckpointError
    from autopar.runtime.checkpoint.files import read_manifest

    done = []
    for d in root.glob("step-*"):
        try:
            done.append((read_manifest(d)["step"], d))
        except CheckpointError:  # not a committed checkpoint: an interrupted save, left for the next save there
            continue
    for _, d in sorted(done)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def train(args: argparse.Namespace) -> None:
    """One torchrun rank: compile, resume from the latest checkpoint, train to ``--steps``."""
    import autopar
    from autopar import checkpoint
    from autopar.api import parse_mesh

    autopar.api.check_restartable()  # before the process group: init_mesh checks it too, later
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    if args.fail_at is not None and args.fail_at[0] >= dist.get_world_size():
        raise SystemExit(f"--fail-at names rank {args.fail_at[0]}, but the ranks are 0..{dist.get_world_size() - 1}")
    mesh = autopar.init_mesh(**dict(parse_mesh(args.mesh).axes))
    spec, data = build(args)
    config = autopar.TrainConfig(
        zero=args.zero, microbatches=args.microbatches, schedule=args.schedule, timeout=args.timeout, seed=args.seed
    )
    pipe = autopar.compile(spec.model, mesh, args=spec.args, kwargs=spec.kwargs, config=config)
    del spec  # each rank keeps only its shards
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=args.lr)
    sched = schedule(getattr(opt, "optimizer", opt), args)  # ZeRO's optimizer wraps the torch one
    state = {"lr_scheduler": sched, "objects": {"data": data}}
    root = Path(args.ckpt_dir)
    last = checkpoint.latest(root)
    if last is not None:
        checkpoint.load(last, pipe, opt, **state)
    start = data.step
    if rank == 0:
        print(f"restart {attempt} on this node: {'resumed from ' + str(last) if last else 'starting'} at step {start}")
    log = open(args.losses, "a") if args.losses and rank == 0 else None  # noqa: SIM115 - open for the whole run
    while data.step < args.steps:
        step = data.step + 1
        remove = None
        if args.fail_at == (rank, step) and attempt == 0:
            remove = _kill_after_first_forward(f"rank {rank}: SIGKILL in step {step} (--fail-at)")
        a, kw = data.batch(step)
        loss = pipe.train_step(*a, **kw).item()
        if remove is not None:
            remove()
        sched.step()
        data.step = step
        if log is not None:
            log.write(json.dumps({"start": start, "step": step, "loss": loss}) + "\n")
            log.flush()
            print(f"step {step}: loss {loss:.6f}")
        if step % args.every == 0 or step == args.steps:
            checkpoint.save(root / f"step-{step}", pipe, opt, step=step, **state)
            if rank == 0 and args.keep:
                _prune(root, args.keep)
    if args.export:
        checkpoint.save_safetensors(pipe, args.export)
    if log is not None:
        log.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reference:
        torch.set_num_threads(1)
        losses, _ = reference(args)
        for step, loss in enumerate(losses, 1):
            print(f"step {step}: loss {loss:.6f}")
        return 0
    if "LOCAL_RANK" not in os.environ:
        sys.exit("run it with torchrun (see --help), or with --reference for the single-process run")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
