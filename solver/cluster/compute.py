"""Compute time of one op from its shape and dtype: a roofline with a per-op-class efficiency curve.

Every price model of autopar (the sharding ILP's ``CostModel``, the stage balancer's ``SubgraphCost``, the
search's ``StageTerms`` and, through them, the simulator's actions) prices an op's computation here:

    seconds(work, device) = launch + max(flops / (peak(dtype) * efficiency(work)), bytes / bandwidth)

and its backward ``backward_seconds``: a matmul's two gradient matmuls, each at its own shape; twice the forward for
other ops (unfused attention's scores aside).

``Work`` describes one op's forward: its class, FLOPs, bytes moved and, for a matmul, its shape
[m, k] x [k, n] (batch dimensions folded into m); for attention its kind (fused: one kernel such as
FlashAttention, scores never stored; unfused attention is lowered to matmuls and a softmax, which are
priced as such) and its shape (m = query rows b*heads*s_q, n = keys s_kv, k = head dim).

The efficiency curve of a matmul is a product over its three dimensions of a saturating term,

    efficiency(m, n, k) = max_eff(dtype) * s(m) * s(n) * s(k),   s(x) = x / (x + half(dtype)),

so it never decreases as any dimension grows, never exceeds ``max_eff`` (at most 1), and is symmetric in
m, n, k. On a GPU whose table gives its SM count and a dtype's output tile, a GEMM's efficiency is at most its
wave bound (``DeviceTable.wave_bound``: cuBLAS computes the m x n output in tiles, one per SM, in waves; a partial
last wave leaves SMs idle, NVIDIA's "wave quantization"):

    efficiency(m, n, k) = min(curve(m, n, k), max_eff * s(k) * m n / (waves * SMs * tile area))

so its efficiency is no longer monotone (a new wave begun nearly empty), but its seconds are: never falling as m,
n or k grows. The bound quantizes the output, so the backward's two matmuls ([m, n] x [n, k] with output m x k,
and [k, m] x [m, n] with output k x n: ``gradient_works``) are priced at their own shapes; where no bound applies
they price as the forward (the curve is symmetric). Fused attention uses the smooth form on its own (max_eff,
half); elementwise ops and reductions are priced by bytes moved at ``bandwidth_eff`` x the device's memory
bandwidth, their FLOPs at the vector efficiency (a gelu's, a softmax's at its class's measured rate where the
table has one: ``Work.rated``, in a fused kernel as alone).

A ``DeviceTable`` holds those numbers for one device kind, read from ``solver/cluster/devices/KIND.yaml``
(each number with its source beside it, estimates marked as such) or from a file ``autopar calibrate``
wrote; a ``ClusterSpec`` names its kind in ``device`` and gives the peaks (``peak_flops``) and the memory
bandwidth the table's fractions apply to. A table may add a cache term (``cache_bytes`` of an op's traffic at
``cache_bandwidth``: ``DeviceTable.stream_seconds``), which `autopar calibrate` measures on a CPU. A spec's
``efficiency`` (a constant fraction of peak), where given, replaces the matmul and attention curves: what a user
who measured one number asks for.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autopar.errors import ClusterSpecError
from autopar.ir.core import VIEW_OPS
from autopar.solver.cluster.fields import DTYPES

DEVICE_DIR = Path(__file__).parent / "devices"
KINDS = ("matmul", "attention", "elementwise")  # op classes (a reduction is priced as elementwise: bytes moved)


@dataclass(frozen=True)
class Work:
    """One op's forward work, global or per rank (``split``): what ``seconds`` prices."""

    # "matmul", "attention" (fused: one kernel), "attention_unfused" (two matmuls and the scores materialized)
    # or "elementwise" (elementwise ops and reductions)
    kind: str
    flops: float
    bytes: float = 0.0
    m: int = 0  # matmul: rows (batch folded in); attention: query rows b*heads*s_q
    n: int = 0  # matmul: columns; attention: keys s_kv
    k: int = 0  # matmul: the contracted dimension; attention: head dim
    dtype: str = "fp32"
    ops: int = 1  # kernels launched (an aggregate of several elementwise ops counts each)
    # the fraction of the kernel described that this work is (``compiled_shares``: an op's share of its fused
    # kernel): priced as that fraction of the kernel's seconds
    share: float = 1.0
    # the FLOPs of it that run at a rate of their op class where the device table has one (``DeviceTable.rates``,
    # ``RATE_CLASSES``: "transcendental" for gelu, silu, ..., "softmax" for it and the loss's), as (class, fraction
    # of ``flops``) pairs: a gelu's (("transcendental", 1.0),); a fused kernel's its members' (``compiled_works``)
    rated: tuple[tuple[str, float], ...] = ()

    def split(self, ways: int) -> Work:
        """The work of one of ``ways`` ranks that divide it: FLOPs and bytes / ways and, for a matmul or
        attention, the largest of m, n, k divided (a data-parallel split divides the rows, Megatron's column
        and row splits the output and contracted dimensions: each its largest in a transformer layer)."""
        if ways <= 1:
            return self
        dims = {"m": self.m, "n": self.n, "k": self.k}
        if self.kind != "elementwise" and max(dims.values()) > 0:
            big = max(dims, key=lambda d: dims[d])
            dims[big] = max(1, math.ceil(dims[big] / ways))
        return replace(self, flops=self.flops / ways, bytes=self.bytes / ways, **dims)

    def scaled(self, factor: float) -> Work:
        """The work of ``factor`` times as many rows (a micro-batch of ``factor`` samples of a per-sample work)."""
        if factor == 1:
            return self
        m = max(1, round(self.m * factor)) if self.m else 0
        return replace(self, flops=self.flops * factor, bytes=self.bytes * factor, m=m)


@dataclass(frozen=True)
class Curve:
    """A saturating efficiency: ``max_eff * prod(x / (x + half))`` over the dimensions given; for a matmul, the
    output tile cuBLAS runs a large GEMM of this dtype in, where the table gives one (``DeviceTable.wave_bound``)."""

    max_eff: float
    half: float
    tile: tuple[int, int] | None = None  # rows x columns of the output one thread block computes, one block per SM

    def __call__(self, *dims: int) -> float:
        e = self.max_eff
        for x in dims:
            e *= x / (x + self.half) if x > 0 else 1.0
        return e


@dataclass(frozen=True)
class DeviceTable:
    """Efficiencies of one device kind (fractions of the cluster spec's peaks and memory bandwidth)."""

    name: str
    matmul: dict[str, Curve]  # per dtype ("fp32", "bf16", ...; "default" for any other)
    attention: dict[str, Curve]  # fused attention, per dtype
    vector_eff: float  # fraction of peak an elementwise op's FLOPs run at
    bandwidth_eff: float  # fraction of memory_bandwidth an elementwise op or reduction streams at
    launch_seconds: float  # fixed time per kernel (launch and framework overhead)
    memory_bandwidth: float | None = None  # bytes/s, where the table knows it (a spec's own value wins)
    sources: dict[str, str] = field(default_factory=dict)
    # an op's first ``cache_bytes`` of traffic stream at ``cache_bandwidth`` (bytes/s; None: no cache term), the rest
    # at the streaming rate: on a CPU an op on tensors that stay in its caches runs several times faster than one
    # streaming from memory (`autopar calibrate` fits both to x + y timed at sizes from 48 KiB to 200 MiB)
    cache_bandwidth: float | None = None
    cache_bytes: float = 0.0
    # IR FLOPs per second (passes/lower.py's count: 1 an element for gelu, 5 for a softmax, 4 for a loss's input)
    # of the elementwise ops of a ``RATE_CLASSES`` class, forward plus backward / 3 as training runs them: on a CPU
    # a transcendental op is bound by its arithmetic, not its bytes (`autopar calibrate` measures gelu and the loss)
    rates: dict[str, float] = field(default_factory=dict)
    # streaming multiprocessors (a GPU's; None: no wave quantization, as on a CPU): a GEMM's output tiles run in
    # waves of one tile per SM (``wave_bound``)
    sms: int | None = None

    def stream_seconds(self, nbytes: float, bandwidth: float) -> float:
        """Seconds to move ``nbytes`` with ``bandwidth`` the device's memory bandwidth: the first ``cache_bytes`` at
        ``cache_bandwidth`` (where the table has one), the rest at ``bandwidth_eff`` x ``bandwidth``. Never
        decreasing in ``nbytes``, and never above the time without the cache term (a cache is not slower)."""
        rate = bandwidth * self.bandwidth_eff
        if not self.cache_bandwidth or not self.cache_bytes:
            return nbytes / rate
        fast = min(nbytes, self.cache_bytes)
        return fast / max(self.cache_bandwidth, rate) + (nbytes - fast) / rate

    def curve(self, kind: str, dtype: str) -> Curve:
        table = self.matmul if kind == "matmul" else self.attention
        found = table.get(dtype) or table.get("default")
        if found is None:
            raise ClusterSpecError(
                f"device table {self.name!r} has no {kind} curve for {dtype}; it has {', '.join(sorted(table))}"
            )
        return found

    def efficiency(self, work: Work) -> float:
        """The fraction of peak ``work``'s FLOPs run at."""
        if work.kind == "elementwise":
            return self.vector_eff
        if work.kind == "attention":
            return self.curve("attention", work.dtype)(work.n, work.k * 16)  # head dim: 64-128 saturates
        curve = self.curve("matmul", work.dtype)
        return min(curve(work.m, work.n, work.k), self.wave_bound(curve, work.m, work.n, work.k))

    def wave_bound(self, curve: Curve, m: int, n: int, k: int) -> float:
        """The efficiency an [m, k] x [k, n] GEMM reaches at most when its m x n output runs in whole waves of
        ``curve.tile`` tiles, one per SM (NVIDIA, Matrix Multiplication Background User's Guide, "Wave
        Quantization": a partial last wave leaves SMs idle; "Tile Quantization": a partial tile does a whole
        tile's work): ``max_eff * s(k) * m n / (waves * sms * tile area)``, s(k) the curve's term of the
        contracted dimension (a tile's steps along k), the tile in whichever of its two orientations (cuBLAS has
        both: 256 x 128 and 128 x 256) needs fewer waves. The GEMM then takes at least ``waves`` tile-times:
        its seconds never fall as m, n or k grows, though its efficiency may (a new wave begun nearly empty).

        ``max_eff`` (no bound) where the table gives no tile or SM count, where the output is narrower than a tile
        in either orientation, or where it fills at most one wave: cuBLAS then runs smaller tiles (64-wide, or K
        split over blocks) to fill the SMs, which the table does not give, and the smooth curve alone prices it.
        The GEMM's efficiency is the smaller of this and the curve: the curve, fitted to large square GEMMs whose
        waves are nearly full (8192^3 on an A100: 2048 tiles, 19 waves, 99.8% busy), prices the average losses,
        and the bound binds only where the waves leave more idle than the curve charges."""
        if not (self.sms and curve.tile and m > 0 and n > 0 and k > 0):
            return curve.max_eff
        tm, tn = curve.tile
        if not ((m >= tm and n >= tn) or (m >= tn and n >= tm)):
            return curve.max_eff
        waves = min(math.ceil(math.ceil(m / a) * math.ceil(n / b) / self.sms) for a, b in ((tm, tn), (tn, tm)))
        if waves < 2:
            return curve.max_eff
        return curve.max_eff * k / (k + curve.half) * m * n / (waves * self.sms * tm * tn)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for kind in ("matmul", "attention"):
            out[kind] = {
                d: {"max_eff": c.max_eff, "half": c.half, **({"tile": list(c.tile)} if c.tile else {})}
                for d, c in getattr(self, kind).items()
            }
        out.update(vector_eff=self.vector_eff, bandwidth_eff=self.bandwidth_eff, launch_seconds=self.launch_seconds)
        if self.sms is not None:
            out["sms"] = self.sms
        if self.memory_bandwidth is not None:
            out["memory_bandwidth"] = self.memory_bandwidth
        if self.cache_bandwidth is not None:
            out.update(cache_bandwidth=self.cache_bandwidth, cache_bytes=self.cache_bytes)
        if self.rates:
            out["rates"] = dict(self.rates)
        out["sources"] = dict(self.sources)
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _curves(name: str, data: Any, what: str) -> dict[str, Curve]:
    if not isinstance(data, dict) or not data:
        raise ClusterSpecError(f"device table {name!r}: {what} must map dtypes to {{max_eff, half}}")
    out = {}
    for dtype, c in data.items():
        try:
            curve = Curve(float(c["max_eff"]), float(c["half"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterSpecError(f"device table {name!r}: {what}.{dtype} needs numbers max_eff and half ({e})") from e
        if not (0 < curve.max_eff <= 1 and curve.half >= 0):
            raise ClusterSpecError(
                f"device table {name!r}: {what}.{dtype} has max_eff {curve.max_eff} (give 0 < max_eff <= 1) "
                f"and half {curve.half} (give half >= 0)"
            )
        if c.get("tile") is not None:
            tile = c["tile"]
            if what != "matmul" or not (
                isinstance(tile, (list, tuple)) and len(tile) == 2 and all(isinstance(x, int) and x > 0 for x in tile)
            ):
                raise ClusterSpecError(
                    f"device table {name!r}: {what}.{dtype} has tile {tile!r}: a matmul curve's tile is two positive "
                    "integers, the output rows and columns one thread block computes (e.g. tile: [256, 128]); an "
                    "attention curve has none"
                )
            curve = replace(curve, tile=(tile[0], tile[1]))
        out[str(dtype)] = curve
    return out


def table_from_dict(data: dict[str, Any]) -> DeviceTable:
    name = str(data.get("name", "custom"))
    try:
        vector, bw, launch = float(data["vector_eff"]), float(data["bandwidth_eff"]), float(data["launch_seconds"])
    except (KeyError, TypeError, ValueError) as e:
        raise ClusterSpecError(
            f"device table {name!r} needs numbers vector_eff, bandwidth_eff, launch_seconds ({e})"
        ) from e
    if not (0 < vector <= 1 and 0 < bw <= 1 and launch >= 0):
        raise ClusterSpecError(f"device table {name!r}: vector_eff and bandwidth_eff are fractions in (0, 1]")
    mbw = data.get("memory_bandwidth")
    cache_bw, cache_bytes = data.get("cache_bandwidth"), data.get("cache_bytes", 0.0)
    try:
        cache_bw, cache_bytes = (None if cache_bw is None else float(cache_bw)), float(cache_bytes)
    except (TypeError, ValueError) as e:
        raise ClusterSpecError(f"device table {name!r}: cache_bandwidth and cache_bytes must be numbers ({e})") from e
    if (cache_bw is not None and cache_bw <= 0) or cache_bytes < 0:
        raise ClusterSpecError(
            f"device table {name!r}: cache_bandwidth must be positive (bytes/s) and cache_bytes at least 0; give "
            "neither for no cache term"
        )
    rates = data.get("rates") or {}
    try:
        rates = {str(k): float(v) for k, v in rates.items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise ClusterSpecError(f"device table {name!r}: rates must map op classes to FLOP/s ({e})") from e
    unknown = set(rates) - set(RATE_CLASSES.values())
    if unknown or any(v <= 0 for v in rates.values()):
        raise ClusterSpecError(
            f"device table {name!r}: rates gives positive FLOP/s per op class, one of "
            f"{', '.join(sorted(set(RATE_CLASSES.values())))}; got {rates}"
        )
    sms = data.get("sms")
    if sms is not None and not (isinstance(sms, int) and not isinstance(sms, bool) and sms > 0):
        raise ClusterSpecError(
            f"device table {name!r}: sms is {sms!r}: give the GPU's streaming multiprocessors as a positive integer "
            "(an A100 has 108), or none for no wave quantization"
        )
    return DeviceTable(
        name,
        _curves(name, data.get("matmul"), "matmul"),
        _curves(name, data.get("attention"), "attention"),
        vector,
        bw,
        launch,
        None if mbw is None else float(mbw),
        {str(k): str(v) for k, v in (data.get("sources") or {}).items()},
        cache_bw,
        cache_bytes,
        rates,
        sms,
    )


def load_table(device: str) -> DeviceTable:
    """The table of a device kind (``a100``: ``solver/cluster/devices/a100.yaml``) or of a YAML file."""
    path = Path(device) if device.endswith((".yaml", ".yml")) else DEVICE_DIR / f"{device}.yaml"
    return _read_table(os.fspath(path), path.stat().st_mtime_ns if path.is_file() else 0, device)


@functools.cache
def _read_table(file: str, mtime: int, device: str) -> DeviceTable:
    path = Path(file)
    if not mtime:
        kinds = ", ".join(list_devices())
        raise ClusterSpecError(
            f"unknown device kind {device!r}: give one of {kinds}, or a device table file (.yaml) that "
            "`autopar calibrate` wrote"
        )
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ClusterSpecError(f"device table {os.fspath(path)!r} is not a mapping of fields")
    return table_from_dict(data)


def list_devices() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class Device:
    """What ``seconds`` prices on: a cluster spec's peaks and bandwidth with its device kind's table."""

    peak_flops: dict[str, float]
    memory_bandwidth: float | None
    table: DeviceTable
    efficiency: float | None = None  # a spec's constant fraction of peak, replacing the matmul/attention curves

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.peak_flops.items())), self.memory_bandwidth, self.table.name, self.efficiency))

    def peak(self, dtype: str) -> float:
        found = self.peak_flops.get(DTYPES.get(str(dtype).removeprefix("torch."), str(dtype)))
        if not found:
            raise ClusterSpecError(
                f"no peak_flops entry for {dtype}: the cluster spec has {', '.join(sorted(self.peak_flops))}; "
                "add one (e.g. peak_flops: {bf16: 312 TFLOP/s}) or train in a precision it has"
            )
        return found


def device_of(cluster: Any, efficiency: float | None = None) -> Device:
    """The ``Device`` of a ``ClusterSpec``: its ``device`` kind's table (``generic`` when it names none); a
    constant ``efficiency`` (else the spec's own, if it has one) replaces the matmul and attention curves."""
    table = load_table(cluster.device or "generic")
    bandwidth = cluster.memory_bandwidth or table.memory_bandwidth
    return Device(
        dict(cluster.peak_flops), bandwidth, table, efficiency if efficiency is not None else cluster.efficiency
    )


def efficiency(work: Work, device: Device) -> float:
    """The fraction of peak ``work``'s FLOPs run at on ``device``."""
    if device.efficiency is not None and work.kind != "elementwise":
        return device.efficiency
    return device.table.efficiency(work)


def seconds(work: Work, device: Device) -> float:
    """Forward seconds of ``work`` on ``device`` (the module docstring): the slower of its FLOPs at the op
    class's efficiency and its bytes at the streaming bandwidth, plus a launch per kernel. FLOPs of a class the
    device table has a rate for (``Work.rated``) run at that rate, never faster than the vector rate: a fused
    kernel's compute is its members' FLOPs each at its own rate, summed (a kernel is bound by its transcendental
    math as the op alone is), so it is never above its ops' compute op by op."""
    if not work.flops and not work.bytes:
        return 0.0
    if work.kind == "attention_unfused":
        return _unfused_attention(work, device)
    vector = device.peak(work.dtype) * efficiency(work, device)
    t = work.flops / vector if work.flops else 0.0
    rates = device.table.rates
    slow = [(part * work.flops, rates[c]) for c, part in work.rated if c in rates and part] if work.flops else []
    if slow:  # the rated FLOPs at their class's measured rate, the rest at the vector rate
        t = sum(max(f / vector, f / r) for f, r in slow) + (work.flops - sum(f for f, _ in slow)) / vector
    if work.bytes and device.memory_bandwidth:
        t = max(t, device.table.stream_seconds(work.bytes, device.memory_bandwidth))
    return work.share * (t + work.ops * device.table.launch_seconds)


ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
# Unfused attention as Megatron-LM of 2021 runs it (megatron/model/transformer.py, ParallelAttention): QK^T (baddbmm)
# writes the m x n scores and PV (bmm) reads them, inside those matmuls (priced by their roofline, the scores among
# their bytes); between them the fused scale-mask-softmax reads and writes them and the attention dropout reads and
# writes them and writes a one-byte mask: 4 passes of the scores at the compute dtype, plus the mask
UNFUSED_PASSES = 4
# and backward: the dropout's (dP read, with the mask, and written) and the softmax's (its output and dP read, dS
# written); the four gradient matmuls read or write one score-sized operand each (dP = dO V^T, dV = P^T dO,
# dQ = dS K, dK = dS^T Q)
UNFUSED_BACKWARD_PASSES = 5
UNFUSED_MASK_BYTES = 1  # the dropout mask, per score (torch.bool), written forward, read backward
# what the backward needs of them, kept per score: the softmax output, the dropout mask and the dropped
# probabilities PV read (Korthikanti et al. 2022, Sec. 4.1: 5 a s^2 b bytes per layer at 16-bit)
UNFUSED_SAVED = 2  # score-sized tensors at the compute dtype, plus the mask


def unfused_saved_bytes(dtype: str) -> float:
    """Bytes unfused attention keeps for the backward per element of its m x n scores (5 at 16-bit)."""
    return UNFUSED_SAVED * ITEMSIZE.get(dtype, 4) + UNFUSED_MASK_BYTES


def _unfused_attention(work: Work, device: Device, backward: bool = False) -> float:
    """Attention without a fused kernel (Megatron-LM of 2021, eager PyTorch's math path): QK^T and PV as two batched
    matmuls [m, k] x [k, n] and [m, n] x [n, k] (backward: four, of the same shapes), each moving its operands and
    one m x n score-sized tensor (self-attention: keys and values as many rows as queries), and the softmax and the
    dropout between them moving the scores ``UNFUSED_PASSES`` (backward ``UNFUSED_BACKWARD_PASSES``) times plus the
    dropout mask, one kernel each."""
    size = ITEMSIZE.get(work.dtype, 4)
    half, mn, mk = work.flops / 2, work.m * work.n, work.m * work.k
    qk = seconds(Work("matmul", half, float((mn + 2 * mk) * size), work.m, work.n, work.k, work.dtype), device)
    pv = seconds(Work("matmul", half, float((mn + 2 * mk) * size), work.m, work.k, work.n, work.dtype), device)
    passes = UNFUSED_BACKWARD_PASSES if backward else UNFUSED_PASSES
    scores = mn * (size * passes + UNFUSED_MASK_BYTES)
    return (2 if backward else 1) * (qk + pv) + seconds(
        Work("elementwise", 0.0, float(scores), dtype=work.dtype, ops=2), device
    )


def gradient_works(work: Work) -> tuple[Work, Work]:
    """The two matmuls of a matmul's backward: [m, n] x [n, k], the first operand's gradient (output m x k), and
    [k, m] x [m, n], the second operand's (a weight's: output k x n), each with the forward's FLOPs, bytes (each
    reads two of the three tensors' sizes and writes the third) and launches. The smooth curve prices all three
    alike (it is symmetric in m, n, k); the wave bound quantizes each one's own output."""
    return replace(work, n=work.k, k=work.n), replace(work, m=work.k, k=work.m)


def backward_seconds(work: Work, device: Device) -> float:
    """Backward seconds of ``work``: a matmul's two gradient matmuls (``gradient_works``: twice its forward where
    no wave bound tells them apart), an elementwise op's twice its forward (its backward moves about twice its
    bytes), and unfused attention's four gradient matmuls (each priced at its forward's shape: the batch folded into
    m leaves a batched matmul's gradient shapes unknown) with its softmax and dropout moving the scores
    ``UNFUSED_BACKWARD_PASSES`` times (not twice ``UNFUSED_PASSES``)."""
    if work.kind == "attention_unfused" and (work.flops or work.bytes):
        return _unfused_attention(work, device, backward=True)
    if work.kind == "matmul":
        return sum(seconds(w, device) for w in gradient_works(work))
    return 2 * seconds(work, device)


def weight_grad_seconds(work: Work, device: Device) -> float:
    """Seconds of the gradient of a matmul's second operand (its weight; ``gradient_works``), the part of its
    backward a zero-bubble schedule defers and a tensor-parallel all-reduce hides behind; half the backward of any
    other op."""
    if work.kind == "matmul":
        return seconds(gradient_works(work)[1], device)
    return backward_seconds(work, device) / 2


def train_seconds(work: Work, device: Device) -> float:
    """Forward plus backward seconds of ``work`` (three forwards where neither the wave bound nor unfused attention's
    scores tell the backward apart): what the sharding ILP and the stage balancer charge an op."""
    return seconds(work, device) + backward_seconds(work, device)


def flop_seconds(flops: float, device: Device, dtype: str = "bf16", m: int = 0, n: int = 0, k: int = 0) -> float:
    """Forward seconds of ``flops`` of matmul work (of shape m, n, k where known: else at the curve's
    saturated efficiency): what a cost term that knows only FLOPs (ring attention's blocks, an expert's
    GEMMs) calls."""
    return seconds(Work("matmul", flops, 0.0, m, n, k, dtype, ops=0), device)


# -- an IR op's work ----------------------------------------------------------------------------------

# elementwise ops priced at a measured rate of their class where the device table has one (``DeviceTable.rates``)
RATE_CLASSES = {
    **dict.fromkeys(
        ("aten.gelu", "aten.silu", "aten.sigmoid", "aten.tanh", "aten.erf", "aten.exp", "aten.mish"), "transcendental"
    ),
    **dict.fromkeys(
        ("aten.softmax.int", "aten._softmax", "aten.log_softmax.int", "aten._log_softmax", "aten.cross_entropy_loss"),
        "softmax",
    ),
}
MATMULS = frozenset({"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm", "aten.baddbmm"})
GROUPED = frozenset({"aten._grouped_mm", "transformers.grouped_mm_fallback"})
ATTENTION = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention"})
CONVOLUTIONS = frozenset({"aten.convolution", "aten.conv2d"})


def op_work(op: Any, types: dict[str, Any], dtype: str, attention: str = "fused") -> Work:
    """The forward ``Work`` of an IR op (global shapes), computing in ``dtype``, with ``attention`` "fused" (a
    FlashAttention-style kernel) or "unfused" (the scores materialized): matmuls and convolutions by
    their [m, k] x [k, n] shape, fused attention by its shape, everything else by the bytes it moves
    (``op.flops`` from ``passes/lower.py``'s ``annotate_costs``; its bytes from ``types``, global, as
    ``annotate_costs`` counts them but floats at ``dtype``'s size, so that a program and its rewrites price an op
    the same)."""
    t, flops = op.target, float(op.flops)
    if t in VIEW_OPS:  # a view moves nothing and launches nothing
        return Work("elementwise", 0.0, 0.0, dtype=dtype, ops=0)
    ins = [types[r.name] for r in op.input_refs()]
    size = ITEMSIZE.get(dtype, 4)  # floats move in the compute dtype (activations are bf16 in mixed precision)
    nbytes = float(sum(x.numel * size if x.is_float else x.nbytes for x in [*ins, *op.types]))
    out = op.types[0] if op.types else None
    try:
        if t in MATMULS or t in GROUPED:
            a, b = (ins[1], ins[2]) if t in ("aten.addmm", "aten.baddbmm") else (ins[0], ins[1])
            k = a.shape[-1]
            n = b.shape[0] if t == "aten.linear" else out.shape[-1]
            m = max(1, out.numel // max(n, 1))
            return Work("matmul", flops, nbytes, m, n, k, dtype)
        if t in CONVOLUTIONS:
            w = ins[1]
            k = math.prod(w.shape[1:])
            n = w.shape[0]
            return Work("matmul", flops, nbytes, max(1, out.numel // max(n, 1)), n, k, dtype)
        if t in ATTENTION:
            q, key = ins[0], ins[1]
            kind = "attention" if attention == "fused" else "attention_unfused"
            return Work(kind, flops, nbytes, math.prod(q.shape[:-1]), key.shape[-2], q.shape[-1], dtype)
    except (AttributeError, IndexError, TypeError):  # an unexpected signature: priced by its bytes
        pass
    rated = ((RATE_CLASSES[t], 1.0),) if t in RATE_CLASSES else ()
    return Work("elementwise", flops, nbytes, dtype=dtype, rated=rated)


def compiled_works(ops: Any, types: dict[str, Any], dtype: str, attention: str = "fused") -> list[Work]:
    """The works of ``ops`` (a program's ops, or a run of them, in order) as torch.compile's Inductor runs them
    (``torch_compile=True``): a matmul, convolution or attention stays one kernel, priced as ``op_work`` prices
    it, and so does an op not of ATen (a collective, a custom op); the other ops of a run between two such
    kernels fuse, each connected group of them (values flowing from one to another) one kernel: its FLOPs
    summed, one launch, and its bytes those of the values it reads from outside the group and of the values it
    writes for a reader after the run (or for none in ``ops``: an output), each counted once; its
    intermediates stay in registers. Its members' FLOPs of a rate class (``RATE_CLASSES``: gelu, softmax, ...)
    are its ``Work.rated``, so that ``seconds`` prices them at their class's rate where the device table has one
    (a kernel with a gelu in it is bound by the gelu's math, fused or not). Views are free, as in ``op_work``:
    reading a view reads what it views. Never more bytes, launches or FLOPs of a class than ``op_work`` op by
    op."""
    return [w for w, _ in _compiled_kernels(list(ops), types, dtype, attention)]


def compiled_shares(ops: Any, types: dict[str, Any], dtype: str, attention: str = "fused") -> list[Work]:
    """One ``Work`` per op of ``ops``: its share of the kernel ``compiled_works`` runs it in, so that a caller that
    prices op by op (the sharding ILP, the search's units, the stage balancer's subgraphs) prices a compiled
    program as ``compiled_works`` does. A kernel of its own (a matmul, attention, a collective) is the op's
    ``op_work``; a fused group's kernel is shared among its ops in proportion to the bytes each moves op by op
    (its FLOPs where none moves bytes, else equally): each op's work is the kernel's with ``Work.share`` its
    fraction, so that ``seconds`` of the shares adds up to the kernel's and the shares of ops a caller divides
    alike divide as the kernel does. A view's share is nothing."""
    ops = list(ops)
    out = [Work("elementwise", 0.0, 0.0, dtype=dtype, ops=0) for _ in ops]
    for work, members in _compiled_kernels(ops, types, dtype, attention):
        if (len(members) == 1 and work.kind != "elementwise") or not str(ops[members[0]].target).startswith("aten."):
            out[members[0]] = work
            continue
        eager = [op_work(ops[i], types, dtype, attention) for i in members]
        weights = [w.bytes for w in eager]
        if not sum(weights):
            weights = [w.flops for w in eager]
        if not sum(weights):
            weights = [1.0] * len(members)
        total = sum(weights)
        for i, wt in zip(members, weights):
            out[i] = replace(work, share=wt / total)
    return out


def _compiled_kernels(
    ops: list[Any], types: dict[str, Any], dtype: str, attention: str
) -> list[tuple[Work, list[int]]]:
    """``compiled_works``' kernels, each with the positions in ``ops`` of the (non-view) ops it runs."""
    size = ITEMSIZE.get(dtype, 4)
    last_reader: dict[str, int] = {}
    for i, op in enumerate(ops):
        for r in op.input_refs():
            last_reader[r.name] = i

    def nbytes(name: str) -> float:
        t = types[name]
        return float(t.numel * size if t.is_float else t.nbytes)

    out: list[tuple[Work, list[int]]] = []
    run: list[int] = []  # the fusible ops since the last kernel of its own

    def close() -> None:
        if not run:
            return
        end = run[-1]
        group: dict[str, int] = {}  # a result of the run -> its group (union-find over the run's ops)
        parent = list(range(len(run)))

        def find(g: int) -> int:
            while parent[g] != g:
                parent[g] = parent[parent[g]]
                g = parent[g]
            return g

        source: dict[str, str] = {}  # a view's result -> the value it views (through views)
        for g, i in enumerate(run):
            op = ops[i]
            ins = [r.name for r in op.input_refs()]
            for n in ins:
                if n in group:
                    parent[find(group[n])] = g
            for r in op.results:
                group[r] = g
                if op.target in VIEW_OPS and ins:
                    source[r] = source.get(ins[0], ins[0])
        kernels: dict[int, list[int]] = {}
        for g, i in enumerate(run):
            kernels.setdefault(find(g), []).append(i)
        for idx in kernels.values():
            made = {r for i in idx if ops[i].target not in VIEW_OPS for r in ops[i].results}
            read: set[str] = set()
            written: set[str] = set()
            flops, members = 0.0, []
            rated: dict[str, float] = {}  # a rate class -> its members' FLOPs
            for i in idx:
                op = ops[i]
                for r in op.results:  # read after the run or never in ``ops``: written (a view: what it views)
                    if last_reader.get(r, len(ops)) > end:
                        v = source.get(r, r)
                        if v in made:
                            written.add(v)
                if op.target in VIEW_OPS:
                    continue
                members.append(i)
                flops += float(op.flops)
                if op.target in RATE_CLASSES:
                    c = RATE_CLASSES[op.target]
                    rated[c] = rated.get(c, 0.0) + float(op.flops)
                for r in op.input_refs():
                    if source.get(r.name, r.name) not in made:
                        read.add(r.name)  # an outside value (or a view of one, at the view's size)
            if members:
                moved = sum(nbytes(n) for n in read | written)
                mix = tuple((c, f / flops) for c, f in sorted(rated.items()) if f) if flops else ()
                out.append((Work("elementwise", flops, moved, dtype=dtype, ops=1, rated=mix), members))
        run.clear()

    for i, op in enumerate(ops):
        work = op_work(op, types, dtype, attention)
        if work.kind == "elementwise" and str(op.target).startswith("aten."):  # a collective or custom op: alone
            run.append(i)
            continue
        close()
        if op.target not in VIEW_OPS:
            out.append((work, [i]))
    close()
    return out


__all__ = [
    "Curve",
    "backward_seconds",
    "Device",
    "DeviceTable",
    "Work",
    "compiled_shares",
    "compiled_works",
    "device_of",
    "efficiency",
    "flop_seconds",
    "list_devices",
    "load_table",
    "op_work",
    "seconds",
    "table_from_dict",
    "gradient_works",
    "train_seconds",
    "unfused_saved_bytes",
    "weight_grad_seconds",
]
