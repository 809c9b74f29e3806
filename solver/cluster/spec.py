"""Describe a cluster (nodes, devices, memory, FLOP/s, links) and price collectives on it (alpha-beta).

A ``ClusterSpec`` is read from YAML or JSON (see ``docs/cluster_spec.md``) or from a preset in
``solver/cluster/presets/NAME.yaml``, optionally with overrides: ``ClusterSpec.load("dgx-a100:nodes=128")``.
Units are bytes, bytes/s, seconds and FLOP/s; files may also write ``80GiB``, ``200Gb/s`` (bits),
``25GB/s`` (bytes), ``5us`` and ``312 TFLOP/s``. Bandwidths are *per device*: what one rank can
push over the link while every rank of its node communicates at once (for an inter-node link, the
node's NIC bandwidth divided among the devices that share it).

Collective costs (``collective_seconds``) follow the ring alpha-beta model. For a group of n
ranks, a link with latency a (seconds per step) and bandwidth b (bytes/s), and B bytes:

    kind            time                             B is
    all_reduce      2 (n-1)/n * B/b  +  2 (n-1) a    the tensor each rank holds (reduce-scatter + all-gather)
    all_gather        (n-1)/n * B/b  +    (n-1) a    the gathered output (each rank contributes B/n)
    reduce_scatter    (n-1)/n * B/b  +    (n-1) a    the full input each rank holds (each keeps B/n)
    all_to_all        (n-1)/n * B/b  +    (n-1) a    each rank's send buffer (it keeps 1/n of it)
    send / recv               B/b    +          a    the message (point to point, n ignored)

A group of one rank, or zero bytes, costs nothing. ``intra_node`` picks the NVLink/PCIe link or
the inter-node network. A group that spans nodes runs as NCCL runs it, hierarchically: with ``per_node``
of its ranks in each node, NCCL builds ``per_node`` channels (rings), each leaving a node once through its
own rail (the NIC of one of those ranks), so the node's share of the network carrying the group is
``per_node`` x the per-device ``inter_node_bandwidth``, capped by the intra-node link the rings also cross:

    bandwidth = min(intra_node_bandwidth, per_node x inter_node_bandwidth),  latency: the inter-node one

(one rank per node, a tensor-parallel group's dp peers: the per-device inter-node link, as before).

ZeRO-3's unit gathers and reduce-scatters over a group spanning nodes can run hierarchically (MiCS Sec. 3.3;
``runtime/grads/node_gather.py``): for n ranks on n/k nodes of k, an all-gather among the n/k nodes through the k
rails, then one inside the node, the reduce-scatter mirrored (``hierarchical=True``, ``gathers_hierarchically``):

    time = (n/k - 1)/(n/k) * B/b_rails + (n/k - 1) a_inter  +  (k-1)/k * B/b_intra + (k-1) a_intra

(the inter-node volume (n-k)/n of B where the flat ring's is (n-1)/n; on one node, or one rank per node, the flat ring).
The two steps pay only where the rails are slow beside the node's link: per byte they cost less than the flat ring
iff (n/k) x b_rails < b_intra (MiCS's p3dn, 8 GPUs behind one 100 Gb/s NIC: yes; a DGX A100's 8 x 200 Gb/s rails
near NVSwitch: no, 1.11-1.23x the ring). A plan runs them only where ``hierarchical_pays`` says so
(``TrainingSetup.hierarchical_gather``), and every price model prices what the plan runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autopar.errors import ClusterSpecError
from autopar.solver.cluster.fields import COLLECTIVES, DTYPES, check_fields, parse_overrides, read_file

__all__ = ["ClusterSpec", "COLLECTIVES", "calibration_file", "list_clusters", "local_cluster"]

PRESET_DIR = Path(__file__).parent / "presets"
RESERVE_FIXED = 2**30  # the CUDA context and NCCL's buffers: about 1 GiB per device
RESERVE_FRACTION = 0.05  # the caching allocator's fragmentation: about 5% of the device


def default_memory_reserve(device_memory: int) -> int:
    """The bytes per device a plan leaves free by default: 1 GiB (the CUDA context, ~0.5 GiB, and NCCL's
    communicator buffers, ~0.5 GiB) plus 5% of the device memory (fragmentation of the caching allocator),
    at most half the device: 5 GiB of an 80 GiB A100 or H100. A spec's ``memory_reserve`` replaces it."""
    return int(min(RESERVE_FIXED + RESERVE_FRACTION * device_memory, device_memory / 2))


def _file_and_overrides(text: str) -> tuple[Path | None, str]:
    """A spec file and its ``:field=value,...`` overrides (``my.yaml:nodes=128``), or (None, "") for a preset."""
    match = re.fullmatch(r"(.+?\.(?:ya?ml|json))(?::(.*))?", text, flags=re.IGNORECASE)
    if match is not None:
        return Path(match.group(1)), match.group(2) or ""
    return (Path(text), "") if Path(text).is_file() else (None, "")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``nodes`` x ``devices_per_node`` devices and the links between them."""

    name: str
    nodes: int
    devices_per_node: int
    device_memory: int  # bytes per device
    peak_flops: dict[str, float]  # dtype ("fp32", "bf16", "fp16", ...) -> peak FLOP/s per device
    intra_node_bandwidth: float  # bytes/s per device inside a node (NVLink/NVSwitch, PCIe, loopback)
    intra_node_latency: float  # seconds per collective step inside a node
    inter_node_bandwidth: float  # bytes/s per device across nodes (node NIC bandwidth / devices sharing it)
    inter_node_latency: float  # seconds per collective step across nodes
    backend: str = "nccl"  # torch.distributed backend: "nccl" (GPU) or "gloo" (CPU)
    # measured by `autopar calibrate` (optional): per collective kind, (latency s, bandwidth bytes/s) of
    # the intra-node link in the ring model, replacing intra_node_latency/bandwidth for that kind
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    memory_bandwidth: float | None = None  # bytes/s an elementwise kernel streams (None: not priced)
    # a constant fraction of peak_flops every matmul sustains, replacing the device table's curves (None: the
    # curves of ``device``'s table, solver/cluster/compute.py)
    efficiency: float | None = None
    # the device kind whose efficiency table prices compute (solver/cluster/devices/KIND.yaml, or a table file
    # `autopar calibrate` wrote); None: the ``generic`` table
    device: str | None = None
    # bytes per device a plan leaves free: the CUDA context, NCCL's buffers, the allocator's fragmentation
    # (None: the default reserve, ``default_memory_reserve``; 0: plan to the last byte)
    memory_reserve: int | None = None
    description: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # where each number comes from

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "notes", dict(self.notes))
        object.__setattr__(self, "collectives", {k: tuple(v) for k, v in self.collectives.items()})
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency", "inter_node_latency"):
            value = getattr(self, name, None)
            if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
                raise ClusterSpecError(f"cluster {self.name!r}: {name} is {value!r}; give a finite number >= 0")
        for kind, (latency, bandwidth) in self.collectives.items():
            if not (math.isfinite(latency) and math.isfinite(bandwidth) and latency >= 0 and bandwidth > 0):
                raise ClusterSpecError(
                    f"cluster {self.name!r}: collectives.{kind} is (latency {latency!r}, bandwidth {bandwidth!r}); "
                    "give finite numbers (bandwidth > 0)"
                )

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Validate a mapping (units allowed, see the module docstring); errors name the field."""
        return cls(**check_fields(data, [f.name for f in dataclasses.fields(cls)]))

    @classmethod
    def load(cls, source: str | os.PathLike[str]) -> ClusterSpec:
        """Load a YAML/JSON file or a preset name, either with optional overrides (``dgx-a100:nodes=128``,
        ``my.yaml:nodes=128``)."""
        text = os.fspath(source)
        file, overrides = _file_and_overrides(text)
        if file is not None:
            if not file.is_file():
                raise ClusterSpecError(f"cluster spec file {os.fspath(file)!r} does not exist")
            data = read_file(file)
            if overrides:  # my.yaml:nodes=128, as a preset takes them
                data.update(parse_overrides(os.fspath(file), overrides, data))
            return cls.from_dict(data)
        name, _, rest = text.partition(":")
        preset = PRESET_DIR / f"{name}.yaml"
        if not preset.is_file():
            names = sorted(list_clusters())
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ClusterSpecError(
                f"unknown cluster preset {name!r}.{hint} Presets: {', '.join(names)}; "
                "or give a path to a .yaml/.json cluster spec."
            )
        data = read_file(preset)
        data.update(parse_overrides(name, rest, data))
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ClusterSpec:
        """A copy with some fields changed, validated like a loaded spec (units allowed)."""
        return ClusterSpec.from_dict({**self.to_dict(), **changes})

    # -- serialization -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers (bytes, bytes/s, s, FLOP/s): ``from_dict(to_dict())`` gives an equal spec."""
        out = dataclasses.asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        out["collectives"] = {k: {"latency": a, "bandwidth": b} for k, (a, b) in self.collectives.items()}
        for key in ("collectives", "memory_bandwidth", "efficiency", "device", "notes"):
            if not out[key]:
                del out[key]
        if out["memory_reserve"] is None:  # the default reserve
            del out["memory_reserve"]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write YAML or JSON, chosen by the file's suffix."""
        p = Path(path)
        p.write_text(self.to_json() if p.suffix.lower() == ".json" else self.to_yaml())

    # -- queries -----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def reserve_bytes(self) -> int:
        """The bytes per device a plan leaves free: ``memory_reserve``, else ``default_memory_reserve``."""
        return self.memory_reserve if self.memory_reserve is not None else default_memory_reserve(self.device_memory)

    @property
    def plan_memory(self) -> float:
        """The bytes per device a plan may fill by default: the device memory less the reserve."""
        return float(self.device_memory - self.reserve_bytes)

    def default_precision(self) -> str:
        """The compute precision plans are priced in when none is asked: bf16 on a GPU (NCCL) cluster, where
        training runs in it, fp32 on CPUs (gloo). ``autopar plan --mesh`` and the search both use it."""
        return "bf16" if self.backend == "nccl" else "fp32"

    def peak(self, dtype: Any = "bf16") -> float:
        """Peak FLOP/s per device for a dtype name (``bf16``, ``bfloat16``) or a ``torch.dtype``."""
        key = DTYPES.get(str(dtype).removeprefix("torch."))
        if key is None or key not in self.peak_flops:
            raise ClusterSpecError(
                f"cluster {self.name!r} has no peak_flops entry for {dtype!s}; "
                f"it has {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[key]

    def alpha_beta(self, intra: bool, per_node: int = 1) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of the intra-node link, or of the inter-node network seen by a
        group with ``per_node`` ranks in each node (its rails: module doc)."""
        if intra:
            return self.intra_node_latency, self.intra_node_bandwidth
        rails = max(1, min(per_node, self.devices_per_node))
        return self.inter_node_latency, min(self.intra_node_bandwidth, rails * self.inter_node_bandwidth)

    def collective_seconds(
        self, kind: str, nbytes: float, group_size: int, intra_node: bool, per_node: int = 1, hierarchical: bool = False
    ) -> float:
        """Ring alpha-beta seconds of one collective (formulas, meaning of ``nbytes``: module doc); ``hierarchical``:
        an all-gather or reduce-scatter as ZeRO-3's unit collectives run across nodes (module doc)."""
        if kind not in COLLECTIVES:
            close = difflib.get_close_matches(kind, COLLECTIVES, n=2)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown collective {kind!r}{hint} Known: {', '.join(COLLECTIVES)}")
        if group_size < 1 or nbytes < 0:
            raise ValueError(f"{kind}: group_size must be >= 1 and nbytes >= 0, got {group_size}, {nbytes}")
        n = group_size
        if nbytes == 0 or (n == 1 and kind not in ("send", "recv")):
            return 0.0
        if hierarchical and self.gathers_hierarchically(kind, n, intra_node, per_node):
            per_byte, latency = self.collective_terms(kind, n, intra_node, per_node, hierarchical=True)
            return nbytes * per_byte + latency
        kind = self.runs_as(kind)
        lat, bw = self._link(kind, intra_node, per_node)
        if kind in ("send", "recv"):
            return nbytes / bw + lat
        steps = _ring_steps(kind, n)
        return steps / n * nbytes / bw + steps * lat

    def runs_as(self, kind: str) -> str:
        """The collective that runs for ``kind`` on this backend: gloo has no reduce-scatter, and autopar's
        runtime all-reduces and keeps the local slice there (``runtime/comm/pending.py``, ``runtime/grads/zero.py``),
        so a reduce-scatter costs an all-reduce (ZeRO-1/2's gradient sync then costs more than DDP's). Where the
        runtime calls ``dist.reduce_scatter_single`` on gloo (context parallelism's key/value gradients,
        ``pending.bwd_gather_reduce_grad``; ZeRO-3's units) the same runs: torch's ``ProcessGroupGloo::
        _reduce_scatter_base`` is ``reduce_scatter_tensor_coalesced``, which clones the input, all-reduces the
        clone and copies this rank's chunk out (torch 2.13)."""
        return "all_reduce" if kind == "reduce_scatter" and self.backend == "gloo" else kind

    @property
    def overlaps_compute(self) -> bool:
        """Whether a collective in flight runs beside the rank's compute: NCCL's on its own stream; gloo's reduce
        on CPU threads that wait for the rank's compute to yield (BENCHMARKS.md, "Megatron's asynchronous TP
        backward": fused and unfused at parity on 2 ranks of 2 cores)."""
        return self.backend != "gloo"

    def collective_terms(
        self, kind: str, group_size: int, intra_node: bool, per_node: int = 1, hierarchical: bool = False
    ) -> tuple[float, float]:
        """(seconds per byte, latency seconds) of a ring collective of a non-empty tensor, whose time is
        ``nbytes * per_byte + latency``: the cost model prices every tensor of a placement pair with them.
        ``hierarchical``: as ``collective_seconds``'s."""
        n = group_size
        if n == 1:
            return 0.0, 0.0
        if hierarchical and self.gathers_hierarchically(kind, n, intra_node, per_node):
            k = per_node  # among the n / k nodes through the k rails, then inside each node
            across, inside = self.collective_terms(kind, n // k, False, k), self.collective_terms(kind, k, True)
            return across[0] + inside[0], across[1] + inside[1]
        kind = self.runs_as(kind)
        lat, bw = self._link(kind, intra_node, per_node)
        steps = _ring_steps(kind, n)
        return steps / n / bw, steps * lat

    def gathers_hierarchically(self, kind: str, group_size: int, intra_node: bool, per_node: int) -> bool:
        """Whether ZeRO-3's runtime runs a unit's ``kind`` over a group of ``group_size`` ranks, ``per_node`` of them
        in each node, in two steps (``runtime/grads/node_gather.py``): an all-gather or reduce-scatter over a group
        spanning nodes with more than one of its ranks, the same number, in each."""
        k, n = per_node, group_size
        return kind in ("all_gather", "reduce_scatter") and not intra_node and 1 < k < n and n % k == 0

    def hierarchical_pays(self, group_size: int, per_node: int) -> bool:
        """Whether ZeRO-3's unit collectives over a group of ``group_size`` ranks spanning nodes, ``per_node`` of them
        in each, cost less in two steps (``gathers_hierarchically``) than as one flat ring on this cluster: the one
        rule a plan decides ``TrainingSetup.hierarchical_gather`` by (``solver/sharding/options.py:decide_gathers``).

        No byte size is needed: it asks for the two steps to cost less at every size, per byte (strictly) and in
        latency, an all-gather and a reduce-scatter together. The latency never stands in the way on a real cluster
        (n/k - 1 inter-node plus k - 1 intra-node steps against n - 1 inter-node ones), so the answer is the
        bandwidth terms': (n/k) x b_rails < b_intra. Where it is no, the two steps still price faster below a
        crossover size, where a gather is latency-bound (a DGX A100, 16 to 64 ranks on nodes of 8: units under
        44-98 MB, by 63-315 us a gather): the flat ring gives that up so that the decision is never slower than the
        ring at any size, needs no unit size (which the ILP does not know before it solves), holds for every unit of
        every stage, and is priced the same by the ILP (which charges these gathers their bandwidth terms alone)
        and by the search."""
        n, k = group_size, per_node
        if not self.gathers_hierarchically("all_gather", n, False, k):
            return False
        kinds = ("all_gather", "reduce_scatter")
        two = [self.collective_terms(kind, n, False, k, hierarchical=True) for kind in kinds]
        ring = [self.collective_terms(kind, n, False, k) for kind in kinds]
        return sum(t[0] for t in two) < sum(t[0] for t in ring) and sum(t[1] for t in two) <= sum(t[1] for t in ring)

    def _link(self, kind: str, intra_node: bool, per_node: int = 1) -> tuple[float, float]:
        """(latency, bandwidth) a collective of this kind sees: measured for it when calibrated (inside a
        node; ``recv`` as ``send``), else the link's (across nodes: with ``per_node`` rails)."""
        measured = self.collectives.get("send" if kind == "recv" else kind)
        if intra_node and measured is not None:
            return measured
        return self.alpha_beta(intra_node, 1 if kind in ("send", "recv") else per_node)


def _ring_steps(kind: str, n: int) -> int:
    """Ring steps of a collective over n ranks, each moving nbytes / n and paying one latency."""
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def calibration_file(cache_dir: str | os.PathLike[str], backend: str) -> Path:
    """Where ``autopar calibrate --save`` keeps this machine's measured spec for a backend."""
    return Path(cache_dir) / f"calibration-{backend}.yaml"


def local_cluster(
    backend: str,
    devices: int,
    cache_dir: str | os.PathLike[str] | None = None,
    device_memory: int | None = None,
) -> ClusterSpec:
    """This machine as one node of ``devices`` processes on ``backend``: the calibration saved in
    ``cache_dir`` when there is one, else the ``local-cpu`` (gloo) or ``local-gpu`` (nccl) preset.
    ``device_memory`` (a GPU's memory) replaces the spec's; on CPU the host memory is shared evenly."""
    if backend not in ("gloo", "nccl"):
        raise ClusterSpecError(f"no local cluster description for backend {backend!r}; use gloo or nccl")
    saved = calibration_file(cache_dir, backend) if cache_dir is not None else None
    if saved is not None and saved.is_file():
        spec = ClusterSpec.load(saved)
    else:
        spec = ClusterSpec.load("local-cpu" if backend == "gloo" else "local-gpu")
    if device_memory is None:
        # CPU processes share the host: what one of ``devices`` gets
        device_memory = spec.device_memory * spec.devices_per_node // devices
    return spec.replace(nodes=1, devices_per_node=devices, device_memory=device_memory)


def list_clusters() -> dict[str, str]:
    """Preset name -> its one-line description, from ``solver/cluster/presets/*.yaml``."""
    out = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        out[path.stem] = str(data.get("description", ""))
    return out
