"""A first cost model: per-device memory of a candidate plus communication volume, in bytes.

Memory: a parameter costs 4x its local bytes (weights, gradients, two Adam moments); an activation
its local bytes. Communication, counted forward and backward (each redistribution has a dual):

    S -> R  all_gather       (n-1)/n * T   forward; backward slices locally
    R -> S  local slice      0 forward;    (n-1)/n * T backward (all_gather of the gradient)
    P -> R  all_reduce       2(n-1)/n * T  forward; backward is the identity (Megatron's g)
    P -> S  reduce_scatter   (n-1)/n * T   forward; all_gather backward
    S -> S' all_to_all       (n-1)/n * T   each way
    R used by a computation that differs across the axis: all_reduce of its gradient, 2(n-1)/n * T
    (Megatron's f; for parameters this is the data-parallel gradient all-reduce)

where T is the tensor's bytes on the ranks of that axis. Issue "cost model and ILP" replaces this
with the full model (ZeRO, MiCS, alpha-beta time per axis).
"""

from __future__ import annotations

import math

from autopar.passes.ir import MeshSpec, Partial, Placement, Replicate, Shard, TensorType

INF = math.inf


def axis_bytes(t: TensorType, placements: tuple[Placement, ...], mesh: MeshSpec, axis: int) -> float:
    """Bytes of the tensor held by the ranks of one axis together (other axes' shards divided out)."""
    div = 1
    for i, (p, n) in enumerate(zip(placements, mesh.sizes)):
        if i != axis and isinstance(p, Shard):
            div *= n
    return t.nbytes / div


def redistribute_bytes(
    t: TensorType, src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh: MeshSpec
) -> float:
    """Communication volume per device to turn placements src into dst (forward + backward)."""
    total = 0.0
    needs_grad = t.is_float
    for i, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        n = mesh.sizes[i]
        vol = axis_bytes(t, src, mesh, i) * (n - 1) / n
        if isinstance(b, Partial):
            return INF  # never manufacture a partial sum
        if isinstance(a, Partial) and isinstance(b, Replicate):
            total += 2 * vol
        elif isinstance(a, Partial):
            total += vol * (2 if needs_grad else 1)
        elif isinstance(a, Shard) and isinstance(b, Replicate):
            total += vol
        elif isinstance(a, Replicate):
            total += vol if needs_grad else 0.0
        else:  # S -> S'
            total += vol * (2 if needs_grad else 1)
    return total


def grad_reduce_bytes(t: TensorType, placements: tuple[Placement, ...], mesh: MeshSpec, axis: int) -> float:
    n = mesh.sizes[axis]
    return 2 * axis_bytes(t, placements, mesh, axis) * (n - 1) / n


def local_bytes(t: TensorType, placements: tuple[Placement, ...], mesh: MeshSpec) -> float:
    return t.with_placements(placements).local_nbytes(mesh)
