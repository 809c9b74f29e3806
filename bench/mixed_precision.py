"""fp32 against bf16 plans on CPU: step time and measured bytes per rank (issue 17).

    .venv/bin/python bench/mixed_precision.py                      # GPT-2 4 x 256, vocab 4096, 8 x 128, dp=2
    .venv/bin/python bench/mixed_precision.py --repeats 2 --steps 3 --layers 2 --hidden 64 --seq 32 --vocab 512

Each run compiles the model on ``--ranks`` gloo processes (one thread each; mesh dp=N) with
``mixed_precision`` fp32 (none) or bf16 and trains it with AdamW (forward, the user's backward, the step),
alternating fp32 bf16 fp32 bf16 ... for ``--repeats`` rounds, each run in fresh processes. Per run:
the median of ``--steps`` timed steps (after one warm-up step, the slowest rank's), and on rank 0 the
bytes it holds: parameters, gradients, optimizer states (Adam's moments, and ZeRO's slices when
planned), and activations (what autograd saved for backward, each storage once: with bf16 this
includes the per-use bf16 weight copies), beside the cost model's prediction of the model states
(``CostModel.state_bytes``). bf16 compute on CPU is emulated by most kernels (converted to fp32 and
back), so the CPU time says nothing of a GPU's; the bytes are what a GPU run would hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _launch import add_model_args, free_port, init_worker  # noqa: E402
from vs_torch_systems import LossOnly  # noqa: E402


def run_one(rank: int, world: int, port: int, precision: str, a, out: str) -> None:
    import autopar
    from autopar.models.resolve import build
    from autopar.passes.shard import ShardOptions
    from autopar.runtime.grads.zero import ZeroOptimizer
    from autopar.runtime.measure.memory import SavedTensors, tensor_bytes
    from autopar.solver.sharding.cost import CostModel, TrainingSetup

    init_worker(rank, world, port, a.timeout)
    torch.manual_seed(0)
    spec = (
        f"gpt2:n_layer={a.layers},n_embd={a.hidden},n_head={a.heads},vocab_size={a.vocab},"
        f"n_positions={a.seq},batch={a.batch},seq={a.seq}"
    )
    m = build(spec, device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    options = ShardOptions(setup=TrainingSetup(zero=a.zero))
    mp_arg = None if precision == "fp32" else precision
    module = autopar.compile(
        model, autopar.init_mesh("cpu", dp=world), kwargs=batch, options=options, mixed_precision=mp_arg
    )
    opt = module.make_optimizer(torch.optim.AdamW, lr=1e-4)
    with SavedTensors() as saved:  # every saved storage once, weights' views included
        loss = module(**batch)
    loss.backward()
    grads = tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)
    opt.step()
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    if isinstance(opt, ZeroOptimizer):
        states += [f.master for f in opt.flats if f.params]
    cost = CostModel(module.program.mesh, module.setup)
    predicted = [0.0, 0.0, 0.0]
    for v in module.program.params:
        if v.type.is_float:
            predicted = [x + y for x, y in zip(predicted, cost.state_bytes(v.type, v.type.placements))]
    memory = {
        "params": tensor_bytes(module.parameters()),
        "grads": grads,
        "optimizer": tensor_bytes(states),
        "activations": saved.bytes,
        "predicted": dict(zip(("params", "grads", "optimizer"), predicted)),
    }
    opt.zero_grad()
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        module(**batch).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": med.item(), "memory": memory}, f)
    dist.destroy_process_group()


def spawn(precision: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_one, args=(a.ranks, free_port(), precision, a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    add_model_args(p)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    for r in range(a.repeats):
        for precision in runs:
            runs[precision].append(spawn(precision, a))
            print(f"[round {r + 1}] {precision}: {runs[precision][-1]['median_s']:.3f} s/step", file=sys.stderr)
    med = {k: statistics.median(x["median_s"] for x in v) for k, v in runs.items()}
    ratios = [b["median_s"] / f["median_s"] for f, b in zip(runs["fp32"], runs["bf16"])]
    print(f"dp={a.ranks} ZeRO-{a.zero}, GPT-2 {a.layers} x {a.hidden}, vocab {a.vocab}, batch {a.batch} x {a.seq}:")
    print("| precision | step (s, median) | params | grads | optimizer | activations (saved) | predicted states |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k, v in runs.items():
        m = v[0]["memory"]
        pr = m["predicted"]
        pred = f"{pr['params'] / 2**20:.2f} / {pr['grads'] / 2**20:.2f} / {pr['optimizer'] / 2**20:.2f} MiB"
        print(
            f"| {k} | {med[k]:.3f} | {m['params'] / 2**20:.2f} MiB | {m['grads'] / 2**20:.2f} MiB | "
            f"{m['optimizer'] / 2**20:.2f} MiB | {m['activations'] / 2**20:.2f} MiB | {pred} |"
        )
    print(f"bf16 / fp32 step time: {statistics.median(ratios):.2f} (per round {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
