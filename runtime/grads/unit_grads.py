"""ZeRO-3's gradients: each unit's reduce-scattered over the ZeRO axes, reduced across replicas, added to .grad.

``Zero3Params`` (``runtime/grads/zero3.py``) starts a unit's reduce-scatter over the first ZeRO axis when
every gradient of the unit is in (``start``, asynchronous while the backward goes on) and ``finish``es
them all at the end of the backward: the remaining ZeRO axes, MiCS's hop 2 across the replica axes,
then each slice's ``.grad`` (running its post-accumulate hooks, as AccumulateGrad would). A ``whole``
parameter's gradient, equal on every rank, counts once: ranks off coordinate 0 send zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.watch import guarded


@dataclass
class Unit:
    """A unit's layout: parameter indices; each one's slice length and offsets in the concatenated
    slice (length ``width``) and in the whole buffer (parameters one after the other, padded)."""

    label: str
    params: list[int]
    slice_len: list[int]
    slice_off: list[int]
    whole_off: list[int]
    width: int


class UnitGrads:
    """The gradient reductions of ``units`` of the slices ``slices`` (``parts`` of them per parameter over
    ``zero_axes``); ``whole[i]``: parameter i's gradient is already whole on every rank."""

    def __init__(
        self,
        comm: Comm,
        zero_axes: tuple[str, ...],
        replica_axes: tuple[str, ...],
        parts: int,
        units: list[Unit],
        slices: list[torch.nn.Parameter],
        whole: list[bool],
        node_groups=None,
    ):
        self.comm, self.zero_axes, self.replica_axes, self.parts = comm, zero_axes, replica_axes, parts
        self.units, self.slices, self.whole = units, slices, whole
        self.node_groups = node_groups  # hierarchical across nodes: intra-node first (runtime/grads/node_gather.py)
        self._scatters: list[tuple] = []  # reduce-scatters in flight

    def start(self, u: int, grads: tuple) -> None:
        """Start reduce-scattering unit ``u``'s gradients (laid out as the gathered slices)."""
        unit = self.units[u]
        ref = self.slices[unit.params[0]]
        dtype = self.comm.grad_dtype or ref.dtype  # mixed precision's reduce_dtype
        buf = torch.zeros(self.parts, unit.width, dtype=dtype, device=ref.device)
        h = self.node_groups
        first = self.zero_axes[0]
        # a whole gradient counts once: from coordinate 0 (of the first axis; hierarchical: of every ZeRO axis)
        off = any(self.comm.coords[a] for a in self.zero_axes) if h is not None else self.comm.coords[first] != 0
        for i, g, n, so in zip(unit.params, grads, unit.slice_len, unit.slice_off):
            if g is None or (self.whole[i] and off):
                continue
            flat = torch.nn.functional.pad(g.detach().reshape(-1), (0, n * self.parts - g.numel()))
            buf[:, so : so + n].copy_(flat.view(self.parts, n))
        if h is not None:  # rows to (local index, node), reduce-scattered inside the node first
            buf, n, group = h.scatter_rows(buf), h.per_node, h.intra
        else:
            buf, n, group = buf.view(-1), self.comm.sizes[first], self.comm.groups[first]
        out = torch.empty(buf.numel() // n, dtype=buf.dtype, device=buf.device)
        work = dist.reduce_scatter_single(out, buf, group=group, async_op=True)
        self._scatters.append((u, buf, out, work))

    def finish(self) -> None:
        """Wait for every reduce-scatter started, finish each unit's reduction and add it into ``.grad``."""
        scatters, self._scatters = self._scatters, []
        for u, buf, out, work in scatters:
            work.wait()
            free_storage(buf)
            self._accumulate(u, self._rest_of_scatter(u, out))

    def _rest_of_scatter(self, u: int, g: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter over the remaining ZeRO axes (hierarchical: across the nodes among the ranks of this
        rank's local index), then the all-reduce across the replicas."""
        unit = self.units[u]
        h = self.node_groups
        if h is not None:
            out = torch.empty(g.numel() // h.nodes, dtype=g.dtype, device=g.device)
            dist.reduce_scatter_single(out, g, group=h.inter)
            g = out
        for a in (() if h is not None else self.zero_axes[1:]) + self.replica_axes:
            if self.comm.coords[a] != 0:  # a whole gradient counts once
                g = g.clone()
                rows = g.view(-1, unit.width)
                for i, n, so in zip(unit.params, unit.slice_len, unit.slice_off):
                    if self.whole[i]:
                        rows[:, so : so + n] = 0
            if a in self.zero_axes:
                out = torch.empty(g.numel() // self.comm.sizes[a], dtype=g.dtype, device=g.device)
                dist.reduce_scatter_single(out, g.contiguous(), group=self.comm.groups[a])
                g = out
            else:
                guarded(
                    self.comm.groups[a],
                    a,
                    "all_reduce (ZeRO-3 gradients)",
                    dist.all_reduce,
                    g,
                    group=self.comm.groups[a],
                )
        return g

    def _accumulate(self, u: int, g: torch.Tensor) -> None:
        unit = self.units[u]
        for i, n, so in zip(unit.params, unit.slice_len, unit.slice_off):
            p = self.slices[i]
            piece = g[so : so + n]
            if p.grad is None:
                p.grad = piece.to(p.dtype, copy=True)
            else:
                p.grad += piece
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(p)  # as AccumulateGrad runs them (the data-parallel sync of other axes)


def free_storage(t: torch.Tensor) -> None:
    """Free ``t``'s memory though something (a finished collective's work object) still refers to it."""
    t.untyped_storage().resize_(0)


__all__ = ["Unit", "UnitGrads", "free_storage"]
