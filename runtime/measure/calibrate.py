"""Measure this machine for the cost model: matmul FLOP/s, elementwise bandwidth, collectives' alpha-beta.

``calibrate(ranks)`` spawns ``ranks`` local processes on the local backend (NCCL with one GPU each
when CUDA has enough devices, else gloo with one thread each, as autopar trains), and in all of them
at once, as in a training step:

- times square matmuls (fp32, and bf16/fp16) -> ``peak_flops`` with ``efficiency: 1`` (the rates
  are what a kernel sustains here, not a datasheet peak);
- times ``x + y`` on tensors far larger than the caches -> ``memory_bandwidth`` (3 tensors moved);
- times all_reduce, all_gather, reduce_scatter over all ranks and send/recv between ranks 0 and 1
  at several sizes and fits ``t = A + S * B`` by least squares; with the ring model of
  ``solver/cluster/spec.py`` (steps k: 2(n-1) for all_reduce, n-1 otherwise, 1 for send) the latency per
  step is A / k and the bandwidth k / (n B), written under ``collectives`` of the spec.

The result is a ``ClusterSpec`` of one node with ``ranks`` devices (``local_cluster`` rescales it
to the job's world size); ``autopar calibrate`` writes it as YAML.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.comm.teardown import shutdown
from autopar.solver.cluster.compute import Curve, DeviceTable
from autopar.solver.cluster.spec import ClusterSpec

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
CPU_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 23)  # bytes per collective
GPU_SIZES = (1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)
CPU_SWEEP = (32, 128, 512, 1024)  # matmul dimensions m, n, k swept (every combination) for the device table
GPU_SWEEP = (256, 1024, 4096, 8192)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what compute is timed with: wall time on a GPU (the kernel runs asynchronously), this thread's CPU time on a CPU
# (what a rank's own work takes: on a machine others load, the time the process waits descheduled is not its
# work's, and wall time would price the load of the moment into every op; ``_worker`` sets it)
CLOCK: Callable[[], float] = time.perf_counter


def _median_seconds(
    fn: Callable[[], Any], reps: int, sync: Callable[[], None], clock: Callable[[], float] | None = None
) -> float:
    clock = clock or CLOCK
    fn()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


def _matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int, sync) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b), reps, sync)


def _gemm_sweep(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...], reps: int, sync) -> list[list[float]]:
    """[m, n, k, seconds] of ``torch.mm`` of [m, k] x [k, n] for every m, n, k in ``dims``."""
    out = []
    for m in dims:
        for n in dims:
            for k in dims:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                out.append([m, n, k, _median_seconds(lambda a=a, b=b: torch.mm(a, b), reps, sync)])
    return out


def _launch_seconds(device: torch.device, reps: int, sync) -> float:
    """Seconds of an elementwise op on 16 elements: the fixed cost of one kernel (dispatch and launch)."""
    x, y = torch.randn(16, device=device), torch.randn(16, device=device)
    out = torch.empty_like(x)
    return _median_seconds(lambda: torch.add(x, y, out=out), max(reps, 20), sync)


def _eager_op_seconds(device: torch.device, reps: int, sync) -> float:
    """A third of an eager op's forward plus backward through autograd on 16 elements: what a training step pays
    per op beyond its kernel (dispatch, autograd's graph and engine), in the units ``launch_seconds`` is priced in
    (one forward, two backward: ``compute.train_seconds``)."""
    x = torch.randn(16, device=device, requires_grad=True)
    chain = 50

    def step() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return _median_seconds(step, max(reps, 10), sync) / chain / 3


CACHE_NUMELS = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # x + y sizes (float32 elements) for the cache


def _cache_points(device: torch.device, reps: int, sync) -> list[list[float]]:
    """[bytes moved, seconds] of ``x + y`` at each of ``CACHE_NUMELS`` (3 tensors moved)."""
    out = []
    for numel in CACHE_NUMELS:
        x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
        o = torch.empty_like(x)
        seconds = _median_seconds(lambda x=x, y=y, o=o: torch.add(x, y, out=o), max(reps, 20), sync)
        out.append([3.0 * x.nbytes, seconds])
    return out


def _rate_points(device: torch.device, reps: int, sync) -> dict[str, float]:
    """IR FLOPs per second (passes/lower.py's count) of a ``compute.RATE_CLASSES`` class's op, forward plus backward
    / 3 as training runs it: gelu on 1M elements (1 FLOP an element) for "transcendental", cross-entropy over
    [1024, 1024] logits (4 FLOPs an input element) for "softmax"."""
    x = torch.randn(1 << 20, device=device, requires_grad=True)
    logits = torch.randn(1024, 1024, device=device, requires_grad=True)
    labels = torch.randint(0, 1024, (1024,), device=device)
    gelu = _median_seconds(lambda: torch.nn.functional.gelu(x, approximate="tanh").sum().backward(), reps, sync)
    loss = _median_seconds(lambda: torch.nn.functional.cross_entropy(logits, labels).backward(), reps, sync)
    return {"transcendental": x.numel() / (gelu / 3), "softmax": 4 * logits.numel() / (loss / 3)}


ATTENTION_SHAPES = ((8, 4, 128, 32), (8, 4, 256, 64), (4, 8, 512, 64))  # (batch, heads, seq, head dim)


def _attention_points(device: torch.device, reps: int, sync, quick: bool = False) -> list[list[float]]:
    """[query rows, keys, head dim, seconds of a third of forward plus backward] of causal SDPA at each of
    ``ATTENTION_SHAPES``: the attention kernel as training runs it (its backward is not twice its forward on a
    CPU: the flash kernel recomputes)."""
    out = []
    for b, h, s, d in ATTENTION_SHAPES[:2] if quick else ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device=device, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        out.append([b * h * s, s, d, _median_seconds(step, reps, sync) / 3])
    return out


def _bandwidth(device: torch.device, numel: int, reps: int, sync) -> float:
    x, y = torch.randn(numel, device=device), torch.randn(numel, device=device)
    out = torch.empty_like(x)
    return 3 * x.nbytes / _median_seconds(lambda: torch.add(x, y, out=out), reps, sync)


def _collective_times(device: torch.device, sizes: tuple[int, ...], reps: int, sync) -> dict[str, list[float]]:
    """Per kind, the median seconds at each size (every rank times the same calls; rank 0's are kept)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        x = torch.ones(numel, device=device)
        shards = torch.empty(numel // world, device=device)
        gathered = torch.empty(numel, device=device)
        calls = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "all_gather": lambda s=shards, g=gathered: dist.all_gather_into_tensor(g, s),
            "reduce_scatter": lambda s=shards, x=x: dist.reduce_scatter_tensor(s, x),
        }
        if device.type == "cpu":  # gloo has no reduce_scatter_tensor / all_gather_into_tensor everywhere
            parts = list(x.chunk(world))
            calls["all_gather"] = lambda s=shards, p=parts: dist.all_gather(p, s)
            calls["reduce_scatter"] = lambda x=x, p=parts: _reduce_scatter_gloo(x, p)
        for kind, fn in calls.items():
            dist.barrier()
            out[kind].append(_median_seconds(fn, reps, sync, time.perf_counter))  # wall: waiting is their time
        dist.barrier()
        if rank in (0, 1):
            peer = 1 - rank

            def ping(x=x, peer=peer, rank=rank) -> None:  # one way = half a round trip
                if rank == 0:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)

            out["send"].append(_median_seconds(ping, reps, sync, time.perf_counter) / 2)
        dist.barrier()
    return out


def _reduce_scatter_gloo(x: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """What a reduce-scatter costs on gloo, which has none: the ring's half of an all-reduce is not
    available, so autopar's runtime all-reduces and keeps its slice (runtime/comm/pending.py)."""
    dist.all_reduce(x)
    parts[dist.get_rank()].clone()


def _worker(rank: int, world: int, port: int, backend: str, opts: dict, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)

        def sync() -> None:
            torch.cuda.synchronize()
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        global CLOCK
        CLOCK = time.thread_time

        def sync() -> None:
            pass

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        say = print if rank == 0 and opts["progress"] else (lambda *a, **k: None)
        low = torch.bfloat16 if backend == "nccl" else torch.float32
        n = opts["matmul_size"]
        say(f"  matmul {n}x{n} fp32 on every rank at once ...", flush=True)
        flops = {"fp32": _matmul_rate(device, torch.float32, n, opts["reps"], sync)}
        if backend == "nccl":
            say(f"  matmul {n}x{n} bf16 ...", flush=True)
            flops["bf16"] = _matmul_rate(device, low, n, opts["reps"], sync)
        sweep = {}
        for name, dt in [("fp32", torch.float32)] + ([("bf16", low)] if backend == "nccl" else []):
            say(f"  matmul sweep {name}, m, n, k in {opts['sweep']} ...", flush=True)
            sweep[name] = _gemm_sweep(device, dt, opts["sweep"], opts["reps"], sync)
        say("  elementwise add bandwidth ...", flush=True)
        bandwidth = _bandwidth(device, opts["stream_numel"], opts["reps"], sync)
        launch = _launch_seconds(device, opts["reps"], sync)
        result = {"flops": flops, "bandwidth": bandwidth, "sweep": sweep, "launch": launch}
        if backend == "gloo":
            say("  eager op overhead, cache bandwidth, attention ...", flush=True)
            result["eager_op"] = _eager_op_seconds(device, opts["reps"], sync)
            result["cache"] = _cache_points(device, opts["reps"], sync)
            result["attention"] = _attention_points(device, opts["reps"], sync, opts["quick"])
            result["rates"] = _rate_points(device, opts["reps"], sync)
        say(f"  collectives over {world} ranks at {len(opts['sizes'])} sizes ...", flush=True)
        result["collectives"] = _collective_times(device, opts["sizes"], opts["reps"], sync) if world > 1 else {}
        result["load"] = list(os.getloadavg())
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        shutdown()  # a spawned process finalizes its interpreter: its gloo threads must be joined first


def fit_alpha_beta(kind: str, n: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(latency per step, bandwidth bytes/s) of the ring model from times at sizes (least squares on
    ``t = A + S * B``; a slope or intercept fitted below zero is clamped)."""
    if kind == "send":
        steps, share = 1, 1.0
    else:
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        share = steps / n
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), 1)
    slope = max(float(slope), 1e-15)
    return max(float(intercept), 0.0) / steps, share / slope


def calibrate(
    ranks: int = 2, quick: bool = False, progress: bool = True, sweep: tuple[int, ...] | None = None
) -> tuple[ClusterSpec, DeviceTable | None]:
    """Measure this machine with ``ranks`` local processes (module docstring): its spec and its device table
    (the matmul sweep over every m, n, k in ``sweep``, default ``CPU_SWEEP`` / ``GPU_SWEEP``, fitted)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    backend = "nccl" if cuda else "gloo"
    sizes = (GPU_SIZES if cuda else CPU_SIZES)[: 3 if quick else None]
    opts = {
        "reps": 3 if quick else 10,
        "matmul_size": (4096 if cuda else 256) if quick else (8192 if cuda else 1024),
        "stream_numel": (1 << 26 if cuda else 1 << 22) if quick else (1 << 28 if cuda else 1 << 24),
        "sizes": sizes,
        "sweep": sweep or ((GPU_SWEEP if cuda else CPU_SWEEP)[:2] if quick else (GPU_SWEEP if cuda else CPU_SWEEP)),
        "progress": progress,
        "quick": quick,
    }
    if progress:
        print(f"calibrating {backend} with {ranks} local processes ({'quick' if quick else 'full'}):", flush=True)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(ranks, _free_port(), backend, opts, d), nprocs=ranks, join=True)
        results = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(ranks)]
    spec = spec_from_measurements(results, backend, ranks, list(sizes))
    if "sweep" not in results[0]:
        return spec, None
    table, peaks = table_from_measurements(results, backend)
    return spec.replace(peak_flops={**spec.peak_flops, **peaks}, efficiency=None), table


def fit_curve(points: list[tuple[int, int, int, float]]) -> Curve:
    """The ``Curve`` (max_eff, half) closest in relative error to measured efficiencies [(m, n, k, eff)]: half on a
    log grid, max_eff in closed form for each (least squares of predicted / measured - 1), at most 1."""
    best = None
    for half in [0.0] + [float(h) for h in np.geomspace(1, 8192, 79)]:
        s = np.array([Curve(1.0, half)(m, n, k) / e for m, n, k, e in points])
        max_eff = min(1.0, float(s.sum() / (s * s).sum()))
        err = float(((max_eff * s - 1) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, Curve(max_eff, half))
    return best[1]


def table_from_measurements(results: list[dict], backend: str) -> tuple[DeviceTable, dict[str, float]]:
    """(device table, peak FLOP/s per dtype) of per-rank sweeps: per dtype the peak is the fastest rate measured
    (medians over ranks), the curve fitted to the rates as fractions of it (``fit_curve``)."""
    curves, peaks, sources = {}, {}, {}
    for dtype in results[0]["sweep"]:
        rows = results[0]["sweep"][dtype]
        secs = [statistics.median(r["sweep"][dtype][i][3] for r in results) for i in range(len(rows))]
        rates = [2 * m * n * k / t for (m, n, k, _), t in zip(rows, secs)]
        peaks[dtype] = max(rates + [statistics.median(r["flops"][dtype] for r in results)])
        curves[dtype] = fit_curve([(int(m), int(n), int(k), r / peaks[dtype]) for (m, n, k, _), r in zip(rows, rates)])
        sources[f"matmul {dtype}"] = (
            f"measured: torch.mm sweep over m, n, k in {sorted({int(r[0]) for r in rows})} on every rank at once, "
            f"fitted (peak {peaks[dtype] / 1e9:.1f} GFLOP/s = the fastest shape)"
        )
    if "bf16" not in curves:
        curves["default"] = curves["fp32"]
    launch = statistics.median(r["launch"] for r in results)
    bandwidth = statistics.median(r["bandwidth"] for r in results)
    extra: dict[str, Any] = {}
    if "eager_op" in results[0]:  # a CPU: eager per-op overhead, the cache term, attention's own curve (CPU time)
        launch = statistics.median(r["eager_op"] for r in results)
        bare = statistics.median(r["launch"] for r in results)  # a small add's time is mostly its launch
        cache = [
            (b, max(statistics.median(r["cache"][i][1] for r in results) - bare, 1e-9))
            for i, (b, _) in enumerate(results[0]["cache"])
        ]
        extra["cache_bytes"], extra["cache_bandwidth"] = fit_cache(cache, bandwidth)
        shapes = results[0]["attention"]
        secs = [statistics.median(r["attention"][i][3] for r in results) for i in range(len(shapes))]
        # at the FLOPs the IR counts (passes/lower.py: 4 m n k, causal or not), as compute.efficiency reads the curve
        eff = [4.0 * m * n * k / t / peaks["fp32"] for (m, n, k, _), t in zip(shapes, secs)]
        attn = fit_curve([(int(n), int(k) * 16, 0, e) for (m, n, k, _), e in zip(shapes, eff)])
        extra["attention"] = {"default": attn}
        sources["attention"] = (
            "measured: causal SDPA forward plus backward / 3 (at the IR's 4 m n k FLOPs) at (query rows, keys, head "
            f"dim) in {[tuple(int(x) for x in p[:3]) for p in shapes]}, as a fraction of the fp32 peak, fitted: max_eff"
            f" {attn.max_eff:.3f}, half {attn.half:.0f}"
        )
        sources["cache"] = (
            "measured: x + y less a bare launch at "
            + ", ".join(f"{b / 1024:.0f} KiB: {b / t / 1e9:.1f} GB/s" for b, t in cache)
            + f"; fitted: the first {extra['cache_bytes'] / 1024:.0f} KiB of an op's traffic at "
            f"{extra['cache_bandwidth'] / 1e9:.1f} GB/s, the rest at the streaming rate"
        )  # fmt: skip
        sources["launch_seconds"] = (
            f"measured: an eager op's forward and backward through autograd on 16 elements / 3, {launch * 1e6:.2f} us "
            f"(a bare x + y: {statistics.median(r['launch'] for r in results) * 1e6:.2f} us)"
        )
        extra["rates"] = {c: statistics.median(r["rates"][c] for r in results) for c in results[0]["rates"]}
        sources["rates"] = (
            "measured: IR FLOPs per second, forward plus backward / 3, of gelu (tanh) on 1M elements (transcendental: "
            f"{extra['rates']['transcendental'] / 1e9:.2f} GFLOP/s) and cross-entropy over [1024, 1024] logits "
            f"(softmax: {extra['rates']['softmax'] / 1e9:.2f} GFLOP/s)"
        )
        sources["clock"] = "this thread's CPU time (time.thread_time): the rank's own work, not the machine's load"
    if "load" in results[0]:
        sources["load"] = "load average (1, 5, 15 min) at the measurement: " + ", ".join(
            f"{x:.1f}" for x in results[0]["load"]
        )
    table = DeviceTable(
        name=f"local-{backend}-calibrated",
        matmul=curves,
        attention=extra.get("attention") or {"default": curves.get("bf16", curves["fp32"])},
        vector_eff=1.0 if backend == "gloo" else 0.125,
        bandwidth_eff=1.0,
        launch_seconds=launch,
        memory_bandwidth=bandwidth,
        sources={
            "source": f"autopar calibrate on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}, torch "
            f"{torch.__version__}",
            "attention": "the matmul curve (no fused attention kernel was measured)",
            "bandwidth_eff": "1: memory_bandwidth is the measured x + y rate itself",
            "launch_seconds": f"measured: median of x + y on 16 elements, {launch * 1e6:.1f} us",
            "vector_eff": "estimate: elementwise FLOPs at the matmul peak on CPU (bandwidth-bound), 1/8 on GPU",
            **sources,
        },
        cache_bandwidth=extra.get("cache_bandwidth"),
        cache_bytes=extra.get("cache_bytes", 0.0),
        rates=extra.get("rates", {}),
    )
    return table, peaks


def fit_cache(points: list[tuple[float, float]], bandwidth: float) -> tuple[float, float]:
    """(cache_bytes, cache_bandwidth) of ``DeviceTable.stream_seconds`` closest in relative error to [(bytes moved,
    seconds)] measured, with ``bandwidth`` the streaming rate: cache_bytes among the sizes measured (and 0), the
    cache bandwidth for each in closed form (least squares of predicted / measured - 1 over the points whose bytes
    fit, at least the streaming rate)."""
    best: tuple[float, float, float] | None = None
    for c in [0.0] + [b for b, _ in points]:
        fits = [(b, t) for b, t in points if b <= c]
        rate = bandwidth
        if fits:  # predicted / measured = (b / rate) / t: least squares over 1 / rate
            x = [b / t for b, t in fits]
            rate = max(bandwidth, sum(v * v for v in x) / sum(x))
        table = DeviceTable("fit", {}, {}, 1.0, 1.0, 0.0, cache_bandwidth=rate, cache_bytes=c)
        err = sum((table.stream_seconds(b, bandwidth) / t - 1) ** 2 for b, t in points)
        if best is None or err < best[0]:
            best = (err, c, rate)
    return best[1], best[2]


def spec_from_measurements(results: list[dict], backend: str, ranks: int, sizes: list[int]) -> ClusterSpec:
    """The cluster spec of per-rank measurements (medians over ranks for compute, rank 0's for links)."""
    flops = {k: statistics.median(r["flops"][k] for r in results) for k in results[0]["flops"]}
    if "bf16" not in flops:  # CPU: no faster 16-bit matmul is assumed
        flops["bf16"] = flops["fp32"]
    bandwidth = statistics.median(r["bandwidth"] for r in results)
    base = ClusterSpec.load("local-cpu" if backend == "gloo" else "local-gpu").to_dict()
    collectives, notes = {}, {}
    for kind, seconds in results[0]["collectives"].items():
        lat, bw = fit_alpha_beta(kind, ranks, sizes, seconds)
        collectives[kind] = {"latency": lat, "bandwidth": bw}
        notes[f"measured {kind}"] = ", ".join(f"{s}B: {t * 1e6:.0f}us" for s, t in zip(sizes, seconds))
    link = collectives.get("all_reduce")
    data = dict(
        base,
        name=f"local-{backend}-calibrated",
        description=f"this machine measured by `autopar calibrate` with {ranks} {backend} processes",
        nodes=1,
        devices_per_node=ranks,
        peak_flops=flops,
        efficiency=1.0,
        memory_bandwidth=bandwidth,
        collectives=collectives,
        backend=backend,
        notes={
            "source": f"autopar calibrate on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}, torch "
            f"{torch.__version__}",
            "peak_flops": "sustained square-matmul rates on every rank at once (efficiency 1)",
            **notes,
        },
    )
    if link is not None:
        data["intra_node_latency"], data["intra_node_bandwidth"] = link["latency"], link["bandwidth"]
    return ClusterSpec.from_dict(data)


__all__ = ["calibrate", "fit_alpha_beta", "fit_cache", "fit_curve", "spec_from_measurements", "table_from_measurements"]
