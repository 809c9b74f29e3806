"""ZeRO-2 over the data-parallel axes, with MiCS's partition groups and 2-hop gradient synchronization.

The parameters whose gradients a data-parallel step sums (``grad_sync`` over every data-parallel
axis) are kept, per rank, as one flat vector in a fixed order. After the last backward of a step:

1. **hop 1, inside the partition group** (the ``zero_axes``, MiCS section 3.4): reduce-scatter of the
   flat gradient, so each rank holds the summed gradient of its 1/k slice only (ZeRO-2). gloo has no
   reduce-scatter: there it is an all-reduce keeping the local slice (same numbers, more traffic);
   NCCL uses ``reduce_scatter_tensor``.
2. **hop 2, across partition groups** (the ``replica_axes``; none without MiCS): all-reduce of that
   slice among the ranks holding the same slice in the other groups.
3. the wrapped optimizer steps on the slice only (its states are 1/k of the model's: ZeRO-1/2);
4. all-gather of the updated slices inside the partition group (never across groups), written back
   into the parameters, which every rank keeps whole (ZeRO-2, not ZeRO-3).

Several zero axes are sharded one after the other (slices of slices); the all-gather goes back in
reverse. A parameter the plan replicates over the data-parallel axes but whose gradient comes out
whole and equal on every rank (the plan computed its uses redundantly, or split them by a
``local_shard`` whose backward gathers) is in the flat vector too, when the caller names it in
``whole``: its states are sharded as well, and in the reductions only the rank at coordinate 0 of the
axis contributes its entries (the others add zeros), so the sum is that gradient exactly. Parameters
outside the flat vector (sharded over data parallelism by the plan) are stepped by the same wrapped
optimizer as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autopar.ir.axes import data_axes
from autopar.ir.core import Replicate
from autopar.runtime import collectives as coll


class ZeroOptimizer:
    """Wraps ``optimizer_cls`` with ZeRO-2 sharding of the data-parallel gradient and optimizer states."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        grad_sync: dict[str, list[str]],
        optimizer_cls: type[torch.optim.Optimizer],
        comm: coll.Comm,
        zero_axes: tuple[str, ...],
        replica_axes: tuple[str, ...] = (),
        whole: set[str] | frozenset[str] = frozenset(),
        **kwargs: Any,
    ):
        self.comm = comm
        self.zero_axes = tuple(zero_axes)
        self.replica_axes = tuple(replica_axes)
        need = set(self.zero_axes) | set(self.replica_axes)
        names = sorted(n for n, p in params.items() if p.requires_grad)
        summed = [n for n in names if need <= set(grad_sync.get(n, ()))]
        self.names = summed + [n for n in names if n in whole and n not in set(summed)]
        self.params = [params[n] for n in self.names]
        self.others = [params[n] for n in names if n not in set(self.names)]
        self.numel = sum(p.numel() for p in self.params)
        self.parts = math.prod(comm.sizes[a] for a in self.zero_axes)
        self.padded = -(-self.numel // self.parts) * self.parts
        dtype = self.params[0].dtype if self.params else torch.float32
        device = self.params[0].device if self.params else torch.device("cpu")
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        if self.params:
            flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.master = torch.nn.Parameter(self._slice(flat).clone())
        # entries of gradients that are already whole on every rank (counted once in each reduction)
        n_summed = sum(params[n].numel() for n in summed)
        self._whole = torch.zeros(self.padded, dtype=torch.bool, device=device)
        self._whole[n_summed : self.numel] = True
        self.optimizer = optimizer_cls(([self.master] if self.params else []) + self.others, **kwargs)

    # -- the flat layout -------------------------------------------------------------------------
    def manages(self, name: str) -> bool:
        """Whether parameter ``name``'s data-parallel gradient sum is done here (not by REDUCE_GRADS)."""
        return name in self._managed

    @property
    def _managed(self) -> set[str]:
        return set(self.names)

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        return local_slice(flat, self.comm, self.zero_axes)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # -- the step --------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Hops 1 and 2: this rank's slice of the summed gradient, into ``master.grad``."""
        if not self.params:
            return
        g = torch.zeros(self.padded, dtype=self.master.dtype, device=self.master.device)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        g[: self.numel] = torch.cat([x.reshape(-1) for x in grads])
        whole = self._whole
        for a in self.zero_axes:
            if self.comm.coords[a] != 0:
                g.masked_fill_(whole, 0.0)
            g = _reduce_scatter(g, self.comm.groups[a], self.comm.sizes[a], self.comm.coords[a])
            whole = whole.chunk(self.comm.sizes[a])[self.comm.coords[a]]
        for a in self.replica_axes:
            if self.comm.coords[a] != 0:
                g.masked_fill_(whole, 0.0)
            dist.all_reduce(g, group=self.comm.groups[a])
        self.master.grad = g.clone()
        for p in self.params:
            p.grad = None  # ZeRO-2: only the slice's gradient is kept

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_gradients()
        self.optimizer.step()
        if not self.params:
            return
        x = gather_slices(self.master.detach(), self.comm, self.zero_axes)
        for p, chunk in zip(self.params, x[: self.numel].split([p.numel() for p in self.params])):
            p.copy_(chunk.view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Copy the parameters into the flat slice again (after loading parameters from a checkpoint)."""
        if not self.params:
            return
        flat = torch.zeros(self.padded, dtype=self.master.dtype, device=self.master.device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.master.copy_(self._slice(flat))

    def named_tensors(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The optimizer's parameters with names: ``zero.flat`` (this rank's slice), then the others."""
        out = [("zero.flat", self.master)] if self.params else []
        return out


def local_slice(flat: torch.Tensor, comm: coll.Comm, zero_axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's slice of a flat vector cut over the ZeRO axes one after the other (slices of
    slices); its length must divide by the product of their sizes."""
    for a in zero_axes:
        flat = flat.chunk(comm.sizes[a])[comm.coords[a]]
    return flat


def gather_slices(piece: torch.Tensor, comm: coll.Comm, zero_axes: tuple[str, ...]) -> torch.Tensor:
    """The inverse of ``local_slice``: all-gather the slices over the ZeRO axes in reverse order."""
    x = piece
    for a in reversed(zero_axes):
        parts = [torch.empty_like(x) for _ in range(comm.sizes[a])]
        dist.all_gather(parts, x.contiguous(), group=comm.groups[a])
        x = torch.cat(parts)
    return x


def zero_axes_of(setup, mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes the model states are sharded over, data-parallel axes they are replicated across) for a
    ``TrainingSetup`` on a mesh without the pipeline axis: ZeRO over ``setup.zero_axes`` (default: the
    axes named ``dp*``), or MiCS's partition group (the innermost of them up to ``mics_group`` ranks)
    with the remaining data-parallel axes as replicas (2-hop synchronization)."""
    if not setup.zero:
        return (), ()
    shard_idx = setup.shard_axes(mesh)
    dp_names = setup.zero_axes if setup.zero_axes is not None else data_axes(mesh.names)
    zero_axes = tuple(mesh.names[i] for i in shard_idx if mesh.sizes[i] > 1)
    replica_axes = tuple(n for n in dp_names if n in mesh.names and n not in zero_axes and mesh.axis_size(n) > 1)
    return zero_axes, replica_axes


def whole_gradient_params(program, axes: tuple[str, ...]) -> set[str]:
    """Parameters of ``program`` replicated over every axis in ``axes`` whose gradient comes out whole
    on each rank there (no ``grad_sync`` on them): ``ZeroOptimizer``'s ``whole``."""

    names = program.mesh.names
    on = [names.index(a) for a in axes]
    return {
        v.name
        for v in program.params
        if all(isinstance(v.type.placements[i], Replicate) for i in on)
        and not set(axes) & set(v.attrs.get("grad_sync", ()))
    }


def _reduce_scatter(g: torch.Tensor, group, n: int, coord: int) -> torch.Tensor:
    if dist.get_backend(group) == "nccl":
        out = torch.empty(g.numel() // n, dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g, group=group)
        return out
    dist.all_reduce(g, group=group)  # gloo: no reduce-scatter; all-reduce and keep this rank's slice
    return g.chunk(n)[coord].clone()


__all__ = ["ZeroOptimizer", "gather_slices", "local_slice", "whole_gradient_params", "zero_axes_of"]
