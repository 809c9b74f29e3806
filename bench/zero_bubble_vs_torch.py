"""autopar's zero-bubble schedules beside torch.distributed.pipelining's, on an emulated device (CPU/gloo).

The device is emulated as shared/BENCHMARKING.md asks: every stage's forward sleeps ``t_f``, the
input-gradient half of its backward ``t_b`` and the weight-gradient half ``t_w``, on a real boundary
tensor (``--mb x --seq x --hidden`` floats) that the point-to-point transfers carry. The two halves are
separate autograd nodes (``ZBSleepStage``: the sleep of ``t_w`` sits on the weight's own branch), so
autopar's B/W split (``runtime/execute/split_backward.py``) and torch's ``stage_backward_input`` /
``stage_backward_weight`` each run them where their schedule puts them, and a whole backward runs
both. The first stage's input is data (no gradient), so its backward is all weight gradients, as a
language model's embedding stage: both sides skip its B and the simulator is given ``t_b = 0`` there.

autopar's side is ``Executor`` over the schedule's action lists; torch's is hand-built
``PipelineStage``s under ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1),
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (two stages per rank in a V). 1F1B and ZB-H2 run
too (torch's Schedule1F1B; ZB-H2 on autopar only). Costs are a rank's share per microbatch
(``--tf --tb --tw``), split over its stages. Every repeat runs each schedule on autopar (A) then torch
(B): A B A B ... For each: median and min step time, the throughput ratio (torch's median over
autopar's), autopar's bubble from its action trace (``measured_result``), both sides' bubble from the
step time against the busiest rank's compute M (T_F + T_B + T_W), and the simulator's bubble for the
same costs: without and with the idle one-way transfer time t_c (a ping-pong); with t_c and the
overheads each step measured, the compute thread's time per send (``Costs.t_send``: gloo writes a
message in the issuing thread when its receive is already posted, and the V schedules send twice
as often per rank) and the executor's own time before each compute action (``Costs.t_action``); and
with every cost as the step measured it (each stage's mean F, B and W, sleep overshoot included, and
the in-step hop, send post to the waiting receiver's wake-up, as t_c). The last column divides each
step's traced bubble by that last simulation of the same step: median and range over the steps.
The traces are put on one clock first (``runtime.measure.trace.on_one_clock``): ranks begin a step up to
milliseconds apart.

    .venv/bin/python bench/zero_bubble_vs_torch.py --ranks 4 --microbatches 8 --repeats 5
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
from _launch import free_port, init_worker
from pipeline_vs_torch import (
    _autopar_emulated,
    _gathered,
    _in_step_hop,
    _mean_loss,
    _measured_costs,
    _one_way_seconds,
    _Sleep,
    _summary,
    _timed,
    _torch_step,
)
from pipeline_vs_torch import _table as one_table
from pipeline_vs_torch import _torch_schedule as torch_schedule
from torch import nn

from autopar.schedule.simulator import simulate

SCHEDULES = [("1f1b", {}), ("zb-h1", {}), ("zb-h2", {}), ("zbv", {}), ("dualpipev", {})]
TORCH_HAS = {"1f1b", "zb-h1", "zbv", "dualpipev"}


class _SleepWeight(torch.autograd.Function):
    """On the weight's own branch: its gradient (W) sleeps ``tw``."""

    @staticmethod
    def forward(ctx, w, tw: float):
        ctx.tw = tw
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tw)
        return g, None


class ZBSleepStage(nn.Module):
    """A stage whose forward takes ``tf`` seconds, its input gradient ``tb`` and its weight gradient ``tw``."""

    def __init__(self, tf: float, tb: float, tw: float):
        super().__init__()
        self.tf, self.tb, self.tw = tf, tb, tw
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x, self.tf, self.tb) * _SleepWeight.apply(self.w, self.tw)


def simulated_costs(sched, args, tc: float = 0.0, t_send: float = 0.0, t_action: float = 0.0):
    """The emulated stages' costs for the simulator: a rank's share split over its stages; the first
    stage's backward is its weight gradients only."""
    from autopar.schedule.action_costs import Costs

    S, k = sched.num_stages, sched.num_ranks / sched.num_stages
    tw = [args.tw * k] * S
    tb = [(0.0 if s == 0 else args.tb * k) + tw[s] for s in range(S)]
    return Costs.uniform(S, tf=args.tf * k, tb=tb, tw=tw, tc=tc, t_send=t_send, t_action=t_action)


def emulated(rank: int, world: int, args) -> dict:
    from autopar.schedule.generators import make_schedule

    P, M = world, args.microbatches
    shape = (args.mb, args.seq, args.hidden)
    runs = []
    for name, opts in SCHEDULES:
        sched = make_schedule(name, P, M, **opts)
        S = sched.num_stages
        k = P / S

        def make(x: float, k=k) -> nn.Module:
            return ZBSleepStage(x * k * args.tf, x * k * args.tb, x * k * args.tw)

        ex = _autopar_emulated(sched, rank, shape, args.tf * k, module=make)
        g = torch.Generator().manual_seed(0)
        mbs = [{"x": torch.randn(shape, generator=g)} for _ in range(M)]
        ts = None
        if name in TORCH_HAS:
            mods = {s: make(1.0) for s in sched.stages_of_rank(rank)}
            ts, _ = torch_schedule(name, opts, mods, S, M, lambda s: torch.zeros(shape), _mean_loss)
        full = torch.cat([m["x"] for m in mbs])

        def tstep(ts=ts, sched=sched, full=full):
            _torch_step(ts, sched.stages_of_rank(rank), sched.num_stages, full, full)

        runs.append((name, opts, sched, ex, mbs, ts, tstep))
    tc = _one_way_seconds(shape)
    for _name, _opts, _sched, ex, mbs, ts, tstep in runs:  # warm-up (torch infers shapes on its first step)
        ex.run(mbs)
        if ts is not None:
            tstep()
    times = {name: {"autopar": [], "torch": [], "bubble": []} for name, *_ in runs}
    steps: dict[str, list[dict]] = {name: [] for name, *_ in runs}  # per step: its trace and its simulation
    for _ in range(args.repeats):
        for name, _opts, sched, ex, mbs, ts, tstep in runs:
            times[name]["autopar"].append(_timed(lambda ex=ex, mbs=mbs: ex.run(mbs)))
            m = _gathered(sched, ex)
            times[name]["bubble"].append(float(m.bubble_ratio))
            if rank == 0:
                steps[name].append(_priced_step(sched, m, args, tc))
            if ts is not None:
                times[name]["torch"].append(_timed(tstep))
    out = {}
    if rank == 0:
        ideal = M * (args.tf + args.tb + args.tw)  # the busiest rank (any but the first stage's)
        for name, opts, sched, *_ in runs:
            sim = simulate(sched, simulated_costs(sched, args))
            out[name] = _summary(times[name], float(sim.bubble_ratio), ideal, opts)
            out[name]["sim_bubble_tc"] = float(simulate(sched, simulated_costs(sched, args, tc)).bubble_ratio)
            for key in ("sim_bubble_overheads", "sim_bubble_measured", "ratio", "hop_s", "t_send_s", "t_action_s"):
                out[name][key] = statistics.median(st[key] for st in steps[name])
            out[name]["ratio_range"] = (min(st["ratio"] for st in steps[name]), max(st["ratio"] for st in steps[name]))
            out[name]["tc_s"] = tc
    return out


def _priced_step(sched, m, args, tc: float) -> dict:
    """One measured step beside two simulations of it: the nominal compute with the overheads the step
    measured (ping-pong t_c, the compute thread's time per send, the executor's time per action), and
    every cost as the step measured it (each stage's mean F, B and W, the in-step hop as t_c)."""
    hop = _in_step_hop(sched, m)
    traced = _measured_costs(sched, m, hop)
    overheads = simulate(sched, simulated_costs(sched, args, tc, traced.t_send, traced.t_action))
    measured = simulate(sched, traced)
    return {
        "sim_bubble_overheads": float(overheads.bubble_ratio),
        "sim_bubble_measured": float(measured.bubble_ratio),
        "ratio": float(m.bubble_ratio) / float(measured.bubble_ratio),
        "hop_s": hop,
        "t_send_s": traced.t_send,
        "t_action_s": traced.t_action,
    }


def _table(res: dict) -> str:
    """pipeline_vs_torch's table, with the two simulations of each measured step beside it and the trace's
    bubble over the simulation of its own measured costs (median over steps, and its range)."""
    lines = one_table(res, True).splitlines()
    lines[0] += (
        " bubble simulated + t_c + t_send + t_action | bubble simulated, measured costs |"
        " trace / simulated, measured costs: median (range) |"
    )
    lines[1] += "---|---|---|"
    rows = [
        f"{row} {r['sim_bubble_overheads']:.3f} | {r['sim_bubble_measured']:.3f} | "
        f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) |"
        for row, r in zip(lines[2:], res.values())
    ]
    return "\n".join([*lines[:2], *rows])


def _worker(rank: int, world: int, port: int, args, result: str) -> None:
    init_worker(rank, world, port, args.timeout)
    try:
        out = emulated(rank, world, args)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tf", type=float, default=0.03, help="forward seconds of a rank's share per microbatch")
    p.add_argument("--tb", type=float, default=0.03, help="input-gradient seconds of a rank's share")
    p.add_argument("--tw", type=float, default=0.03, help="weight-gradient seconds of a rank's share")
    p.add_argument("--mb", type=int, default=2, help="microbatch size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "out.json")
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(args.ranks, free_port(), args, result), nprocs=args.ranks, join=True)
        res = json.load(open(result))
    first = next(iter(res.values()))
    print(
        f"emulated: P={args.ranks} M={args.microbatches} repeats={args.repeats} boundary={args.mb}x{args.seq}x"
        f"{args.hidden} f32 T_F={args.tf}s T_B={args.tb}s T_W={args.tw}s per rank share "
        f"({time.perf_counter() - t0:.0f} s); one-way t_c {first['tc_s'] * 1e3:.2f} ms, t_send traced "
        + ", ".join(f"{n} {r['t_send_s'] * 1e3:.3f}" for n, r in res.items())
        + " ms, t_action traced "
        + ", ".join(f"{n} {r['t_action_s'] * 1e3:.3f}" for n, r in res.items())
        + " ms, in-step hop (median over steps) "
        + ", ".join(f"{n} {r['hop_s'] * 1e3:.3f}" for n, r in res.items())
        + " ms"
    )
    print(_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
