"""Train a small GPT on real text with autopar, the whole loop: any mesh, each rank reading only its shard of
the data, gradient clipping, AdamW with two parameter groups, a cosine schedule with warm-up, periodic
evaluation, checkpoints and a progress bar.

    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,tp=2
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,dp=2 --microbatches 4 --zero 2
    torchrun --nproc-per-node 8 examples/train_lm.py --mesh pp=2,dp=2,tp=2 --ckpt-dir out/lm/ckpt --ckpt-every 50
    torchrun --nproc-per-node 8 examples/train_lm.py --mesh pp=2,dp=2,tp=2 --ckpt-dir out/lm/ckpt --resume
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,tp=2 --schedule zbv --microbatches 4 --compile
    python examples/train_lm.py --reference      # the same training in one process, plain PyTorch

The corpus is the bytes of the Python standard library's source files (``autopar.data.text_corpus``: on
every machine with Python, nothing downloaded), cut into windows of ``--seq + 1`` bytes; the last tenth
is held out for evaluation. Every rank draws the same global batches (``autopar.data.BatchSampler``,
one seed) and loads only its rows of them; a pipeline's middle stages load nothing. ``--reference``
runs the identical loop on the plain model with ``torch.nn.utils.clip_grad_norm_`` and
``torch.optim.AdamW``, so the two loss curves can be compared (in float64, ``--dtype float64``, they
agree to about 1e-12). With CUDA each process uses NCCL and one GPU; on CPU gloo and one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.data import BatchSampler, text_corpus

# --------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0  # autopar's dropout masks are mesh-invariant, not eager PyTorch's: 0 to compare


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln_1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln_2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a head tied to the token embedding.
    ``forward`` returns the mean cross-entropy over the labels that are not -100, and the logits."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.seq, c.dim)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialization: small weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), logits


def no_decay(name: str) -> bool:
    """Biases and LayerNorm weights get no weight decay (the second parameter group)."""
    return name.endswith(".bias") or ".ln_" in name or name.startswith("ln_")


# --------------------------------------------------------------------------------------------------
# The data


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq + 1`` tokens: ``input_ids`` and the next tokens as ``labels``."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.tokens[i * self.seq : (i + 1) * self.seq + 1]
        return {"input_ids": w[:-1], "labels": w[1:]}


def datasets(args) -> tuple[Windows, Windows]:
    tokens = text_corpus(args.max_bytes)
    cut = len(tokens) * 9 // 10
    return Windows(tokens[:cut], args.seq), Windows(tokens[cut:], args.seq)


def lr_factor(step: int, args) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine from 1 down to ``--min-lr-ratio``."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------------
# The loop


def run(args) -> dict:
    """Train (and evaluate, checkpoint) as ``args`` say; returns the curves. On a mesh, call it on every
    rank of an initialized process group; with ``args.reference`` in one process, plain PyTorch."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    config = GPTConfig(seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers, dropout=args.dropout)
    model = GPT(config).to(dtype)
    train_set, val_set = datasets(args)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    groups = lambda name: {"weight_decay": 0.0} if no_decay(name) else {}  # noqa: E731
    adamw = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": args.weight_decay}
    if args.reference:
        if args.compile:  # the same comparison compiled: the plain model through torch.compile
            model.compile()
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for n, p in named if not no_decay(n)]},
             {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}],
            **adamw,
        )  # fmt: skip
        step_fn = _reference_step(model, opt, args.clip)
        samplers = (BatchSampler(len(train_set), args.batch, seed=args.seed),
                    BatchSampler(len(val_set), args.batch, shuffle=False))  # fmt: skip
    else:
        from autopar.api import parse_mesh

        mesh = autopar.init_mesh(**dict(parse_mesh(args.mesh).axes))
        example = torch.utils.data.default_collate([train_set[i] for i in range(args.batch)])
        model = autopar.compile(
            model, mesh, kwargs=example, microbatches=args.microbatches, schedule=args.schedule,
            zero=args.zero, batch="local", seed=args.seed, torch_compile=args.compile,
        )  # fmt: skip
        # two groups by the model's own parameter names (ZeRO shards each group's states as the plan says)
        opt = model.make_optimizer(torch.optim.AdamW, groups, max_grad_norm=args.clip, **adamw)
        step_fn = _parallel_step(model)
        samplers = (BatchSampler(len(train_set), args.batch, model, seed=args.seed),
                    BatchSampler(len(val_set), args.batch, model, shuffle=False))  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    start = _resume(args, model, opt, sched) if args.resume else 0
    # the inputs this rank's stages read: all of them in one process; none on a pipeline's middle stages
    needs = ("input_ids", "labels") if args.reference else autopar.data.layout(model).inputs
    train_batches = _batches(train_set, samplers[0], needs, start)
    out = {"loss": [], "grad_norm": [], "lr": [], "eval": []}
    from tqdm import tqdm

    bar = tqdm(total=args.until or args.steps, initial=start, disable=rank != 0 or not args.progress, unit="step")
    for step in range(start + 1, (args.until or args.steps) + 1):
        out["lr"].append(opt.param_groups[0]["lr"])
        loss, norm = step_fn(next(train_batches))
        sched.step()
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        bar.set_postfix(loss=f"{out['loss'][-1]:.4f}")
        bar.update()
        if args.eval_every and step % args.eval_every == 0:
            out["eval"].append((step, evaluate(model, _batches(val_set, samplers[1], needs), args.eval_batches)))
        if args.ckpt_dir and args.ckpt_every and step % args.ckpt_every == 0 and not args.reference:
            _save(args, model, opt, sched, step)
    bar.close()
    return out


def _batches(data: Windows, sampler: BatchSampler, needs, start: int = 0):
    """Batches of ``data`` epoch after epoch from batch ``start`` on: this rank's rows of the inputs in
    ``needs`` (nothing is loaded for a rank whose stages read no input)."""
    per_epoch = len(data) // sampler.batch_size
    epoch, skip = divmod(start, per_epoch)
    while True:
        sampler.set_epoch(epoch, start=skip)
        if not needs:
            yield from ({} for _ in range(len(sampler)))
        else:
            for batch in torch.utils.data.DataLoader(data, batch_sampler=sampler):
                yield {k: v for k, v in batch.items() if k in needs}
        epoch, skip = epoch + 1, 0


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, clip: float):
    def step(batch):
        loss = model(**batch)[0]
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return loss, norm

    return step


def _parallel_step(model):
    def step(batch):
        loss = model.train_step(**batch)  # forward, backward, reduction, clipping and AdamW's step
        return loss, model.grad_norm

    return step


@torch.no_grad()
def evaluate(model: nn.Module, batches, n: int) -> float:
    """The mean loss over the first ``n`` held-out batches, dropout off."""
    model.eval()
    losses = [model(**b)[0] for b, _ in zip(batches, range(n))]
    model.train()
    return torch.stack(losses).mean().item()


def _save(args, model, opt, sched, step: int) -> None:
    from autopar import checkpoint

    # the schedule's state and the step go in as JSON; checkpoint.latest() finds the newest committed save
    checkpoint.save(Path(args.ckpt_dir) / f"step{step:06d}", model, opt, lr_scheduler=sched, step=step, extra=step)


def _resume(args, model, opt, sched) -> int:
    from autopar import checkpoint

    last = checkpoint.latest(args.ckpt_dir)
    if last is None:
        return 0
    return int(checkpoint.load(last, model, opt, lr_scheduler=sched))  # the saved extra: the step


# --------------------------------------------------------------------------------------------------
# The command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="dp=2,tp=2", help="mesh axes; their product is the number of processes")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (gpipe, 1f1b, interleaved, wave, scp)")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage over the dp axes (0-3)")
    p.add_argument("--reference", action="store_true", help="train the plain model in this one process")
    p.add_argument("--compile", action="store_true", help="compile each rank's programs with torch.compile (Inductor)")
    p.add_argument("--steps", type=int, default=200, help="steps of the learning-rate schedule")
    p.add_argument("--until", type=int, default=0, help="stop after this step (0: --steps); --resume goes on")
    p.add_argument("--batch", type=int, default=16, help="global batch (windows per step, all ranks together)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="largest global gradient norm")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--out", default=None, help="write the curves as JSON (rank 0)")
    return p


def main() -> None:
    args = parser().parse_args()
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not args.reference:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        torch.set_num_threads(1)
    out = run(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        evals = "".join(f", eval {loss:.4f} at step {step}" for step, loss in out["eval"][-1:])
        print(f"loss {out['loss'][0]:.4f} -> {out['loss'][-1]:.4f}{evals}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
