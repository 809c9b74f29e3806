"""Read and check the fields of a cluster spec: required fields, units, ``auto`` values, preset overrides.

Errors are ``ClusterSpecError`` naming the spec and the field, with the form the field expects.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from autopar.errors import ClusterSpecError
from autopar.solver.cluster.units import parse_bytes, parse_count, parse_flops, parse_rate, parse_seconds

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")
# dtype names a peak_flops table may use, with the spellings that map onto them
DTYPES = {
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
    "memory_reserve": "bytes per device the plan leaves free (CUDA context, NCCL buffers, fragmentation), e.g. 4GiB",
    "peak_flops": "a mapping dtype -> FLOP/s per device with fp32 and bf16 or fp16, e.g. {bf16: 312e12}",
    "intra_node_bandwidth": "bytes/s per device inside a node, e.g. 230GB/s",
    "intra_node_latency": "seconds per step inside a node, e.g. 3us",
    "inter_node_bandwidth": "bytes/s per device across nodes, e.g. 25GB/s or 200Gb/s",
    "inter_node_latency": "seconds per step across nodes, e.g. 6us",
}


def check_fields(data: Mapping[str, Any], known: Sequence[str]) -> dict[str, Any]:
    """The checked values of a spec's fields (units parsed) from a mapping whose keys must be in ``known``."""
    if not isinstance(data, Mapping):
        raise ClusterSpecError(f"a cluster spec must be a mapping of fields, got {type(data).__name__}")
    name = str(data.get("name", "custom"))
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ClusterSpecError(f"cluster spec {name!r}: unknown field {key!r}{hint}")
    for key in _REQUIRED:
        if key not in data:
            raise ClusterSpecError(f"cluster spec {name!r} is missing field {key!r} ({_FIELD_HELP[key]})")
    devices = _field(name, "devices_per_node", data, _devices_per_node, positive=True)
    values: dict[str, Any] = {
        "name": name,
        "nodes": _field(name, "nodes", data, parse_count, positive=True),
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
        "memory_reserve": (
            None if data.get("memory_reserve") is None else _field(name, "memory_reserve", data, parse_bytes, False)
        ),
        "efficiency": _optional(name, "efficiency", data, float),
        "device": None if data.get("device") is None else str(data["device"]),
        "description": str(data.get("description", "")),
        "notes": {str(k): str(v) for k, v in (data.get("notes") or {}).items()},
    }
    if values["efficiency"] is not None and values["efficiency"] > 1:
        raise ClusterSpecError(f"cluster spec {name!r}: field 'efficiency' is a fraction of peak, at most 1")
    if values["backend"] not in ("nccl", "gloo"):
        raise ClusterSpecError(
            f"cluster spec {name!r}: field 'backend' must be nccl or gloo, got {values['backend']!r}"
        )
    return values


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
    return parse_count(value)


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
        dtype = DTYPES.get(str(key))
        if dtype is None:
            close = difflib.get_close_matches(str(key), list(DTYPES), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ClusterSpecError(f"cluster spec {spec!r}: unknown dtype {key!r} in field 'peak_flops'{hint}")
        try:
            flops = parse_flops(value)
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


def read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ClusterSpecError(f"cannot read cluster spec {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ClusterSpecError(f"cluster spec {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


def parse_overrides(preset: str, text: str, base: dict[str, Any]) -> dict[str, Any]:
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
