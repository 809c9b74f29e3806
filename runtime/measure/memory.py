"""Measure the bytes a training step holds on this rank: the allocator's peak, and what autograd saves for backward.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free (including the
tensors autograd saves for backward, which no Python-level tracker sees). The peak of the running
sum during the step, plus what was already allocated before it (parameters, optimizer states),
is the step's peak live tensor bytes.

``SavedTensors`` counts what autograd saves for backward without the allocator: saved-tensor hooks see
every tensor a derivative formula packs; each storage counts once, and storages the caller already
accounts for (parameters, the batch) are left out. That is the cost model's activation category.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from autopar.solver.sharding.memory import memory_categories


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def view_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors themselves, not of their storages: gradients that are slices of a
    gradient bucket's buffer (runtime/grads/sync.py) count their own bytes; the buffer is a category of its own."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        t = _local(t)
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def peak_step_bytes(step: Callable[[], None], already_live: int) -> int:
    """Run ``step`` under the profiler; return already_live plus the peak of allocations minus frees."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # each op's *self* allocations minus frees (children counted once), plus frees between ops
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return already_live + peak


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's bytes on this rank


class SavedTensors:
    """Bytes of the storages autograd saves for backward inside the ``with`` block, each once, leaving out
    the storages of ``exclude`` (parameters, inputs: counted in their own categories); ``bytes`` after the block."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_local(t).untyped_storage().data_ptr() for t in exclude}
        # each saved storage is held until the block ends, so a freed one's address is never reused
        # by another while counting (a pipeline step frees microbatches while others are saved)
        self.saved: dict[int, torch.UntypedStorage] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _local(t).untyped_storage()
        if s.data_ptr() and s.data_ptr() not in self._exclude:
            self.saved[s.data_ptr()] = s
        return t

    def __enter__(self) -> SavedTensors:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self.bytes = self.total
        self.saved.clear()  # release the storages

    @property
    def total(self) -> int:
        return sum(s.nbytes() for s in self.saved.values())


CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def measured_categories(params: list[torch.Tensor], opt: torch.optim.Optimizer, saved: SavedTensors) -> dict[str, int]:
    """Live bytes on this rank by category after a training step: parameters, gradients, optimizer states (this
    rank's local tensors, each storage once), and what autograd saved for backward during the step."""
    return {
        "params": tensor_bytes(params),
        "grads": view_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(optimizer_state_tensors(opt)),
        "activations": saved.bytes,
    }


def predicted_categories(module) -> dict[str, float]:
    """The cost model's bytes per category for this rank of a compiled ``ParallelModule`` (fp32 + Adam, its
    training setup): from its planned program, or on a pipeline from its stages' programs, each keeping one
    microbatch's activations per microbatch of the step (all of them at once: the schedule's peak keeps
    fewer, ``schedule/simulator.py``). ``every_output`` is the activation model before saved tensors."""
    pipe = module.schedule.num_stages > 1
    progs = [sp.program for sp in module.stages.values()] if pipe else [module.program]
    per_step = module.options.microbatches if pipe else 1
    cats = [memory_categories(p, module.setup) for p in progs]
    out = {k: sum(c[k] for c in cats) for k in CATEGORIES}
    out["activations"] *= per_step
    out["gathered"] = max(c["gathered"] for c in cats)  # ZeRO-3's whole weights, one stage runs at a time
    out["every_output"] = per_step * sum(t.local_nbytes(p.mesh) for p in progs for op in p.ops for t in op.types)
    return out
