"""autopar beside what users write with torch, same model and ranks: step-time ratios and live bytes per category.

    .venv/bin/python bench/vs_torch.py                              # dp, zero3, tp pairs, issue 13's sizes
    .venv/bin/python bench/vs_torch.py --pairs search               # the searched 4-rank plan vs every peer
    .venv/bin/python bench/vs_torch.py --pairs pp                   # 1F1B / interleaved vs torch pipelining
    .venv/bin/python bench/vs_torch.py --pairs dp --repeats 2 --steps 3 --layers 2 --hidden 64 --seq 32 --vocab 512

Pairs (autopar / peers), each run in fresh gloo processes (one thread per rank), alternating
A B A B ... for --repeats rounds (shared/BENCHMARKING.md); systems: bench/vs_torch_systems.py.

- ``dp``: autopar.compile on dp=2 (the default plan: fastest within the memory) vs torch DDP; GPT-2;
- ``table``: issue 13's first table, GPT-2 on 2 ranks: autopar dp beside one process's step (eager, the whole
  batch on each rank), DDP and autopar's tp=2 plan;
- ``zero3``: autopar with ZeRO-3 on dp=2 vs FSDP2 (``fully_shard`` per decoder layer, then the root); LLaMA;
- ``tp``: autopar on tp=2 (its plan) vs DTensor TP (``parallelize_module``, Megatron's layout); LLaMA;
- ``tp-megatron``: autopar with Megatron's layout fixed on tp=2, its f fused with the matmuls that read it (the
  input gradient's all-reduce overlapping the weight gradients) vs the same without the fusion and vs DTensor TP
  (the same layout); LLaMA;
- ``search``: on --search-ranks (4) ranks, the plan ``autopar.search`` picks for this machine (searched once,
  before the rounds) vs DDP, FSDP2, DTensor TP and FSDP2 x TP (dp=2 x tp=2); LLaMA. The fastest hand-written
  peer (the smallest median) is marked; autopar's default plan on dp over all ranks runs beside them for
  reference;
- ``pp``: ``bench/pipeline_vs_torch.py`` (1F1B and interleaved, autopar's executor vs hand-built
  ``PipelineStage``s under torch's ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``), --repeats invocations
  (fresh processes each) in real compute on --ranks ranks and on the emulated device (sleeping stages,
  real boundary tensors) on --pp-ranks (4) ranks; inside an invocation the two alternate step by step.
  Plus autopar's GPT-2 on pp=2 (1F1B, --microbatches) for the memory table.

Each run times --steps training steps (forward, backward, AdamW step) after one warm-up and reports
their median; a pair's line is the median of the per-round ratios of those medians (autopar / peer; < 1:
autopar faster) with their min-max (``--interleave``: each round builds the pair's systems in
the same fresh processes and alternates their steps, A B B A ..., for a machine whose load changes between
runs). Each model returns its loss only.

Memory: on rank 0 of each run, live bytes by category after the warm-up step (``runtime/measure/memory.py``):
parameters, gradients, optimizer states (this rank's local tensors), activations (what autograd saved for
backward, each storage once, by saved-tensor hooks: no allocator involved), and for autopar the cost
model's prediction of the same categories (``predicted_categories``: activations from ``solver/sharding/saved.py``;
on a pipeline all microbatches of the step). autopar's gradient buckets, kept from step to step (the
gradients are their slices after the sync), are a column of their own beside their prediction (DDP keeps
its buckets too, not counted here); other communication buffers are transient inside the collectives and
not counted.
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
from _launch import add_model_args, free_port, init_worker  # noqa: E402
from vs_torch_systems import build_system, family_of, prepare_search  # noqa: E402

PAIRS = {
    "dp": ("autopar-dp", ("ddp", "ddp-fused")),  # torch's default AdamW, and the fused kernel autopar picks
    "table": ("autopar-dp", ("eager", "ddp", "autopar-tp-gpt2")),  # issue 13's first table: GPT-2 on 2 ranks
    "zero3": ("autopar-zero3", ("fsdp2",)),
    "tp": ("autopar-tp", ("dtensor-tp",)),
    "tp-megatron": ("autopar-megatron", ("autopar-megatron-unfused", "dtensor-tp")),  # the same layout on both
    "search": ("autopar-search", ("ddp", "fsdp2", "dtensor-tp", "fsdp2-tp", "autopar-dp")),  # + autopar's dp plan
}
PP_SCHEDULES = ("1f1b", "interleaved")


def _prepare(system: str, pair: str, a, rank: int):
    """Build ``system``, run its warm-up step measuring memory; (one timed-step function, memory, predicted)."""
    from autopar.runtime.measure.memory import (
        SavedTensors,
        measured_categories,
        predicted_categories,
        tensor_bytes,
        view_bytes,
    )

    module, opt, batch = build_system(system, family_of(system, pair), a, rank)
    pipe = system.startswith("autopar") and module.schedule.num_stages > 1  # train_step runs its whole step

    def backward():
        if pipe:
            module.train_step(**batch)
        else:
            module(**batch).backward()

    params = list(module.parameters())
    zero3 = getattr(module, "zero3", None)
    if zero3 is not None:
        zero3.reset_peak()
    with SavedTensors(params + list(batch.values())) as saved:  # the batch and the weights are not activations
        backward()
    grads = view_bytes(p.grad for p in params if p.grad is not None)  # before a ZeRO optimizer frees them
    opt.step()
    memory = dict(measured_categories(params, opt, saved), grads=grads)
    buckets = getattr(getattr(module, "_grads", None), "_buffers", None)
    if buckets is not None:  # autopar's gradient buckets
        memory["buffers"] = tensor_bytes(buckets.values())
    if zero3 is not None:
        memory["gathered"] = zero3.peak_gathered()  # ZeRO-3's whole weights, most at once
    predicted = predicted_categories(module) if system.startswith("autopar") else None
    opt.zero_grad()

    def timed_step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    return timed_step, memory, predicted


def _median_over_ranks(times: list[float]) -> float:
    med = torch.tensor([statistics.median(times) if times else 0.0])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    return med.item()


def run_one(rank: int, world: int, port: int, systems: tuple[str, ...], pair: str, a, out: str) -> None:
    """``systems`` built in the same fresh processes; with several (``--interleave``) their timed steps
    alternate (A B B A ...), so that all see the same load of a shared machine."""
    init_worker(rank, world, port, a.timeout)
    torch.manual_seed(0)
    built = {s: _prepare(s, pair, a, rank) for s in systems}
    times: dict[str, list[float]] = {s: [] for s in systems}
    for i in range(0 if pair == "pp" else a.steps):  # the pp pair's memory run is not timed
        for s in systems if i % 2 == 0 else systems[::-1]:
            times[s].append(built[s][0]())
    res = {
        s: {"median_s": _median_over_ranks(times[s]), "memory": built[s][1], "predicted": built[s][2]} for s in systems
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    # the groups are freed at exit, gloo threads joined, before the interpreter finalizes (init_worker's atexit)


def spawn(systems: tuple[str, ...], pair: str, ranks: int, a, tries: int = 3) -> dict:
    """One run of ``systems`` (one, or several interleaved) on ``ranks`` fresh processes: {system: result}. A
    run whose process dies (seen on this shared machine: a gloo rank aborting at start-up, "terminate called
    without an active exception") is retried, said on stderr."""
    for attempt in range(1, tries + 1):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            try:
                mp.spawn(run_one, args=(ranks, free_port(), systems, pair, a, out), nprocs=ranks, join=True)
            except mp.ProcessExitedException as e:
                if attempt == tries:
                    raise
                print(
                    f"[{pair}] {'+'.join(systems)}: {e}; retrying ({attempt}/{tries - 1})", file=sys.stderr, flush=True
                )
                continue
            with open(out) as f:
                return json.load(f)
    raise AssertionError("unreachable")


def run_pair(pair: str, a) -> dict:
    ours, peers = PAIRS[pair]
    ranks = a.search_ranks if pair == "search" else a.ranks
    runs: dict[str, list[dict]] = {s: [] for s in (ours, *peers)}
    groups = [tuple(runs)] if a.interleave else [(s,) for s in runs]
    for r in range(a.repeats):
        for systems in groups:
            t0 = time.perf_counter()
            for system, res in spawn(systems, pair, ranks, a).items():
                runs[system].append(res)
                print(f"[{pair} round {r + 1}/{a.repeats}] {system}: {res['median_s']:.3f} s/step "
                      f"({time.perf_counter() - t0:.0f} s with start-up)", file=sys.stderr, flush=True)  # fmt: skip
    return runs


def run_pp(a) -> dict:
    """--repeats invocations of bench/pipeline_vs_torch.py per mode (fresh processes each), and one autopar
    pp run of GPT-2 for the memory table."""
    here = os.path.dirname(__file__)
    out: dict = {"rounds": {"real": [], "emulated": []}}
    for r in range(a.repeats):
        for mode, ranks in (("real", a.ranks), ("emulated", a.pp_ranks)):
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "pp.json")
                cmd = [sys.executable, os.path.join(here, "pipeline_vs_torch.py"), "--mode", mode]
                cmd += ["--ranks", str(ranks), "--repeats", str(a.pp_steps), "--schedules", ",".join(PP_SCHEDULES)]
                cmd += ["--microbatches", str(a.pp_microbatches), "--json", path]
                for attempt in range(3):  # a rank dying at start-up is retried, as in `spawn`
                    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode == 0:
                        break
                    print(f"[pp] {mode}: an invocation failed; retrying ({attempt + 1}/2)", file=sys.stderr, flush=True)
                else:
                    raise RuntimeError(f"{' '.join(cmd)} failed three times")
                with open(path) as f:
                    res = json.load(f)
            out["rounds"][mode].append(res)
            line = ", ".join(f"{s} {x['autopar_median_s']:.3f}/{x['torch_median_s']:.3f}" for s, x in res.items())
            print(f"[pp round {r + 1}/{a.repeats}] {mode}: autopar/torch s {line}", file=sys.stderr, flush=True)
    out["memory"] = spawn(("autopar-pp",), "pp", 2, a)["autopar-pp"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--pairs", default="dp,zero3,tp", help="comma-separated: dp, zero3, tp, tp-megatron, search, pp, table"
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--search-ranks", type=int, default=4, help="ranks of the search pair")
    p.add_argument("--pp-ranks", type=int, default=4, help="ranks of the emulated pipeline runs")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds (A B per round)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--pp-steps", type=int, default=3, help="alternating steps per pipeline invocation")
    p.add_argument("--pp-microbatches", type=int, default=8, help="microbatches of the pipeline timings")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches of the pp memory run")
    add_model_args(p)
    p.add_argument("--interleave", action="store_true",
                   help="build a pair's systems in the same fresh processes and alternate their timed steps "
                   "(A B B A ...), for a machine whose load changes between runs")  # fmt: skip
    p.add_argument("--json", help="also write every measurement here")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pairs = [x.strip() for x in a.pairs.split(",") if x.strip()]
    if unknown := set(pairs) - set(PAIRS) - {"pp"}:
        p.error(f"unknown pairs {sorted(unknown)}; choose from {', '.join([*PAIRS, 'pp'])}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        a.search_plan = os.path.join(d, "search-plan.json")
        if "search" in pairs:
            t0 = time.perf_counter()
            a.search_best = prepare_search(a, a.search_ranks, a.search_plan)
            print(f"[search] {a.search_best.strip()} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        for pair in pairs:
            results[pair] = run_pp(a) if pair == "pp" else run_pair(pair, a)
    print(_table(results, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


def _ratio(ours: list[float], peer: list[float]) -> str:
    """The median of the per-round ratios (each round's two medians measured under the same load: with
    ``--interleave`` in the same processes, steps alternating), with their min-max. (Until 2026-11-27 this was
    the ratio of the medians over rounds, which pairs one round's time with another's when the load changes
    between rounds.)"""
    ratios = [x / y for x, y in zip(ours, peer)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _table(results: dict, a) -> str:
    lines = [
        f"{a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, batch {a.batch} x {a.seq}; gloo, 1 thread per rank; "
        f"median of {a.steps} steps per run, {a.repeats} alternating rounds",
        "",
        "| pair | ranks | autopar s/step | peer s/step | ratio autopar/peer, median of rounds (min-max) |",
        "|---|---|---|---|---|",
    ]
    mem = ["", "| system | params MiB | grads MiB | optimizer MiB | activations MiB (saved) | predicted p/g/o/a MiB "
           "| activations predicted / saved | every op output / saved | ZeRO-3 gathered MiB (most) measured / "
           "predicted | gradient buckets MiB measured / predicted |"]  # fmt: skip
    mem.append("|---|---|---|---|---|---|---|---|---|---|")
    for pair, runs in results.items():
        if pair == "pp":
            lines += _pp_rows(runs, a)
            mem.append(_mem_row("autopar-pp (GPT-2, pp=2, 1F1B)", runs["memory"]))
            continue
        ours, peers = PAIRS[pair]
        ranks = a.search_ranks if pair == "search" else a.ranks
        mine = [x["median_s"] for x in runs[ours]]
        hand = [s for s in peers if not s.startswith("autopar")]
        best = min(hand, key=lambda s: statistics.median(x["median_s"] for x in runs[s]))
        for peer in peers:
            theirs = [x["median_s"] for x in runs[peer]]
            label = f"{ours} / {peer}" + (" (fastest peer)" if pair == "search" and peer == best else "")
            lines.append(f"| {label} | {ranks} | {statistics.median(mine):.3f} | {statistics.median(theirs):.3f} | "
                         f"{_ratio(mine, theirs)} |")  # fmt: skip
        for system in (ours, *peers):
            mem.append(_mem_row(f"{system} ({ranks} ranks)", runs[system][0]))
    if "search" in results:
        lines += ["", f"searched plan: {a.search_best.strip()}"]
    return "\n".join(lines + mem)


def _pp_rows(runs: dict, a) -> list[str]:
    out = []
    for mode, rounds in runs["rounds"].items():
        ranks = a.ranks if mode == "real" else a.pp_ranks
        for s in PP_SCHEDULES:
            mine = [r[s]["autopar_median_s"] for r in rounds]
            theirs = [r[s]["torch_median_s"] for r in rounds]
            label = f"autopar {s} / torch.distributed.pipelining ({mode})"
            out.append(f"| {label} | {ranks} | {statistics.median(mine):.3f} | {statistics.median(theirs):.3f} | "
                       f"{_ratio(mine, theirs)} |")  # fmt: skip
    return out


def _mem_row(label: str, run: dict) -> str:
    mib = 2**20
    keys = ("params", "grads", "optimizer", "activations")
    m, pred = run["memory"], run["predicted"]
    cells = " | ".join(f"{m[k] / mib:.2f}" for k in keys)
    gathered = f"{m['gathered'] / mib:.2f} / {pred['gathered'] / mib:.2f}" if "gathered" in m and pred else "-"
    buckets = f"{m['buffers'] / mib:.2f} / {pred['buffers'] / mib:.2f}" if "buffers" in m and pred else "-"
    if not pred:
        return f"| {label} | {cells} | - | - | - | - | - |"
    ptxt = "/".join(f"{pred[k] / mib:.2f}" for k in keys)
    saved = max(m["activations"], 1)
    return (f"| {label} | {cells} | {ptxt} | {pred['activations'] / saved:.4f} | {pred['every_output'] / saved:.2f} "
            f"| {gathered} | {buckets} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
