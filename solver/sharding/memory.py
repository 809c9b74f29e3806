"""Predicted bytes per device of a planned program, by category: what each rank keeps and when.

``memory_categories`` splits a program's memory as the runtime holds it (parameters, gradients,
optimizer states, the batch, saved activations, gradient buckets, ZeRO-3's gathered weights);
``program_memory`` is their sum, the peak the planner and the search compare with a budget.
"""

from __future__ import annotations

import math

import torch

from autopar.ir.axes import data_axes
from autopar.ir.core import Replicate
from autopar.solver.sharding.blocks import ROOT, param_units
from autopar.solver.sharding.cost import CostModel, TrainingSetup
from autopar.solver.sharding.saved import activation_bytes


def memory_categories(prog, setup: TrainingSetup | None = None) -> dict[str, float]:
    """Predicted bytes per device of a planned program (after insert-collectives) by category: ``params``,
    ``grads``, ``optimizer`` (states and master weights, as ZeRO divides them; ``params`` includes mixed
    precision's per-use compute copy), ``inputs`` (the batch and buffers), ``activations`` (what autograd
    saves for backward, ``solver/sharding/saved.py``: held together at the end of the forward), ``buffers`` (the
    gradient-sync buckets, one per sync axis of a parameter, kept from step to step: runtime/grads/sync.py) and
    ``gathered`` (ZeRO-3's whole weights, ``zero3_gathered``)."""
    model = CostModel(prog.mesh, setup or TrainingSetup())
    out = dict.fromkeys(("params", "grads", "optimizer", "inputs", "activations", "buffers", "gathered"), 0.0)
    # a bucket per sync axis, but not over the axes ZeRO reduce-scatters itself (its data-parallel axes)
    zero_reduced: set[str] = set()
    if model.setup.zero:
        zero_reduced = set(data_axes(prog.mesh.names)) | {prog.mesh.names[i] for i in model.setup.shard_axes(prog.mesh)}
    for v in prog.inputs:
        local = model.local_bytes(v.type, v.type.placements)
        if v.kind != "param":
            out["inputs"] += local
            continue
        states = model.state_bytes(v.type, v.type.placements, bool(v.attrs.get("frozen")))
        for name, b in zip(("params", "grads", "optimizer"), states):
            out[name] += b
        out["params"] += local / v.type.itemsize * model.copy_bytes_of(v.type, v.type.placements)  # per-use copy
        buckets = sum(a not in zero_reduced for a in v.attrs.get("grad_sync", ()))
        if buckets:  # in the reduce dtype, of ZeRO-3's slice where it keeps one
            numel = local / v.type.itemsize / (model.zero_factor(v.type.placements) if model.setup.zero >= 3 else 1)
            out["buffers"] += buckets * numel * model.setup.grad_itemsize(v.type.itemsize)
    out["activations"] = activation_bytes(prog)
    out["gathered"] = zero3_gathered(prog, model.setup)
    return out


def program_memory(prog, setup: TrainingSetup | None = None) -> float:
    """Predicted peak bytes per device of a planned program: the sum of `memory_categories`."""
    return sum(memory_categories(prog, setup).values())


def zero3_gathered(prog, setup: TrainingSetup) -> float:
    """The most bytes of whole parameters ZeRO-3 holds at once on a rank (``runtime/grads/zero3.py``): the
    root unit and the two largest repeated blocks (``solver/sharding/blocks.py``; in forward, the block computing
    and the next one arriving), each parameter padded to a multiple of the ZeRO ranks; 0 without ZeRO-3.

    Mixed precision: a parameter the program reads in the compute dtype is cast from its gathered unit when
    the unit starts computing and the unit's fp32 parameters are freed then (``runtime/grads/unit_gathers.py``),
    unless a reader of them is still to come. So in the forward a block computing holds its fp32 parameters and
    their copies (``copy_bytes`` each), the next block arrives in fp32, and the root keeps the copies of its
    parameters read after the first block starts (the final norm, a tied head) and, if any of them is read
    without a cast, its fp32 parameters; the backward's first unit, the root, holds its fp32 parameters and
    copies, beside the last block arriving."""
    if setup.zero < 3:
        return 0.0
    zero = [i for i in setup.shard_axes(prog.mesh) if prog.mesh.sizes[i] > 1]
    k = math.prod(prog.mesh.sizes[i] for i in zero)
    managed = {
        v.name: v
        for v in prog.params
        if zero and v.type.is_float and all(isinstance(v.type.placements[i], Replicate) for i in zero)
    }
    if not managed:
        return 0.0
    model = CostModel(prog.mesh, setup)
    weight = setup.bytes_per_param[0]

    def size(names: list[str]) -> float:
        out = 0.0
        for n in names:
            t = managed[n].type
            numel = model.local_bytes(t, t.placements) / t.itemsize
            out += -(-numel // k) * k * weight
        return out

    units = param_units(prog, managed)
    root = [n for label, names in units if label == ROOT for n in names]
    blocks = sorted((names for label, names in units if label != ROOT), key=size, reverse=True)
    copy = setup.copy_bytes / weight
    cast = {n for n, v in managed.items() if copy and v.type.torch_dtype in (torch.bfloat16, torch.float16)}
    if not cast:
        return size(root) + sum(size(b) for b in blocks[:2])
    # the position of each parameter's last read, and of the first read of a block's
    in_block = {n for b in blocks for n in b}
    last: dict[str, int] = {}
    start = math.inf
    for pos, op in enumerate(prog.ops):
        for r in op.input_refs():
            if r.name in managed:
                last[r.name] = pos
                if r.name in in_block:
                    start = min(start, pos)
    root_cast = [n for n in root if n in cast]
    held = [n for n in root_cast if last.get(n, -1) > start]
    plain_root = size(root) if len(root_cast) < len(root) else 0.0
    big = [size(b) + size([n for n in b if n in cast]) * copy for b in blocks[:1]]
    forward = plain_root + size(held) * copy + sum(big) + sum(size(b) for b in blocks[1:2])
    backward = size(root) + size(root_cast) * copy + sum(size(b) for b in blocks[:1])
    return max(forward, backward)


__all__ = ["memory_categories", "program_memory", "zero3_gathered"]
