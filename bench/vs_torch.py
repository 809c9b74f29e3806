"""autopar beside what users write with torch, same model and ranks: step-time ratios and live bytes per category.

    .venv/bin/python bench/vs_torch.py                              # every pair, issue 13's sizes
    .venv/bin/python bench/vs_torch.py --pairs dp --repeats 2 --steps 3 --layers 2 --hidden 64 --seq 32 --vocab 512
    .venv/bin/python bench/vs_torch.py --pp                         # also bench/pipeline_vs_torch.py (pp rows)

Pairs (autopar / peer), each run in fresh gloo processes (one thread per rank), alternating
A B A B ... for --repeats rounds (shared/BENCHMARKING.md):

- ``dp``: autopar.compile on dp=2 (the default plan: fastest within the memory) vs torch DDP; GPT-2;
- ``zero3``: autopar with ZeRO-3 on dp=2 vs FSDP2 (``fully_shard`` per decoder layer, then the root); LLaMA;
- ``tp``: autopar on tp=2 (its plan) vs DTensor TP (``parallelize_module``, Megatron's layout:
  q/k/v/gate/up column-wise, o/down row-wise); LLaMA;
- ``pp`` (``--pp``): ``bench/pipeline_vs_torch.py`` (1F1B, interleaved, ... vs torch.distributed.pipelining).

Each run times --steps training steps (forward, backward, AdamW step) after one warm-up and reports
their median (``--interleave``: each round builds both systems in the same fresh processes and
alternates their steps, A B B A ..., for a machine whose load changes between runs); a pair's line
is the ratio of the medians over rounds (autopar / peer; < 1: autopar
faster) with the min-max of the per-round ratios. Each model returns its loss only (the peers return no
logits gathered from other ranks either).

Memory: on rank 0 of each run, live tensor bytes by category after the warm-up's backward --
parameters, gradients, optimizer states (this rank's local tensors: shards count their local size),
activations (what autograd saved for backward, counted once per storage with saved-tensor hooks),
for autopar ZeRO-3 the most bytes of whole weights gathered at once during that step (its runtime's
counter of live gathered storages), and for autopar the cost model's prediction of the same
categories (parameters, gradients and Adam states from the plan's local shapes divided as ZeRO
divides them; activations: every op output of the planned program, the cost model's upper bound;
gathered: ZeRO-3's root unit and two largest blocks, ``solver.cost.zero3_gathered``). Communication
buffers are transient inside the collectives and not counted.

The machine is shared and timings are noisy: read ratios with their spread; record final numbers from
a quiet machine in BENCHMARKS.md with the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _launch import free_port, init_worker  # noqa: E402

PAIRS = {"dp": ("autopar-dp", "ddp"), "zero3": ("autopar-zero3", "fsdp2"), "tp": ("autopar-tp", "dtensor-tp")}


class LossOnly(torch.nn.Module):
    """A Hugging Face causal LM returning its loss only."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


def model_spec(system: str, a) -> str:
    if system in ("autopar-dp", "ddp"):
        return (
            f"gpt2:n_layer={a.layers},n_embd={a.hidden},n_head={a.heads},vocab_size={a.vocab},"
            f"n_positions={a.seq},batch={a.batch},seq={a.seq}"
        )
    return (
        f"tiny-llama:num_hidden_layers={a.layers},hidden_size={a.hidden},num_attention_heads={a.heads},"
        f"num_key_value_heads={a.heads},intermediate_size={4 * a.hidden},vocab_size={a.vocab},"
        f"max_position_embeddings={a.seq},batch={a.batch},seq={a.seq}"
    )


def _live_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[0] and key not in seen:
            seen.add(key)
            total += key[1]
    return total


class SavedBytes:
    """Bytes autograd saves for backward, each storage once (saved-tensor hooks)."""

    def __init__(self):
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        if s.data_ptr():
            self.saved[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def build_system(system: str, a, rank: int):
    """(module to call with the batch, optimizer, batch kwargs, predicted bytes per category or None)."""
    import autopar
    from autopar.models import build
    from autopar.passes.shard import ShardOptions
    from autopar.solver.cost import TrainingSetup

    m = build(model_spec(system, a), device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    world = dist.get_world_size()
    predicted = None
    if system.startswith("autopar"):
        axes = {"autopar-tp": {"tp": world}}.get(system, {"dp": world})
        opts = ShardOptions(setup=TrainingSetup(zero=3)) if system == "autopar-zero3" else None
        cm = autopar.compile(model, autopar.init_mesh("cpu", **axes), kwargs=batch, options=opts)
        opt = cm.make_optimizer(torch.optim.AdamW, lr=1e-4)
        predicted = _predicted(cm)
        return cm, opt, batch, predicted
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), local, None
    from torch.distributed.device_mesh import init_device_mesh

    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), local, None
    if system == "dtensor-tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        plan = {}
        for i in range(len(model.m.model.layers)):
            p = f"m.model.layers.{i}."
            plan.update({p + f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"})
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
            plan.update({p + f"mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")})
            plan[p + "mlp.down_proj"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, None
    raise ValueError(f"unknown system {system!r}")


def _predicted(cm) -> dict[str, float]:
    """The cost model's bytes per category for this rank's planned program (Adam, fp32): parameters,
    gradients and optimizer states as ZeRO divides them, and the most whole weights ZeRO-3 gathers at once."""
    from autopar.solver.cost import CostModel, zero3_gathered

    prog = cm.program
    model = CostModel(prog.mesh, cm.setup)
    parts = [model.param_parts(v.type, v.type.placements) for v in prog.params]
    acts = sum(model.local_bytes(t, t.placements) for op in prog.ops for t in op.types)
    return {
        "params": sum(p[0] for p in parts),
        "grads": sum(p[1] for p in parts),
        "optimizer": sum(p[2] for p in parts),
        "activations": acts,
        "gathered": zero3_gathered(prog, cm.setup),
    }


def run_one(rank: int, world: int, port: int, system: str, a, out: str) -> None:
    init_worker(rank, world, port, a.timeout)
    torch.manual_seed(0)
    module, opt, batch, predicted = build_system(system, a, rank)
    memory = _warm_up(module, opt, batch)
    med = _median([_timed_step(module, opt, batch) for _ in range(a.steps)])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": med, "memory": memory, "predicted": predicted}, f)
    dist.destroy_process_group()


def run_interleaved(rank: int, world: int, port: int, systems: tuple[str, str], a, out: str) -> None:
    """Both systems built in the same processes, their timed steps alternating (A B B A A B ...), so that
    both see the same load of a shared machine."""
    init_worker(rank, world, port, a.timeout)
    torch.manual_seed(0)
    built = {s: build_system(s, a, rank) for s in systems}
    res = {s: {"memory": _warm_up(*built[s][:3]), "predicted": built[s][3]} for s in systems}
    times: dict[str, list[float]] = {s: [] for s in systems}
    for i in range(a.steps):
        for s in systems if i % 2 == 0 else systems[::-1]:
            times[s].append(_timed_step(*built[s][:3]))
    for s in systems:
        res[s]["median_s"] = _median(times[s])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _warm_up(module, opt, batch) -> dict:
    """One step; the live bytes per category after its backward (rank 0's are reported)."""
    zero3 = getattr(module, "zero3", None)
    if zero3 is not None:
        zero3.reset_peak()
    with SavedBytes() as saved:
        loss = module(**batch)
    loss.backward()
    opt.step()
    memory = {
        "params": _live_bytes(module.parameters()),
        "grads": _live_bytes(p.grad for p in module.parameters() if p.grad is not None),
        "optimizer": _live_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()),
        "activations": saved.total,
        "gathered": zero3.peak_gathered() if zero3 is not None else None,  # ZeRO-3's whole weights, most at once
    }
    opt.zero_grad()
    return memory


def _timed_step(module, opt, batch) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    module(**batch).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _median(times: list[float]) -> float:
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    return med.item()


def spawn_interleaved(systems: tuple[str, str], a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_interleaved, args=(a.ranks, free_port(), systems, a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            return json.load(f)


def spawn(system: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_one, args=(a.ranks, free_port(), system, a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--pairs", default="dp,zero3,tp", help="comma-separated: dp, zero3, tp (default all)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds (A B per round)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--pp", action="store_true", help="also run bench/pipeline_vs_torch.py --mode real")
    p.add_argument("--json", help="also write every measurement here")
    p.add_argument("--interleave", action="store_true",
                   help="each round: both systems in the same fresh processes, steps alternating")  # fmt: skip
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, dict] = {}
    for pair in [x.strip() for x in a.pairs.split(",") if x.strip()]:
        if pair not in PAIRS:
            p.error(f"unknown pair {pair!r}; choose from {', '.join(PAIRS)}")
        ours, peer = PAIRS[pair]
        runs: dict[str, list[dict]] = {ours: [], peer: []}
        for r in range(a.repeats):
            if a.interleave:
                both = spawn_interleaved((ours, peer), a)
                for system in (ours, peer):
                    runs[system].append(both[system])
                print(f"[{pair} round {r + 1}/{a.repeats}] " + ", ".join(f"{s}: {both[s]['median_s']:.3f} s/step"
                      for s in (ours, peer)), file=sys.stderr, flush=True)  # fmt: skip
                continue
            for system in (ours, peer):
                t0 = time.perf_counter()
                runs[system].append(spawn(system, a))
                print(f"[{pair} round {r + 1}/{a.repeats}] {system}: {runs[system][-1]['median_s']:.3f} s/step "
                      f"({time.perf_counter() - t0:.0f} s with start-up)", file=sys.stderr, flush=True)  # fmt: skip
        results[pair] = runs
    print(_table(results, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    if a.pp:
        here = os.path.dirname(__file__)
        cmd = [sys.executable, os.path.join(here, "pipeline_vs_torch.py"), "--mode", "real", "--ranks", "4"]
        subprocess.run(cmd + ["--repeats", str(a.repeats)], check=True)
    return 0


def _table(results: dict, a) -> str:
    lines = [
        f"{a.ranks} gloo ranks, 1 thread each; {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, "
        f"batch {a.batch} x {a.seq}; median of {a.steps} steps per run, {a.repeats} alternating rounds",
        "",
        "| pair | autopar s/step | peer s/step | ratio (min-max) |",
        "|---|---|---|---|",
    ]
    mib = 2**20
    mem_lines = [
        "",
        "| system | params MiB | grads MiB | optimizer MiB | activations MiB (saved) | ZeRO-3 gathered MiB (most) "
        "| predicted p/g/o/a/gathered MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair, runs in results.items():
        ours, peer = PAIRS[pair]
        mo = statistics.median(x["median_s"] for x in runs[ours])
        mp_ = statistics.median(x["median_s"] for x in runs[peer])
        ratios = [x["median_s"] / y["median_s"] for x, y in zip(runs[ours], runs[peer])]
        lines.append(
            f"| {ours} / {peer} | {mo:.3f} | {mp_:.3f} | {mo / mp_:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
        for system in (ours, peer):
            m, pred = runs[system][0]["memory"], runs[system][0]["predicted"]
            keys = ("params", "grads", "optimizer", "activations", "gathered")
            cells = " | ".join(f"{m[k] / mib:.2f}" if m.get(k) is not None else "-" for k in keys)
            ptxt = "/".join(f"{pred[k] / mib:.2f}" for k in keys) if pred else "-"
            mem_lines.append(f"| {system} | {cells} | {ptxt} |")
    return "\n".join(lines + mem_lines)


if __name__ == "__main__":
    sys.exit(main())
