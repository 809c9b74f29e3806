"""Merak's sub-pipelined tensor parallelism, measured: one pp x tp pipeline with and without it, on gloo.

One invocation spawns ``pp * tp`` gloo processes (one thread each) and times both variants of the same
pipeline alternately, step by step (A B A B ..., shared/BENCHMARKING.md), in one or both modes:

- ``emulated``: hand-built stages of ``--layers`` Megatron blocks per stage (f = grad_all_reduce,
  a block's compute, g = all_reduce, residual; two blocks a layer) run by autopar's ``Executor``.
  The compute is emulated: it sleeps ``T_m / 2`` per block forward and twice that backward, in
  proportion to the samples it gets (a half microbatch sleeps half), so it leaves the CPU to gloo's
  communication threads as a GPU would; the tp all-reduces of the ``mb x seq x hidden`` activation
  are real. ``--tm`` defaults to the measured ``T_a``, where Merak's gain is largest.
- ``real``: GPT-2 (``--model``) compiled by ``autopar.compile`` with Megatron's layout (so both
  variants shard alike), real compute, one thread per rank.

Reported per mode: median (min) step time of each variant and their ratio; from autopar's traces the
mean F+B time per microbatch and stage; the time a rank spent blocked waiting for its tp collectives
per microbatch (all of each collective without sub-pipelining; with it only what the other
sub-microbatch's compute did not cover, so this shows whether the communication was hidden);
``T_a`` (two all-reduces of one layer's activation on the tp group, measured with every group at
once), ``T_m`` (given, or for ``real`` estimated as the non-sub-pipelined mean F per layer minus
``T_a``), and Merak's closed form per microbatch and stage, ``(3T_m + 2T_a)K`` against
``3/4 T_m + 1/2 T_a + (K - 1/4) max{3T_m, 2T_m + T_a, 2T_a}``
(``autopar.schedule.formulas.sub_pipelined_tp``).

    .venv/bin/python bench/sub_pipeline_tp.py                       # both modes, pp=2 x tp=2
    .venv/bin/python bench/sub_pipeline_tp.py --mode emulated --hidden 512 --tm 0.04
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp
from _launch import free_port, init_worker

VARIANTS = ("plain", "sub")  # without / with sub-pipelined tensor parallelism

# ---------------------------------------------------------------------------------------------
# Emulated compute


class _Compute(torch.autograd.Function):
    """Identity that sleeps ``per_sample`` seconds per sample forward and twice that backward (no
    arithmetic: the CPU stays free for the communication, as with a GPU's compute). ``w`` stands for
    the block's weights: it makes every stage, the first too, run its backward."""

    @staticmethod
    def forward(ctx, x, w, per_sample: float):
        ctx.t = per_sample * x.shape[0]
        time.sleep(ctx.t)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.t)
        return g, torch.zeros(()), None


def emulated_compute(x: torch.Tensor, w: torch.Tensor, per_sample: float) -> torch.Tensor:
    return _Compute.apply(x, w, per_sample)


def _stage_module(layers: int, per_sample: float, last: bool) -> fx.GraphModule:
    """``layers`` layers of two Megatron blocks: x + g(compute(f(x))), the loss on the last stage."""
    from autopar.runtime.comm import collectives as coll

    root = torch.nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    for i in range(2 * layers):
        root.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(())))
        f = g.call_function(coll.grad_all_reduce, (x,), {"axis": "tp"})
        c = g.call_function(emulated_compute, (f, g.get_attr(f"w{i}"), per_sample))
        x = g.call_function(operator.add, (x, g.call_function(coll.all_reduce, (c,), {"axis": "tp"})))
    if last:
        x = g.call_function(torch.mean, (x,))
    g.output((x,))
    return fx.GraphModule(root, g)


def _emulated_executors(args, mesh, tm: float) -> dict:
    from autopar.runtime.comm.context import Comm
    from autopar.runtime.execute.executor import Executor
    from autopar.runtime.execute.stage_runner import Buffer, Part, StageRunner
    from autopar.schedule.generators import make_schedule

    pp_rank, tp_rank = mesh.get_coordinate()
    sched = make_schedule(args.schedule, args.pp, args.microbatches)
    comm = Comm.from_device_mesh(mesh)
    out = {}
    for variant, n in zip(VARIANTS, (1, 2)):
        shape = (args.mb // n, args.seq, args.hidden)
        runners = {}
        for s in sched.stages_of_rank(pp_rank):
            last = s == sched.num_stages - 1
            gm = _stage_module(args.layers, tm / 2 / args.mb, last)
            name = "x" if s == 0 else "x_in"  # the user input, or what the previous stage sent
            recv = [Buffer(name, shape, torch.float32, True)] if s > 0 else []
            send = [] if last else [Buffer("y", shape, torch.float32, True)]
            runners[s] = StageRunner(s, Part(gm, (name,), (s > 0,)), recv, send, last)
        ex = Executor(
            sched,
            pp_rank,
            runners,
            lambda s: int(mesh.mesh[sched.stage_to_rank[s], tp_rank]),
            comm,
            lambda s: None,
            lambda: None,
            sub_microbatches=n,
        )
        x = torch.randn(args.mb, args.seq, args.hidden, generator=torch.Generator().manual_seed(0))
        mbs = [[{"x": h} for h in x.chunk(n)] for _ in range(args.microbatches)]
        out[variant] = (lambda ex=ex, mbs=mbs: ex.run(mbs), lambda ex=ex: ex.trace)
    return out


# ---------------------------------------------------------------------------------------------
# Real compute


def _model_spec(args, batch: int) -> str:
    return f"{args.model}{',' if ':' in args.model else ':'}batch={batch},seq={args.seq}"


def _real_pipes(args, mesh) -> dict:
    import autopar
    from autopar.ir.core import MeshSpec
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.runtime.call.batch import split_batch
    from autopar.solver.sharding.baselines import megatron_options

    spec = build(_model_spec(args, args.mb * args.microbatches), device="cpu", seed=0)
    g = torch.Generator().manual_seed(1)
    vocab = spec.model.config.vocab_size
    batch = {k: torch.randint(0, vocab, v.shape, generator=g) for k, v in spec.kwargs.items()}
    out = {}
    for variant, n in zip(VARIANTS, (1, 2)):
        _, sub = split_batch((), batch, args.microbatches * n)[0]
        prog = lower(capture(spec.model, (), sub), MeshSpec((("tp", args.tp),)))
        options = megatron_options(prog)
        pipe = autopar.compile(
            spec.model,
            mesh,
            kwargs=batch,
            microbatches=args.microbatches,
            schedule=args.schedule,
            options=options,
            sub_pipeline_tp=n > 1,
        )
        out[variant] = (lambda pipe=pipe: pipe.train_step(**batch), lambda pipe=pipe: pipe.trace)
    return out


# ---------------------------------------------------------------------------------------------
# Measuring


def _allreduce_seconds(mesh, shape, reps: int = 20) -> float:
    """Median time of one all-reduce of ``shape`` floats on this rank's tp group (every group at once)."""
    group = mesh.get_group("tp")
    x = torch.ones(shape)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - t0)
    return _max_over_ranks(statistics.median(times))


def _max_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _per_microbatch(trace, kind: str) -> float:
    """Mean seconds of this rank's F (or F+B) actions per microbatch."""
    from autopar.schedule.actions import Kind

    kinds = {"F": (Kind.F,), "FB": (Kind.F, Kind.B)}[kind]
    fs = [e for e in trace if e.action.kind is Kind.F]
    return sum(e.end - e.start for e in trace if e.action.kind in kinds) / max(len(fs), 1)


_BLOCKED = [0.0]  # seconds this rank spent blocked waiting for a tp collective (Pending.wait)


def _count_blocked() -> None:
    """Time every wait for a tp collective: all of a synchronous collective's time, only what is left
    of an asynchronous one when its sub-microbatch resumes."""
    from autopar.runtime.comm.pending import Pending

    wait = Pending.wait

    def timed(self):
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            _BLOCKED[0] += time.perf_counter() - t0

    Pending.wait = timed


def measure(rank: int, world: int, args, mode: str) -> dict:
    import autopar
    from autopar.schedule.formulas import sub_pipelined_tp

    mesh = autopar.init_mesh("cpu", pp=args.pp, tp=args.tp)
    hidden, k = (args.real_hidden, args.real_layers) if mode == "real" else (args.hidden, args.layers)
    ar = _allreduce_seconds(mesh, (args.mb, args.seq, hidden))
    ar_half = _allreduce_seconds(mesh, (args.mb // 2, args.seq, hidden))
    ta = 2 * ar  # two all-reduces of the activation per layer forward (attention, FFN)
    tm = args.tm if args.tm is not None else ta
    steps = _emulated_executors(args, mesh, tm) if mode == "emulated" else _real_pipes(args, mesh)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    fb: dict[str, list[float]] = {v: [] for v in VARIANTS}
    f_only: list[float] = []
    blocked: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.warmup + args.repeats):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        for v in order:
            run, trace = steps[v]
            dist.barrier()
            _BLOCKED[0] = 0.0
            t0 = time.perf_counter()
            run()
            dt = _max_over_ranks(time.perf_counter() - t0)
            waited = _max_over_ranks(_BLOCKED[0] / args.microbatches)
            if i >= args.warmup:
                times[v].append(dt)
                fb[v].append(_max_over_ranks(_per_microbatch(trace(), "FB")))
                blocked[v].append(waited)
                if v == "plain":
                    f_only.append(_max_over_ranks(_per_microbatch(trace(), "F")))
    if mode == "real":  # the forward of a layer is what is left of F after its communication
        tm = max(statistics.median(f_only) / k - ta, 0.0)
    default, sub = sub_pipelined_tp(tm, ta, k)
    out = {
        "mode": mode,
        "allreduce_s": ar,
        "allreduce_half_s": ar_half,
        "T_a": ta,
        "T_m": tm,
        "K": k,
        "merak_default_s": default,
        "merak_sub_s": sub,
        "merak_ratio": default / sub if sub else float("nan"),
    }
    for v in VARIANTS:
        out[f"{v}_median_s"] = statistics.median(times[v])
        out[f"{v}_min_s"] = min(times[v])
        out[f"{v}_fb_per_mb_s"] = statistics.median(fb[v])
        out[f"{v}_blocked_per_mb_s"] = statistics.median(blocked[v])
    out["step_ratio"] = out["plain_median_s"] / out["sub_median_s"]
    out["fb_ratio"] = out["plain_fb_per_mb_s"] / out["sub_fb_per_mb_s"]
    return out


# ---------------------------------------------------------------------------------------------
# Launch


def _worker(rank: int, world: int, port: int, args, result: str) -> None:
    init_worker(rank, world, port, args.timeout)
    _count_blocked()
    try:
        modes = ("emulated", "real") if args.mode == "both" else (args.mode,)
        out = [measure(rank, world, args, m) for m in modes]
        if rank == 0:
            with open(result, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    head = (
        "| mode | T_m ms | T_a ms (1 all-reduce, half) | step plain median (min) s | step sub median (min) s | "
        "step ratio | F+B per mb plain / sub ms | F+B ratio | blocked in tp waits per mb plain / sub ms | "
        "Merak (3T_m+2T_a)K / sub ms | Merak ratio |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = 1e3
        lines.append(
            f"| {r['mode']} | {r['T_m'] * ms:.2f} | {r['T_a'] * ms:.2f} ({r['allreduce_s'] * ms:.2f}, "
            f"{r['allreduce_half_s'] * ms:.2f}) | {r['plain_median_s']:.3f} ({r['plain_min_s']:.3f}) | "
            f"{r['sub_median_s']:.3f} ({r['sub_min_s']:.3f}) | {r['step_ratio']:.2f} | "
            f"{r['plain_fb_per_mb_s'] * ms:.1f} / {r['sub_fb_per_mb_s'] * ms:.1f} | {r['fb_ratio']:.2f} | "
            f"{r['plain_blocked_per_mb_s'] * ms:.1f} / {r['sub_blocked_per_mb_s'] * ms:.1f} | "
            f"{r['merak_default_s'] * ms:.1f} / {r['merak_sub_s'] * ms:.1f} | {r['merak_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("emulated", "real", "both"), default="both")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--mb", type=int, default=4, help="microbatch size (even: it is halved)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="emulated: activation width (real: the model's)")
    p.add_argument("--layers", type=int, default=4, help="emulated: layers per stage (real: the model's / pp)")
    p.add_argument("--tm", type=float, help="emulated: forward compute seconds of a layer (default: T_a)")
    p.add_argument("--model", default="gpt2:n_layer=4,n_embd=256,n_head=4,vocab_size=1024", help="real")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.mode in ("real", "both"):
        from autopar.models.resolve import build

        cfg = build(_model_spec(args, 1), device="meta").model.config
        args.real_layers = cfg.n_layer // args.pp
        args.real_hidden = cfg.n_embd
    port = free_port()
    world = args.pp * args.tp
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "out.json")
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(world, port, args, result), nprocs=world, join=True)
        rows = json.load(open(result))
    print(
        f"pp={args.pp} tp={args.tp} {args.schedule} M={args.microbatches} mb={args.mb} seq={args.seq}, "
        f"gloo, one thread per rank, {os.cpu_count()} CPUs ({time.perf_counter() - t0:.0f} s)"
    )
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
