"""autopar's pipeline executor beside torch.distributed.pipelining, on CPU/gloo, one thread per rank.

Two measurements, in one invocation each, alternating autopar (A) and torch (B) step by step
(A B A B ...), as shared/BENCHMARKING.md asks on a 2-core machine:

- ``--mode emulated``: the device is emulated. Every stage's forward sleeps ``t_f`` and its backward
  ``t_b = 2 t_f`` (a ``torch.autograd.Function`` around ``time.sleep``), on a real boundary tensor
  (``--mb x --seq x --hidden`` floats) that the point-to-point transfers really carry. autopar's side is
  ``autopar.runtime.execute.executor.Executor`` running the schedule's action lists; torch's side is hand-built
  ``PipelineStage``s under ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``. Costs
  follow Hanayo's convention: ``--tf`` is a rank's share per microbatch, split over its stages.
- ``--mode real``: real compute. A stack of MLP blocks (embedding, ``--layers`` pre-norm MLP blocks,
  vocabulary head, cross-entropy) compiled by ``autopar.compile`` on a ``pp`` mesh, against the same
  model cut by hand into equal runs of blocks for torch.

For each schedule: median and min step time of each side, the throughput ratio (torch's median step
time over autopar's: above 1 means autopar is faster), autopar's measured bubble from its action
trace (``measured_result``), both sides' bubble from the step time against the known compute
(emulated only: ``(step - M (T_F + T_B)) / (M (T_F + T_B))``), and the simulator's bubble for the same
costs. Wave and shifted critical path run on autopar only (torch has neither).

    .venv/bin/python bench/pipeline_vs_torch.py --mode emulated --ranks 4 --microbatches 8
    .venv/bin/python bench/pipeline_vs_torch.py --mode real --ranks 2 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _launch import free_port, init_worker
from torch import nn

SCHEDULES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"chunks": 2}),
    ("wave", {"waves": 1}),
    ("scp", {"alpha1": 0}),
]
TORCH_HAS = {"gpipe", "1f1b", "interleaved"}


def _chosen(args) -> list[tuple[str, dict]]:
    """The schedules to run: ``--schedules`` (in the workers too: they re-import this module)."""
    keep = {x.strip() for x in (args.schedules or "").split(",") if x.strip()}
    return [(n, o) for n, o in SCHEDULES if not keep or n in keep]


# ---------------------------------------------------------------------------------------------
# Emulated device


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf: float, tb: float):
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tb)
        return g.clone(), None, None


class SleepStage(nn.Module):
    """A stage whose forward takes ``tf`` seconds and backward ``tb``, on a real activation. The sleep
    comes after the weight, so the first stage's backward (its input is data) takes ``tb`` too, as a
    real first stage's weight gradients do and as the simulator's uniform costs say."""

    def __init__(self, tf: float, tb: float):
        super().__init__()
        self.tf, self.tb = tf, tb
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.tf, self.tb)


def _mean_loss(y, target=None):
    return y.mean()


def _autopar_emulated(sched, rank: int, shape, tf_stage: float, module=None):
    """autopar's Executor over this rank's emulated stages: ``module(k)`` is a stage module doing ``k``
    of a stage's work (default ``SleepStage(k t_f, 2 k t_f)``; recomputation's head and rest split it)."""
    from autopar.runtime.comm.context import Comm
    from autopar.runtime.execute.executor import Executor
    from autopar.runtime.execute.stage_runner import Buffer, Part, StageRunner
    from autopar.schedule.actions import Kind

    S = sched.num_stages
    module = module or (lambda k: SleepStage(k * tf_stage, 2 * k * tf_stage))
    runners = {}
    fractions: dict[int, set[Fraction]] = {}
    for a in sched.actions[rank]:
        if a.kind is Kind.F and a.recompute:
            fractions.setdefault(a.stage, set()).add(a.recompute)
    for s in sched.stages_of_rank(rank):
        last = s == S - 1
        name = "x" if s == 0 else "x_in"

        def part(k: float, last: bool, inp: str, grad: bool) -> Part:
            mod = module(k)
            fn = (lambda t, mod=mod: (mod(t).mean(),)) if last else (lambda t, mod=mod: (mod(t),))
            return Part(fn, (inp,), (grad,))

        whole = part(1.0, last, name, s > 0)
        recv = [Buffer("x_in", shape, torch.float32, True)] if s > 0 else []
        send = [] if last else [Buffer("y", shape, torch.float32, True)]
        runner = StageRunner(s, whole, recv, send, last)
        for x in fractions.get(s, ()):
            if x == 1:
                runner.variants[x] = (whole, None)
            else:
                head = part(float(x), False, name, s > 0)
                rest = part(1 - float(x), last, "h", True)
                runner.variants[x] = (head, rest)
        runners[s] = runner
    return Executor(
        sched,
        rank,
        runners,
        lambda s: sched.stage_to_rank[s],
        Comm({}, {}, {}),
        lambda s: None,
        lambda: None,
        record=True,
    )


def _torch_step(ts, mine, num_stages: int, inputs, target) -> None:
    """One torch.distributed.pipelining step on a rank holding stages ``mine``: the first stage takes
    the inputs, the last the target."""
    first, last = 0 in mine, num_stages - 1 in mine
    if first and last:
        ts.step(inputs, target=target, losses=[])
    elif first:
        ts.step(inputs)
    elif last:
        ts.step(target=target, losses=[])
    else:
        ts.step()


def _torch_schedule(name: str, opts: dict, stage_mods: dict[int, nn.Module], S: int, M: int, example, loss_fn):
    """torch's schedule of autopar's ``name``, over hand-built stages: ZB-H1 is torch's
    ScheduleInterleavedZeroBubble with one stage per rank, ZB-V and DualPipeV their own classes."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    dev = torch.device("cpu")
    stages = [PipelineStage(mod, s, S, dev, input_args=(example(s),)) for s, mod in sorted(stage_mods.items())]
    single = {"gpipe": ts.ScheduleGPipe, "1f1b": ts.Schedule1F1B}
    if name in single:
        return single[name](stages[0], M, loss_fn=loss_fn), stages
    multi = {"zb-h1": ts.ScheduleInterleavedZeroBubble, "zbv": ts.ScheduleZBVZeroBubble}
    multi["dualpipev"] = ts.ScheduleDualPipeV
    return multi.get(name, ts.ScheduleInterleaved1F1B)(stages, M, loss_fn=loss_fn), stages


def _one_way_seconds(shape, reps: int = 20) -> float:
    """Median one-way time of a boundary tensor between ranks 0 and 1 (ping-pong / 2), on every rank."""
    x = torch.zeros(shape)
    rank = dist.get_rank()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - t0) / 2)
    t = torch.tensor([statistics.median(times)])
    dist.broadcast(t, 0)
    return float(t)


def _gathered(sched, ex):
    """Every rank's trace of the executor's last step, on one clock, as a SimResult. Collective."""
    from autopar.runtime.measure.trace import gathered_result

    return gathered_result(sched, ex.trace, ex.trace_origin)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def emulated(rank: int, world: int, args) -> dict:
    from autopar.schedule.generators import make_schedule

    P, M = world, args.microbatches
    shape = (args.mb, args.seq, args.hidden)
    out = {}
    runs = []
    for name, opts in _chosen(args):
        sched = make_schedule(name, P, M, **opts)
        S = sched.num_stages
        tf_stage = args.tf * P / S
        ex = _autopar_emulated(sched, rank, shape, tf_stage)
        g = torch.Generator().manual_seed(0)
        mbs = [{"x": torch.randn(shape, generator=g)} for _ in range(M)]
        torch_sched = None
        if name in TORCH_HAS:
            mods = {s: SleepStage(tf_stage, 2 * tf_stage) for s in sched.stages_of_rank(rank)}
            torch_sched, _ = _torch_schedule(name, opts, mods, S, M, lambda s: torch.zeros(shape), _mean_loss)
        full = torch.cat([m["x"] for m in mbs])

        def torch_step(torch_sched=torch_sched, sched=sched, full=full):
            _torch_step(torch_sched, sched.stages_of_rank(rank), sched.num_stages, full, full)

        runs.append((name, opts, sched, ex, mbs, torch_sched, torch_step))
    tc = _one_way_seconds(shape)
    for _name, _opts, _sched, ex, mbs, ts, tstep in runs:  # warm-up (torch infers shapes on its first step)
        ex.run(mbs)
        if ts is not None:
            tstep()
    times: dict[str, dict[str, list[float]]] = {n: {"autopar": [], "torch": [], "bubble": []} for n, *_ in runs}
    for _ in range(args.repeats):
        for name, _opts, sched, ex, mbs, ts, tstep in runs:
            times[name]["autopar"].append(_timed(lambda ex=ex, mbs=mbs: ex.run(mbs)))
            times[name]["bubble"].append(float(_gathered(sched, ex).bubble_ratio))
            if ts is not None:
                times[name]["torch"].append(_timed(tstep))
    if rank == 0:
        from autopar.schedule.action_costs import Costs
        from autopar.schedule.simulator import simulate

        for name, opts, sched, *_ in runs:
            costs = Costs.from_rank_share(sched, tf=args.tf, tb=2 * args.tf, tr=args.tf)
            sim = simulate(sched, costs)
            with_tc = simulate(sched, Costs.from_rank_share(sched, tf=args.tf, tb=2 * args.tf, tr=args.tf, tc=tc))
            ideal = M * 3 * args.tf + (M * args.tf if name == "scp" else 0)  # SCP's rank 0 also recomputes
            out[name] = _summary(times[name], float(sim.bubble_ratio), ideal, opts)
            out[name]["sim_bubble_tc"] = float(with_tc.bubble_ratio)
            out[name]["tc_s"] = tc
    return out


# ---------------------------------------------------------------------------------------------
# Real compute


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Embedding, ``layers`` pre-norm MLP blocks, vocabulary head, cross-entropy against ``labels``."""

    def __init__(self, vocab: int, h: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class TorchStage(nn.Module):
    """Blocks ``lo..hi`` of a Net, with the embedding on the first stage and the head on the last."""

    def __init__(self, net: Net, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.emb = net.emb if first else None
        self.blocks = nn.ModuleList(net.blocks[lo:hi])
        self.ln_f = net.ln_f if last else None
        self.head = net.head if last else None

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def _ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def real(rank: int, world: int, args) -> dict:
    import copy

    import autopar
    from autopar.schedule.generators import make_schedule

    P, M = world, args.microbatches
    torch.manual_seed(0)
    net = Net(args.vocab, args.hidden, args.layers)
    B = args.mb * M
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (B, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (B, args.seq), generator=g)
    mesh = autopar.init_mesh("cpu", pp=P)
    runs = []
    for name, opts in _chosen(args):
        pipe = autopar.compile(
            copy.deepcopy(net),
            mesh,
            kwargs={"ids": ids, "labels": labels},
            microbatches=M,
            schedule=name,
            schedule_options=opts,
        )
        ts = None
        sched = make_schedule(name, P, M, **opts)
        S = sched.num_stages
        if name in TORCH_HAS:
            tnet = copy.deepcopy(net)
            per = args.layers / S
            mods = {
                s: TorchStage(tnet, round(s * per), round((s + 1) * per), s == 0, s == S - 1)
                for s in sched.stages_of_rank(rank)
            }

            def example(s: int):
                mb = ids[: args.mb]
                return mb if s == 0 else torch.zeros(args.mb, args.seq, args.hidden)

            ts, _ = _torch_schedule(name, opts, mods, S, M, example, _ce)

        def tstep(ts=ts, sched=sched):
            _torch_step(ts, sched.stages_of_rank(rank), sched.num_stages, ids, labels)

        runs.append((name, opts, pipe, ts, tstep))
    tc = _one_way_seconds((args.mb, args.seq, args.hidden))
    for _name, _opts, pipe, ts, tstep in runs:  # warm-up
        pipe.train_step(ids=ids, labels=labels)
        if ts is not None:
            tstep()
    times = {n: {"autopar": [], "torch": [], "bubble": []} for n, *_ in runs}
    for _ in range(args.repeats):
        for name, _opts, pipe, ts, tstep in runs:
            times[name]["autopar"].append(_timed(lambda pipe=pipe: pipe.train_step(ids=ids, labels=labels)))
            res = pipe.measured()
            times[name]["bubble"].append(float(res.bubble_ratio))
            if ts is not None:
                times[name]["torch"].append(_timed(tstep))
    out = {}
    last_steps = [pipe.measured() for _n, _o, pipe, *_ in runs]  # collective: every rank
    if rank == 0:
        from autopar.schedule.simulator import simulate

        for (name, opts, pipe, *_), m in zip(runs, last_steps):
            # the simulator with the per-stage compute times measured in autopar's last step
            sim = simulate(pipe.schedule, _measured_costs(pipe.schedule, m))
            with_tc = simulate(pipe.schedule, _measured_costs(pipe.schedule, m, tc))
            out[name] = _summary(times[name], float(sim.bubble_ratio), None, opts)
            out[name]["sim_bubble_tc"] = float(with_tc.bubble_ratio)
            out[name]["tc_s"] = tc
            out[name]["stages"] = [len(pipe.schedule.stages_of_rank(r)) for r in range(P)]
    return out


def _measured_costs(sched, m, tc: float = 0.0):
    """Per-stage mean forward/backward/recompute/weight-gradient seconds of a measured step, as simulator
    Costs (a split B's time is the input-gradient part; the whole backward is it plus the W's), and the
    mean time a rank spent issuing one send (a batch of sends and receives: from the end of the rank's
    previous action to the end of the post, over the batch's sends)."""
    from autopar.schedule.action_costs import Costs
    from autopar.schedule.actions import RECV_KINDS, SEND_KINDS, Kind, split_backwards

    acc: dict[tuple[str, int], list[float]] = {}
    posts: dict[tuple[int, float], list[float]] = {}  # (rank, post start) -> the batch's send times
    for events in m.timeline:
        free = 0.0  # the end of the rank's previous action: the executor's time to the post is the send's
        for e in sorted(events, key=lambda e: e.start):
            if e.action.kind in SEND_KINDS:
                posts.setdefault((e.rank, e.start), []).append(e.end - min(free, e.start))
            if e.action.kind not in RECV_KINDS:
                free = max(free, e.end)
        split = split_backwards([e.action for e in events])
        for e in events:
            a = e.action
            if a.kind in (Kind.F, Kind.B, Kind.W, Kind.RECOMPUTE):
                frac = float(a.recompute) if a.kind is Kind.RECOMPUTE else 1.0
                kind = "split B" if a.kind is Kind.B and (a.mb, a.stage) in split else a.kind.value
                acc.setdefault((kind, a.stage), []).append((e.end - e.start) / max(frac, 1e-9))
    S = sched.num_stages

    def mean(kind, s, default):
        xs = acc.get((kind, s))
        return statistics.fmean(xs) if xs else default

    tf = [mean("F", s, 0.0) for s in range(S)]
    tw = [mean("W", s, 0.0) for s in range(S)]
    tb = [mean("B", s, mean("split B", s, 0.0) + tw[s]) for s in range(S)]
    tr = [mean("RECOMPUTE", s, tf[s]) for s in range(S)]
    t_send = sum(d[0] for d in posts.values()) / max(sum(len(d) for d in posts.values()), 1)
    tw = [min(w, b) for w, b in zip(tw, tb)]
    return Costs.uniform(S, tf=tf, tb=tb, tr=tr, tc=tc, tw=tw, t_send=t_send, t_action=_action_gap(sched, m))


def _action_gap(sched, m) -> float:
    """The executor's own mean time before a compute action that waited for no data (``Costs.t_action``):
    from the end of the rank's previous action (a send's post included) to the compute's start."""
    from autopar.schedule.actions import COMPUTE_KINDS, RECV_KINDS, Kind

    s2r, gaps = sched.stage_to_rank, []
    for r, events in enumerate(m.timeline):
        received = {e.action: e.end for e in events if e.action.kind in RECV_KINDS}  # the wait's end
        prev = None
        for e in events:
            a = e.action
            if a.kind in RECV_KINDS:
                continue
            if a.kind in COMPUTE_KINDS and prev is not None:
                s, want = a.stage, None
                if a.kind is Kind.F and s and s2r[s - 1] != r:
                    want = (Kind.RECV_ACT, s, a.mb)
                elif a.kind is Kind.B and s + 1 < len(s2r) and s2r[s + 1] != r:
                    want = (Kind.RECV_GRAD, s, a.mb)
                done = next((t for b, t in received.items() if (b.kind, b.stage, b.mb) == want), None)
                if done is None or done <= prev + 1e-4:  # it did not wait
                    gaps.append(e.start - prev)
            prev = e.end
    return statistics.fmean(gaps) if gaps else 0.0


def _in_step_hop(sched, m) -> float:
    """The mean one-way time of a boundary message inside the step, over the messages whose receiver
    sat waiting when the send was posted: from the post to the end of the receive's wait (gloo's
    transfer plus waking the blocked rank). The idle ping-pong of ``_one_way_seconds`` measures the
    transfer alone. Needs the traces on one clock (``_gathered``)."""
    from autopar.schedule.actions import RECV_KINDS, Action, Kind

    at = {e.action: e for events in m.timeline for e in events}
    hops = []
    for events in m.timeline:
        ends = sorted(e.end for e in events if e.action.kind not in RECV_KINDS)  # the rank's own actions
        for e in events:
            a = e.action
            if a.kind not in RECV_KINDS:
                continue
            kind = Kind.SEND_ACT if a.kind is Kind.RECV_ACT else Kind.SEND_GRAD
            send = at.get(Action(kind, a.peer, a.mb, a.stage))
            free = max((t for t in ends if t <= e.end), default=0.0)  # when the rank began to wait
            if send is not None and free <= send.start:
                hops.append(e.end - send.start)
    return statistics.fmean(hops) if hops else 0.0


def _summary(t: dict, sim_bubble: float, ideal: float | None, opts: dict) -> dict:
    a = t["autopar"]
    out = {
        "options": {k: str(v) for k, v in opts.items()},
        "autopar_median_s": statistics.median(a),
        "autopar_min_s": min(a),
        "autopar_bubble_trace": statistics.median(t["bubble"]),
        "sim_bubble": sim_bubble,
    }
    if ideal is not None:
        out["autopar_bubble_step"] = statistics.median(a) / ideal - 1
    if t["torch"]:
        b = t["torch"]
        out.update(torch_median_s=statistics.median(b), torch_min_s=min(b))
        out["throughput_ratio"] = statistics.median(b) / statistics.median(a)
        if ideal is not None:
            out["torch_bubble_step"] = statistics.median(b) / ideal - 1
    return out


# ---------------------------------------------------------------------------------------------
# Launch


def _worker(rank: int, world: int, port: int, args, result: str) -> None:
    init_worker(rank, world, port, args.timeout)
    try:
        out = emulated(rank, world, args) if args.mode == "emulated" else real(rank, world, args)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def _table(res: dict, emulated_mode: bool) -> str:
    head = "| schedule | autopar median (min) s | torch median (min) s | throughput autopar/torch | "
    head += "bubble autopar (trace) | bubble simulated | bubble simulated + t_c |"
    if emulated_mode:
        head += " bubble autopar (step) | bubble torch (step) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in res.items():
        opts = ",".join(f"{k}={v}" for k, v in r["options"].items())
        label = f"{name} {opts}".strip()
        t = f"{r['torch_median_s']:.3f} ({r['torch_min_s']:.3f})" if "torch_median_s" in r else "n/a"
        ratio = f"{r['throughput_ratio']:.2f}" if "throughput_ratio" in r else "n/a"
        row = (
            f"| {label} | {r['autopar_median_s']:.3f} ({r['autopar_min_s']:.3f}) | {t} | {ratio} | "
            f"{r['autopar_bubble_trace']:.3f} | {r['sim_bubble']:.3f} | {r['sim_bubble_tc']:.3f} |"
        )
        if emulated_mode:
            tb = f"{r['torch_bubble_step']:.3f}" if "torch_bubble_step" in r else "n/a"
            row += f" {r['autopar_bubble_step']:.3f} | {tb} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("emulated", "real"), default="emulated")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tf", type=float, default=0.03, help="emulated: forward seconds of a rank's share per mb")
    p.add_argument("--mb", type=int, default=2, help="microbatch size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8, help="real: MLP blocks")
    p.add_argument("--vocab", type=int, default=1024, help="real: vocabulary")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--schedules", help="comma-separated subset of " + ",".join(n for n, _ in SCHEDULES))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if unknown := set((args.schedules or "").replace(" ", "").split(",")) - {n for n, _ in SCHEDULES} - {""}:
        p.error(f"unknown schedules {sorted(unknown)}")
    port = free_port()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "out.json")
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(args.ranks, port, args, result), nprocs=args.ranks, join=True)
        res = json.load(open(result))
    print(
        f"{args.mode}: P={args.ranks} M={args.microbatches} repeats={args.repeats} "
        f"boundary={args.mb}x{args.seq}x{args.hidden} f32"
        + (f" T_F={args.tf}s T_B={2 * args.tf}s per rank share" if args.mode == "emulated" else "")
        + f" ({time.perf_counter() - t0:.0f} s)"
    )
    print(_table(res, args.mode == "emulated"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
