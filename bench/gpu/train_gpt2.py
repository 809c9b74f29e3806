"""bf16 training of GPT-2 XL on one GPU: autopar.compile beside eager and torch.compile'd eager, MFU and peak memory.

    python bench/gpu/train_gpt2.py                                 # gpt2-xl, batch 8 x 1024, 10 timed steps
    python bench/gpu/train_gpt2.py --model gpt2-medium --batch 4 --seq 512 --steps 5

Four variants, each in its own process (so one's memory does not count in another's peak), each training
with AdamW (lr 1e-4) under the same mixed-precision policy: bf16 compute, fp32 master weights, fp32
gradients and Adam states.

- ``autopar``: the model built on the meta device (initialized shard by shard), ``autopar.compile(model,
  init_mesh(dp=1), mixed_precision="bf16")`` on NCCL with world size 1, ``make_optimizer(AdamW)``,
  ``train_step``;
- ``eager``: the fp32 model on the GPU under ``torch.autocast("cuda", torch.bfloat16)``, the user's own
  ``loss.backward(); opt.step()`` (autocast casts each weight per use and keeps fp32 masters, the same policy);
- ``compiled``: the same with ``torch.compile(model)``;
- ``autopar-compiled``: ``autopar`` with ``torch_compile=True`` (its rank programs through Inductor).

Reported per variant: the median step time over ``--steps`` after ``--warmup`` steps, MFU by Megatron's
FLOP formula (Narayanan et al. 2021, without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per
step) over the device's dense bf16 peak, and ``torch.cuda.max_memory_allocated``; for autopar beside it
the cost model's prediction for its plan: the model states exactly (``CostModel.state_bytes``, checked on
CPU by tests/test_mixed_precision.py) and the ILP's whole per-device memory (states, the per-use bf16
copy and every activation of the program: an upper bound). Prints one JSON line per variant and a
Markdown table for BENCHMARKS.md. Exits non-zero without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("autopar", "autopar-compiled", "eager", "compiled")
# dense bf16 peak FLOP/s of the devices seen so far (the vendor's datasheet numbers, without sparsity)
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training step (forward + backward, no recomputation), Megatron's formula."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def peak_flops(override: float | None) -> float:
    if override:
        return override * 1e12
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    sys.exit(f"unknown device {name!r}: give its dense bf16 peak with --peak-tflops")


def real_inputs(spec, device: str) -> dict:
    """``spec``'s example inputs with values on ``device``: a model built on the meta device comes with meta
    inputs (shapes only); token ids are drawn in [0, vocab), float inputs from a normal distribution."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in spec.kwargs.items():
        if v.device.type == "meta":
            v = (
                torch.randint(spec.model.config.vocab_size, v.shape, generator=g)
                if not v.dtype.is_floating_point
                else torch.randn(v.shape, generator=g, dtype=v.dtype)
            )
        out[k] = v.to(device)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(args) -> dict:
    """One variant in this process: time the steps, read the peak memory."""
    from autopar.models.resolve import build

    spec_text = f"{args.model}:embd_pdrop=0,attn_pdrop=0,resid_pdrop=0,batch={args.batch},seq={args.seq}"
    torch.manual_seed(0)
    extra: dict = {}
    if args.variant.startswith("autopar"):
        import torch.distributed as dist

        import autopar
        from autopar.solver.sharding.cost import CostModel

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        spec = build(spec_text, device="meta", seed=0)
        batch = real_inputs(spec, "cuda")
        mesh = autopar.init_mesh("cuda", dp=1)
        model = autopar.compile(
            spec.model, mesh, kwargs=batch, precision="bf16", torch_compile=args.variant == "autopar-compiled"
        )
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-4)
        cost = CostModel(model.program.mesh, model.setup)
        states = sum(sum(cost.state_bytes(v.type, v.type.placements)) for v in model.program.params if v.type.is_float)
        extra["predicted_state_bytes"] = states
        extra["predicted_ilp_bytes"] = _ilp_memory(spec_text, model.setup)

        def step() -> None:
            model.train_step(**batch)

    else:
        spec = build(spec_text, device="cuda", seed=0)
        batch = {k: v.to("cuda") for k, v in spec.kwargs.items()}
        model = spec.model
        if args.variant == "compiled":
            model = torch.compile(model)
        opt = torch.optim.AdamW(spec.model.parameters(), lr=1e-4)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    config = spec.model.config
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops = megatron_flops(args.batch, args.seq, config.n_layer, config.n_embd, config.vocab_size)
    return {
        "variant": args.variant,
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "step_seconds": seconds,
        "step_spread": [min(times), max(times)],
        "mfu": flops / seconds / peak_flops(args.peak_tflops),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        **extra,
    }


def _ilp_memory(spec_text: str, setup) -> float:
    """The shard ILP's per-device memory for the same model, mesh and training setup (planned offline)."""
    from autopar.api import local_cluster_spec
    from autopar.ir.core import MeshSpec
    from autopar.passes.shard import ShardOptions
    from autopar.planner import plan_model

    opts = ShardOptions(cluster=local_cluster_spec("cuda", 1), setup=setup)
    report = plan_model(spec_text, MeshSpec((("dp", 1),)), opts, baselines=())
    return report.plan.stats["memory_per_device_bytes"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (TFLOP/s)")
    p.add_argument("--variant", choices=VARIANTS, default=None, help="run one, in-process")
    p.add_argument("--json", default=None, help="append each variant's JSON line to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu/train_gpt2.py needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    rows, failed = [], []
    for variant in VARIANTS:  # each runs even when one before it failed
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout[-5000:], out.stderr[-20000:], file=sys.stderr)
            print(f"FAILED: {variant} (exit {out.returncode})", file=sys.stderr, flush=True)
            failed.append(variant)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n{args.model}, batch {args.batch} x {args.seq}, bf16, AdamW, one {rows[0]['device']}:\n")
    print("| variant | step (s) | MFU | peak allocated (GiB) | predicted (GiB) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        pred = "-"
        if "predicted_state_bytes" in r:
            pred = f"states {r['predicted_state_bytes'] / 2**30:.2f}, ILP {r['predicted_ilp_bytes'] / 2**30:.2f}"
        print(f"| {r['variant']} | {r['step_seconds']:.3f} | {r['mfu']:.1%} | {r['peak_bytes'] / 2**30:.2f} | {pred} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
