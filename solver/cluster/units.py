"""Numbers with units, as cluster spec files write them: ``80GiB``, ``200Gb/s``, ``5us``, ``312 TFLOP/s``."""

from __future__ import annotations

import re
from typing import Any

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


def parse_flops(value: Any) -> float:
    """FLOP/s from a number or a string like ``312e12``, ``312 TFLOP/s`` or ``312T``."""
    n = _number(value)
    if n is None and isinstance(value, str):
        m = re.fullmatch(_NUM + r"\s*([KMGTP]?)(?:FLOP/s|FLOPS|flops)?", value.strip())
        if m:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if n is None:
        raise ValueError(f"{value!r} is not a FLOP/s figure (e.g. 312e12, 312 TFLOP/s)")
    return n


def parse_count(value: Any) -> int:
    """An integer from an int or a string of one (booleans and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None
