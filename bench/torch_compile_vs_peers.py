"""autopar with ``torch_compile=True`` beside torch's peers compiled too, and beside itself eager: step-time ratios.

    .venv/bin/python bench/torch_compile_vs_peers.py                       # the three pairs, LLaMA, 2 ranks
    .venv/bin/python bench/torch_compile_vs_peers.py --pairs dp --repeats 2 --steps 3 --layers 2 --hidden 64

Pairs (A / B; < 1: autopar faster), each system in fresh gloo processes (one thread per rank), the pair's two
systems alternating A B A B for --repeats rounds (shared/BENCHMARKING.md); every process shares one Inductor
cache folder (``TORCHINDUCTOR_CACHE_DIR``, a temporary one unless set), so a round after the first loads its
kernels:

- ``dp``: autopar compiled on dp=ranks (the default plan) / ``torch.compile(DistributedDataParallel(model))``;
- ``zero3``: autopar compiled with ZeRO-3 on dp=ranks / FSDP2 (``fully_shard`` per decoder layer, then the root)
  under ``torch.compile``;
- ``self``: autopar compiled / autopar eager, the same dp plan;
- ``zbv``: autopar compiled / autopar eager, pp=ranks under ZB-V (each backward split: compiled as a B graph
  and a W graph, runtime/build/compiled_split.py), ``train_step`` over --microbatches microbatches;
- ``zbv-1f1b``: autopar ZB-V compiled / autopar 1F1B compiled, the same pipeline.

Each run does two warm-up steps (the first compiles), then times --steps steps (forward, backward, AdamW) and
reports their median, the slowest rank's; a pair's line is the median of its per-round ratios with their
min-max. ``--interleaved``: both systems of a pair in the same ranks (one spawn), stepped A B A B --steps
times after their warm-ups; the line is the median of the per-step ratios (each A step over the B step after
it), which a machine whose load moves minute to minute resolves where separate processes do not. The model
returns its loss only (bench/vs_torch_systems.py: ``LossOnly``, the same presets).
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
from vs_torch_systems import LossOnly, model_spec  # noqa: E402

PAIRS = {
    "dp": ("autopar-dp-compiled", "ddp-compiled"),
    "zero3": ("autopar-zero3-compiled", "fsdp2-compiled"),
    "self": ("autopar-dp-compiled", "autopar-dp-eager"),
    "zbv": ("autopar-pp-zbv-compiled", "autopar-pp-zbv-eager"),
    "zbv-1f1b": ("autopar-pp-zbv-compiled", "autopar-pp-1f1b-compiled"),
}


def build(system: str, a, rank: int):
    """(the step function, a note): ``step()`` runs one forward, backward and optimizer step."""
    import autopar
    from autopar.models.resolve import build as build_model

    m = build_model(model_spec("llama", a), device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    world = dist.get_world_size()
    if system.startswith("autopar-pp-"):  # a pipeline over every rank: train_step under the schedule
        _, _, schedule, mode = system.split("-")
        cm = autopar.compile(
            model, autopar.init_mesh("cpu", pp=world), kwargs=batch, schedule=schedule,
            microbatches=a.microbatches, torch_compile=mode == "compiled",
        )  # fmt: skip
        cm.make_optimizer(torch.optim.AdamW, lr=1e-4)  # stepped inside train_step

        def step():
            cm.train_step(**batch)

        return step, cm
    if system.startswith("autopar"):
        zero = 3 if "zero3" in system else 0
        compiled = system.endswith("-compiled")
        cm = autopar.compile(model, autopar.init_mesh("cpu", dp=world), kwargs=batch, zero=zero, torch_compile=compiled)
        opt = cm.make_optimizer(torch.optim.AdamW, lr=1e-4)

        def step():
            cm(**batch).backward()
            opt.step()
            opt.zero_grad()

        return step, cm
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    if system == "ddp-compiled":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        fn = torch.compile(wrapped)
    elif system == "fsdp2-compiled":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fn = torch.compile(model)
    else:
        raise ValueError(f"unknown system {system!r}")

    def step():
        fn(**local).backward()
        opt.step()
        opt.zero_grad()

    return step, None


def run_one(rank: int, world: int, port: int, system: str, a, out: str) -> None:
    init_worker(rank, world, port, a.timeout)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    torch.manual_seed(0)
    step, cm = build(system, a, rank)
    t0 = time.perf_counter()
    step()  # the first step traces and compiles
    first = time.perf_counter() - t0
    step()
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times), first])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    if rank == 0:
        log = cm.compile_log if cm is not None else None
        eager = dict(log.eager) if log else {}
        failed = list(log.failed) if log else []
        split = {k: v.graphs for k, v in log.split.items()} if log else {}  # B and W graphs per split backward
        res = {"median_s": med[0].item(), "first_s": med[1].item(), "eager": eager, "failed": failed, "split": split}
        with open(out, "w") as f:
            json.dump(res, f)


def run_interleaved(rank: int, world: int, port: int, systems: tuple[str, str], a, out: str) -> None:
    """Both systems of a pair built in the same ranks, warmed up, then stepped A B A B, each step timed on its
    own (the slowest rank's): the two see the same load at the same moments, which separate processes a
    minute apart do not on a shared machine."""
    init_worker(rank, world, port, a.timeout)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    torch.manual_seed(0)
    steps = {s: build(s, a, rank)[0] for s in systems}
    times: dict[str, list[float]] = {s: [] for s in systems}
    for s in systems:
        t0 = time.perf_counter()
        steps[s]()  # the first step traces and compiles
        times[f"{s}.first"] = [time.perf_counter() - t0]
        steps[s]()
    for _ in range(a.steps):
        for s in systems:
            dist.barrier()
            t0 = time.perf_counter()
            steps[s]()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[s].append(t.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def interleaved_pair(pair: str, a) -> dict:
    """``--interleaved``: the pair's per-step ratios (A's step over the B step after it) in one spawn."""
    ours, peer = PAIRS[pair]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_interleaved, args=(a.ranks, free_port(), (ours, peer), a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            times = json.load(f)
    ratios = [x / y for x, y in zip(times[ours], times[peer])]
    medians = {s: statistics.median(times[s]) for s in (ours, peer)}
    first = {s: times[f"{s}.first"][0] for s in (ours, peer)}  # rank 0's
    return _pair_result(pair, ratios, medians, first, {})


def _pair_result(pair: str, ratios: list[float], medians: dict, first: dict, ours_run: dict) -> dict:
    """A pair's line: its ratios' median and range, each system's s/step and first step, and what our run's
    compile log said (``ours_run``: one run's result, as ``run_one`` writes it)."""
    ours, peer = PAIRS[pair]
    return {
        "pair": pair,
        "ours": ours,
        "peer": peer,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "median_s": medians,
        "first_s": first,
        "eager_parts": ours_run.get("eager", {}),
        "failed": ours_run.get("failed", []),
        "split": ours_run.get("split", {}),
    }


def spawn(system: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_one, args=(a.ranks, free_port(), system, a, out), nprocs=a.ranks, join=True)
        with open(out) as f:
            return json.load(f)


def run_pair(pair: str, a) -> dict:
    ours, peer = PAIRS[pair]
    runs: dict[str, list[dict]] = {ours: [], peer: []}
    for r in range(a.repeats):
        for system in (ours, peer):  # A B A B
            res = spawn(system, a)
            runs[system].append(res)
            print(f"[{pair} round {r + 1}/{a.repeats}] {system}: {res['median_s']:.3f} s/step, first step "
                  f"{res['first_s']:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    ratios = [x["median_s"] / y["median_s"] for x, y in zip(runs[ours], runs[peer])]
    medians = {s: statistics.median(x["median_s"] for x in v) for s, v in runs.items()}
    first = {s: statistics.median(x["first_s"] for x in v) for s, v in runs.items()}
    return _pair_result(pair, ratios, medians, first, runs[ours][0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--pairs", default="dp,zero3,self")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=4, help="the pipeline pairs' microbatches per step")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--interleaved", action="store_true",
        help="both systems of a pair in the same ranks, stepped A B A B (--steps each): per-step ratios",
    )  # fmt: skip
    a = p.parse_args(argv)
    a.cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.mkdtemp(prefix="autopar-inductor-")
    one = interleaved_pair if a.interleaved else run_pair
    results = [one(pair, a) for pair in a.pairs.split(",")]
    load = os.getloadavg()[0]
    print(f"ranks {a.ranks}, load {load:.1f}, LLaMA {a.layers} layers hidden {a.hidden} batch {a.batch} x {a.seq}")
    for r in results:
        ms = r["median_s"]
        print(
            f"{r['pair']:6s} {r['ours']} / {r['peer']}: {r['ratio_median']:.2f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            f"  [{ms[r['ours']]:.3f} vs {ms[r['peer']]:.3f} s/step; first step {r['first_s'][r['ours']]:.1f} vs "
            f"{r['first_s'][r['peer']]:.1f} s]"
        )
        for label, calls in r["eager_parts"].items():
            print(f"        eager in {label}: {'; '.join(calls)}")
        for label, graphs in r["split"].items():
            print(f"        {label} (rank 0): backward as B and W graphs {graphs}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
