"""ZeRO-3 in bf16, eager beside ``torch_compile=True``: rank 0's bytes over one training step (issue 33).

    .venv/bin/python bench/zero3_bf16_compiled_memory.py        # GPT-2 6 x 256, vocab 4096, batch 8 x 128, dp=2

Each mode compiles the model on ``--ranks`` gloo processes (one thread each; mesh dp=N, ZeRO-3 over dp,
``precision="bf16"``) and runs two warm-up steps (the first compiles), then one step (forward, backward, SGD)
measured on rank 0 by the runtime's own counters: the bytes autograd saved for the backward (``SavedTensors``,
each storage once; ZeRO-3's tokens hold none) and ZeRO-3's most gathered bytes alive at once (the fp32 units
and their bf16 copies, ``Zero3Params.peak_gathered``) beside the plan's price (``predicted_categories``'
``gathered``): one unit at a time, the compiled step holds what the eager one does. Not the allocator's peak
(``peak_step_bytes``): the profiler's op events miss the buffers Inductor's compiled code allocates (a compiled
matmul and softmax over 4 MiB tensors recorded 4 bytes), so it would undercount the compiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _launch import add_model_args, init_worker, spawn_json  # noqa: E402
from vs_torch_systems import LossOnly  # noqa: E402


def run_one(rank: int, world: int, port: int, compiled: bool, a, out: str) -> None:
    import autopar
    from autopar.models.resolve import build
    from autopar.runtime.measure.memory import SavedTensors, predicted_categories

    init_worker(rank, world, port, a.timeout)
    spec = (
        f"gpt2:n_layer={a.layers},n_embd={a.hidden},n_head={a.heads},vocab_size={a.vocab},"
        f"n_positions={a.seq},batch={a.batch},seq={a.seq}"
    )
    m = build(spec, device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    mesh = autopar.init_mesh("cpu", dp=world)
    module = autopar.compile(model, mesh, kwargs=batch, zero=3, precision="bf16", torch_compile=compiled)
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)

    def step():
        module.train_step(**batch)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    module.zero3.reset_peak()
    with SavedTensors(params + list(batch.values())) as saved:
        step()
    if rank == 0:
        result = {
            "saved": saved.bytes,
            "gathered": module.zero3.peak_gathered(),
            "priced": predicted_categories(module)["gathered"],
            "units": module.zero3.unit_bytes(),
        }
        with open(out, "w") as f:
            json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    add_model_args(p)
    p.set_defaults(layers=6)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = {
        name: spawn_json(run_one, a.ranks, compiled, a) for name, compiled in (("eager", False), ("compiled", True))
    }
    units = runs["eager"]["units"]
    whole = sum(b for _, b in units)
    model = f"GPT-2 {a.layers} x {a.hidden}, vocab {a.vocab}, batch {a.batch} x {a.seq}"
    print(f"dp={a.ranks} ZeRO-3 bf16, {model}; rank 0")
    print(f"units: {len(units)} (root {units[0][1] / 2**20:.2f} MiB, a block {units[1][1] / 2**20:.2f} MiB fp32 whole)")
    print(f"the whole model gathered in fp32 and bf16: {1.5 * whole / 2**20:.2f} MiB")
    print("| mode | saved for backward | gathered at once (units and copies) | priced |")
    print("| --- | --- | --- | --- |")
    for name, r in runs.items():
        mib = [f"{r[k] / 2**20:.2f} MiB" for k in ("saved", "gathered", "priced")]
        print(f"| {name} | {' | '.join(mib)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
