"""Measure the peak bytes a training step holds on this rank, from the allocator's own events.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free (including the
tensors autograd saves for backward, which no Python-level tracker sees). The peak of the running
sum during the step, plus what was already allocated before it (parameters, optimizer states),
is the step's peak live tensor bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
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
