"""Gradient buckets: which parameters' gradients each data-parallel all-reduce carries, as DDP groups them.

A parameter whose gradient is a partial sum over mesh axes (``grad_sync``, set by insert-collectives)
is all-reduced over each of them once per step, in flat buckets, one all-reduce per bucket:

- per axis, in mesh order; on an axis, the parameters in the reverse order of their first use by the
  program's ops, the order in which a backward finishes their gradients (DDP buckets in the reverse
  order of ``model.parameters()``; the first use is that order where the model registers parameters
  as it uses them, and stays right where it does not, e.g. a tied embedding finished last);
- a bucket is closed as soon as it holds at least ``cap_bytes`` (DDP's ``bucket_cap_mb``, 25 MiB by
  default: ``TrainingSetup.bucket_cap_mb``), so a parameter is never split between two buckets.

The runtime (``runtime/grads/sync.py``) launches each bucket as soon as its gradients are final, the cost
model prices one collective latency per bucket, and the collectives test compares what each rank
issues with this list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from autopar.ir.core import Program


@dataclass(frozen=True)
class Bucket:
    """One flat all-reduce of gradients over ``axis``: the parameters in it (in the order they are
    laid out in the flat buffer) and its bytes on each rank."""

    axis: str
    names: tuple[str, ...]
    nbytes: int


def backward_order(program: Program) -> list[str]:
    """``program``'s parameters in the reverse order of their first use by its ops (unused ones last)."""
    params = {v.name for v in program.params}
    first: list[str] = []
    seen: set[str] = set()
    for op in program.ops:
        for r in op.input_refs():
            if r.name in params and r.name not in seen:
                seen.add(r.name)
                first.append(r.name)
    return list(reversed(first)) + [v.name for v in program.params if v.name not in seen]


def grad_buckets(
    program: Program,
    cap_bytes: float,
    names: Iterable[str] | None = None,
    skip: Callable[[str, str], bool] | None = None,
    order: list[str] | None = None,
) -> list[Bucket]:
    """The buckets that sync the gradients of ``names`` (default: every parameter of ``program``),
    leaving out the parameters' ``grad_sync`` axes that ``skip(name, axis)`` says are reduced
    elsewhere (ZeRO's). ``order``: ``backward_order(program)`` when already computed."""
    values = {v.name: v for v in program.params}
    wanted = set(values) if names is None else set(names)
    ranked = [n for n in (order if order is not None else backward_order(program)) if n in wanted]
    out: list[Bucket] = []
    for axis in program.mesh.names:
        members = [n for n in ranked if axis in values[n].attrs.get("grad_sync", ()) and not (skip and skip(n, axis))]
        bucket: list[str] = []
        size = 0
        for n in members:
            bucket.append(n)
            size += values[n].type.local_nbytes(program.mesh)
            if size >= cap_bytes:
                out.append(Bucket(axis, tuple(bucket), size))
                bucket, size = [], 0
        if bucket:
            out.append(Bucket(axis, tuple(bucket), size))
    return out


__all__ = ["Bucket", "backward_order", "grad_buckets"]
