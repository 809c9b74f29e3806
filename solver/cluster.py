"""Describe a cluster (nodes, devices, memory, FLOP/s, links) and price collectives on it (alpha-beta).

A ``ClusterSpec`` is read from YAML or JSON (see ``docs/cluster_spec.md``) or from a preset in
``solver/clusters/NAME.yaml``, optionally with overrides: ``ClusterSpec.load("dgx-a100:nodes=128")``.
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
the inter-node network; a group that spans nodes is priced on the inter-node link (its bottleneck).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autopar.errors import ClusterSpecError

__all__ = [
    "ClusterSpec",
    "COLLECTIVES",
    "calibration_file",
    "list_clusters",
    "local_cluster",
    "parse_bytes",
    "parse_rate",
    "parse_seconds",
]

PRESET_DIR = Path(__file__).parent / "clusters"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")
# dtype names a peak_flops table may use, with the spellings that map onto them
_DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
    "int8": "int8",
}
_LOCAL_CPU_FALLBACK_BYTES = 24 * 10**9  # conservative host memory when neither psutil nor /proc is there

_BYTE_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_TIME_DIVISORS = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 5us == 5e-6 exactly
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


# ----------------------------------------------------------------------------------------------------
# Values with units


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def parse_bytes(value: Any) -> int:
    """Bytes from an int or a string like ``80GB`` (10^9) or ``80GiB`` (2^30)."""
    n = _number(value)
    if n is None and isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*([KMGTP]i?)?B", value.strip())
        if m:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2) or ""]
    if n is None:
        raise ValueError(f"{value!r} is not a size in bytes (e.g. 85899345920, 80GiB, 80GB)")
    return int(round(n))


def parse_rate(value: Any) -> float:
    """Bytes/s from a number or a string like ``25GB/s`` (bytes) or ``200Gb/s`` / ``200Gbps`` (bits)."""
    n = _number(value)
    if n is None and isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*([KMGTP]i?)?(B|b)(/s|ps)", value.strip())
        if m:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2) or ""] / (8 if m.group(3) == "b" else 1)
    if n is None:
        raise ValueError(f"{value!r} is not a bandwidth in bytes/s (e.g. 25e9, 25GB/s, 200Gb/s)")
    return n


def parse_seconds(value: Any) -> float:
    """Seconds from a number or a string like ``5us``, ``2 ms`` or ``1e-6s``."""
    n = _number(value)
    if n is None and isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*(s|ms|us|µs|ns)", value.strip())
        if m:
            n = float(m.group(1)) / _TIME_DIVISORS[m.group(2)]
    if n is None:
        raise ValueError(f"{value!r} is not a time in seconds (e.g. 5e-6, 5us, 0.005ms)")
    return n


def _parse_flops(value: Any) -> float:
    n = _number(value)
    if n is None and isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*([KMGTP]?)(?:FLOP/s|FLOPS|flops)?", value.strip())
        if m:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if n is None:
        raise ValueError(f"{value!r} is not a FLOP/s figure (e.g. 312e12, 312 TFLOP/s)")
    return n


def _parse_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None


def _local_memory_bytes() -> int:
    """This machine's physical memory: psutil, else /proc/meminfo, else a conservative 24 GB."""
    try:
        # deferred: psutil is optional
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _LOCAL_CPU_FALLBACK_BYTES


# ----------------------------------------------------------------------------------------------------
# The spec


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
    efficiency: float | None = None  # fraction of peak_flops a step sustains (None: the cost model's default)
    description: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # where each number comes from

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "notes", dict(self.notes))
        object.__setattr__(self, "collectives", {k: tuple(v) for k, v in self.collectives.items()})

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Validate a mapping (units allowed, see the module docstring); errors name the field."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"a cluster spec must be a mapping of fields, got {type(data).__name__}")
        name = str(data.get("name", "custom"))
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ClusterSpecError(f"cluster spec {name!r}: unknown field {key!r}{hint}")
        for key in _REQUIRED:
            if key not in data:
                raise ClusterSpecError(f"cluster spec {name!r} is missing field {key!r} ({_FIELD_HELP[key]})")
        devices = _field(name, "devices_per_node", data, _devices_per_node, positive=True)
        values: dict[str, Any] = {
            "name": name,
            "nodes": _field(name, "nodes", data, _parse_count, positive=True),
            "devices_per_node": devices,
            "device_memory": _field(name, "device_memory", data, lambda v: _device_memory(v, devices), True),
            "peak_flops": _peak_flops(name, data["peak_flops"]),
            "intra_node_bandwidth": _field(name, "intra_node_bandwidth", data, parse_rate, positive=True),
            "intra_node_latency": _field(name, "intra_node_latency", data, parse_seconds, positive=False),
            "inter_node_bandwidth": _field(name, "inter_node_bandwidth", data, parse_rate, positive=True),
            "inter_node_latency": _field(name, "inter_node_latency", data, parse_seconds, positive=False),
            "backend": str(data.get("backend", "nccl")),
            "collectives": _collectives(name, data.get("collectives") or {}),
            "memory_bandwidth": _optional(name, "memory_bandwidth", data, parse_rate),
            "efficiency": _optional(name, "efficiency", data, float),
            "description": str(data.get("description", "")),
            "notes": {str(k): str(v) for k, v in (data.get("notes") or {}).items()},
        }
        if values["efficiency"] is not None and values["efficiency"] > 1:
            raise ClusterSpecError(f"cluster spec {name!r}: field 'efficiency' is a fraction of peak, at most 1")
        if values["backend"] not in ("nccl", "gloo"):
            raise ClusterSpecError(
                f"cluster spec {name!r}: field 'backend' must be nccl or gloo, got {values['backend']!r}"
            )
        return cls(**values)

    @classmethod
    def load(cls, source: str | os.PathLike[str]) -> ClusterSpec:
        """Load a YAML/JSON file, or a preset name with optional overrides (``dgx-a100:nodes=128``)."""
        text = os.fspath(source)
        path = Path(text)
        if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
            if not path.is_file():
                raise ClusterSpecError(f"cluster spec file {text!r} does not exist")
            return cls.from_dict(_read(path))
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
        data = _read(preset)
        data.update(_parse_overrides(name, rest, data))
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
        for key in ("collectives", "memory_bandwidth", "efficiency", "notes"):
            if not out[key]:
                del out[key]
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

    def peak(self, dtype: Any = "bf16") -> float:
        """Peak FLOP/s per device for a dtype name (``bf16``, ``bfloat16``) or a ``torch.dtype``."""
        key = _DTYPES.get(str(dtype).removeprefix("torch."))
        if key is None or key not in self.peak_flops:
            raise ClusterSpecError(
                f"cluster {self.name!r} has no peak_flops entry for {dtype!s}; "
                f"it has {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[key]

    def alpha_beta(self, intra: bool) -> tuple[float, float]:
        """(latency in s, bandwidth in bytes/s) of the intra-node or the inter-node link."""
        if intra:
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, self.inter_node_bandwidth

    def collective_seconds(self, kind: str, nbytes: float, group_size: int, intra_node: bool) -> float:
        """Ring alpha-beta seconds of one collective (formulas, meaning of ``nbytes``: module doc)."""
        if kind not in COLLECTIVES:
            close = difflib.get_close_matches(kind, COLLECTIVES, n=2)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown collective {kind!r}{hint} Known: {', '.join(COLLECTIVES)}")
        if group_size < 1 or nbytes < 0:
            raise ValueError(f"{kind}: group_size must be >= 1 and nbytes >= 0, got {group_size}, {nbytes}")
        n = group_size
        if nbytes == 0 or (n == 1 and kind not in ("send", "recv")):
            return 0.0
        lat, bw = self._link(kind, intra_node)
        if kind in ("send", "recv"):
            return nbytes / bw + lat
        steps = _ring_steps(kind, n)
        return steps / n * nbytes / bw + steps * lat

    def collective_terms(self, kind: str, group_size: int, intra_node: bool) -> tuple[float, float]:
        """(seconds per byte, latency seconds) of a ring collective of a non-empty tensor, whose time is
        ``nbytes * per_byte + latency``: the cost model prices every tensor of a placement pair with them."""
        n = group_size
        if n == 1:
            return 0.0, 0.0
        lat, bw = self._link(kind, intra_node)
        steps = _ring_steps(kind, n)
        return steps / n / bw, steps * lat

    def _link(self, kind: str, intra_node: bool) -> tuple[float, float]:
        """(latency, bandwidth) a collective of this kind sees: measured for it when calibrated (inside a
        node; ``recv`` as ``send``), else the link's."""
        measured = self.collectives.get("send" if kind == "recv" else kind)
        if intra_node and measured is not None:
            return measured
        return self.alpha_beta(intra_node)


def _ring_steps(kind: str, n: int) -> int:
    """Ring steps of a collective over n ranks, each moving nbytes / n and paying one latency."""
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


# ----------------------------------------------------------------------------------------------------
# Field validation


_REQUIRED = (
    "nodes",
    "devices_per_node",
    "device_memory",
    "peak_flops",
    "intra_node_bandwidth",
    "intra_node_latency",
    "inter_node_bandwidth",
    "inter_node_latency",
)
_FIELD_HELP = {
    "nodes": "number of nodes, a positive integer",
    "devices_per_node": "accelerators (or processes) per node, a positive integer",
    "device_memory": "bytes per device, e.g. 80GiB",
    "peak_flops": "a mapping dtype -> FLOP/s per device with fp32 and bf16 or fp16, e.g. {bf16: 312e12}",
    "intra_node_bandwidth": "bytes/s per device inside a node, e.g. 230GB/s",
    "intra_node_latency": "seconds per step inside a node, e.g. 3us",
    "inter_node_bandwidth": "bytes/s per device across nodes, e.g. 25GB/s or 200Gb/s",
    "inter_node_latency": "seconds per step across nodes, e.g. 6us",
}


def _field(spec: str, key: str, data: Mapping[str, Any], parse: Any, positive: bool) -> Any:
    raw = data[key]
    try:
        value = parse(raw)
    except ValueError as e:
        raise ClusterSpecError(
            f"cluster spec {spec!r}: field {key!r} has the wrong type: {e}; expected {_FIELD_HELP[key]}"
        ) from None
    if value < 0 or (positive and value == 0):
        sign = "positive" if positive else "non-negative"
        raise ClusterSpecError(f"cluster spec {spec!r}: field {key!r} must be {sign}, got {raw!r}")
    return value


def _optional(spec: str, key: str, data: Mapping[str, Any], parse: Any) -> float | None:
    if data.get(key) is None:
        return None
    try:
        value = float(parse(data[key]))
    except (TypeError, ValueError) as e:
        raise ClusterSpecError(f"cluster spec {spec!r}: field {key!r} has the wrong type: {e}") from None
    if value <= 0:
        raise ClusterSpecError(f"cluster spec {spec!r}: field {key!r} must be positive, got {data[key]!r}")
    return value


def _collectives(spec: str, raw: Any) -> dict[str, tuple[float, float]]:
    """``{all_reduce: {latency: 50us, bandwidth: 1GB/s}, ...}`` -> kind -> (seconds, bytes/s)."""
    if not isinstance(raw, Mapping):
        raise ClusterSpecError(
            f"cluster spec {spec!r}: field 'collectives' must map a collective to {{latency, bandwidth}}"
        )
    out = {}
    for kind, entry in raw.items():
        if kind not in COLLECTIVES:
            raise ClusterSpecError(
                f"cluster spec {spec!r}: unknown collective {kind!r} in 'collectives'; known: {', '.join(COLLECTIVES)}"
            )
        if not isinstance(entry, Mapping) or set(entry) != {"latency", "bandwidth"}:
            raise ClusterSpecError(f"cluster spec {spec!r}: collectives.{kind} needs exactly latency and bandwidth")
        try:
            lat, bw = parse_seconds(entry["latency"]), parse_rate(entry["bandwidth"])
        except ValueError as e:
            raise ClusterSpecError(f"cluster spec {spec!r}: collectives.{kind}: {e}") from None
        if lat < 0 or bw <= 0:
            raise ClusterSpecError(f"cluster spec {spec!r}: collectives.{kind} needs latency >= 0 and bandwidth > 0")
        out[str(kind)] = (lat, bw)
    return out


def _devices_per_node(value: Any) -> int:
    """``auto``: the local world size torchrun announces, else 4 processes."""
    if value == "auto":
        return int(os.environ.get("LOCAL_WORLD_SIZE", 4))
    return _parse_count(value)


def _device_memory(value: Any, devices: int) -> int:
    """``auto``: this machine's memory shared evenly by its processes (for CPU/gloo runs)."""
    if value == "auto":
        return _local_memory_bytes() // devices
    return parse_bytes(value)


def _peak_flops(spec: str, raw: Any) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        raise ClusterSpecError(
            f"cluster spec {spec!r}: field 'peak_flops' has the wrong type "
            f"({type(raw).__name__}); expected {_FIELD_HELP['peak_flops']}"
        )
    out: dict[str, float] = {}
    for key, value in raw.items():
        dtype = _DTYPES.get(str(key))
        if dtype is None:
            close = difflib.get_close_matches(str(key), list(_DTYPES), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ClusterSpecError(f"cluster spec {spec!r}: unknown dtype {key!r} in field 'peak_flops'{hint}")
        try:
            flops = _parse_flops(value)
        except ValueError as e:
            raise ClusterSpecError(f"cluster spec {spec!r}: field 'peak_flops.{key}' has the wrong type: {e}") from None
        if flops <= 0:
            raise ClusterSpecError(f"cluster spec {spec!r}: field 'peak_flops.{key}' must be positive, got {value!r}")
        out[dtype] = flops
    if "fp32" not in out or not ({"bf16", "fp16"} & set(out)):
        raise ClusterSpecError(
            f"cluster spec {spec!r}: field 'peak_flops' needs fp32 and at least one of bf16/fp16, got {sorted(out)}"
        )
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ClusterSpecError(f"cannot read cluster spec {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ClusterSpecError(f"cluster spec {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


def _parse_overrides(preset: str, text: str, base: dict[str, Any]) -> dict[str, Any]:
    """``nodes=128,inter_node_latency=5us,peak_flops.bf16=300e12`` -> field updates (values parsed later)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not value:
            raise ClusterSpecError(
                f"cannot parse override {item!r} for cluster preset {preset!r}; "
                f"write FIELD=VALUE, e.g. {preset}:nodes=4"
            )
        if key.startswith("peak_flops."):
            table = dict(out.get("peak_flops", base.get("peak_flops") or {}))
            table[key.partition(".")[2]] = value
            out["peak_flops"] = table
        else:
            out[key] = value
    return out


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
    """Preset name -> its one-line description, from ``solver/clusters/*.yaml``."""
    out = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        out[path.stem] = str(data.get("description", ""))
    return out
