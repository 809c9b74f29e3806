"""Before/after of capturing Hugging Face's causal attention as its eager forward calls it (``passes/hf_masks.py``),
on this CPU: GPT-2's autopar training step (``autopar.compile`` on one gloo process, dp=1; ``train_step`` and
AdamW) at each sequence length, captured with the patch (SDPA ``is_causal=True``, no mask) and without it (the
``[b, 1, s, s]`` boolean mask transformers builds under export, as before the change).

    OMP_NUM_THREADS=1 python bench/causal_mask.py [--seqs 1024,2048] [--rounds 2] [--steps 3]

Each (sequence, variant) runs in its own process, the variants alternating within a round. Step time: the median
over ``--steps`` timed steps after one warm-up, in wall time and in the main thread's CPU time
(``time.thread_time``: one thread computes, so it holds the step's compute without the time other processes
took the core). Peak: the process's resident-set high-water mark during the timed steps above its size before
them (``/proc/self/statm`` sampled every millisecond), so it counts the step's activations and the mask.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def child(spec: str, patched: bool, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import autopar
    import autopar.passes.capture as capture
    from autopar.models.resolve import build

    if not patched:  # the capture as before passes/hf_masks.py
        capture.eager_masks = contextlib.nullcontext
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    m = build(spec, device="cpu", seed=0)
    model = autopar.compile(m.model, autopar.init_mesh("cpu", dp=1), m.args, m.kwargs)
    sdpa = [op for op in model.train_program.ops if op.target == "aten.scaled_dot_product_attention"]
    masked = sum(len(op.args) > 3 and op.args[3] is not None for op in sdpa)
    opt = model.make_optimizer(torch.optim.AdamW, lr=1e-4)

    def step() -> None:
        model.train_step(*m.args, **m.kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    done.set()
    sampler.join()
    dist.destroy_process_group()
    return {
        "wall": statistics.median(wall),
        "cpu": statistics.median(cpu),
        "peak_mib": (peak[0] - base) / 2**20,
        "sdpa": len(sdpa),
        "masked": masked,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1024,2048")
    ap.add_argument("--model", default="gpt2:n_layer=2,vocab_size=1024,batch=2", help="the preset and overrides")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--patched", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, bool(a.patched), a.steps)))
        return
    results: dict[tuple[int, bool], list[dict]] = {}
    for r in range(a.rounds):
        for seq in (int(s) for s in a.seqs.split(",")):
            order = (False, True) if r % 2 == 0 else (True, False)
            for patched in order:
                spec = f"{a.model},n_positions={seq},seq={seq}"
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    spec,
                    "--patched",
                    str(int(patched)),
                    "--steps",
                    str(a.steps),
                ]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                results.setdefault((seq, patched), []).append(json.loads(out))
                print(f"round {r} seq {seq} {'after' if patched else 'before'}: {out}", flush=True)
    print(f"\n{a.model}, {a.rounds} round(s) of {a.steps} steps, load average {os.getloadavg()[0]:.1f}")
    print("| seq | capture | SDPA calls with a mask | step wall (s) | step CPU (s) | peak above start (MiB) |")
    print("|---|---|---|---|---|---|")
    for (seq, patched), runs in sorted(results.items()):
        med = {k: statistics.median(x[k] for x in runs) for k in ("wall", "cpu", "peak_mib")}
        what = "after: is_causal, no mask" if patched else "before: explicit mask"
        print(
            f"| {seq} | {what} | {runs[0]['masked']} of {runs[0]['sdpa']} | {med['wall']:.3f} | {med['cpu']:.3f} "
            f"| {med['peak_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
