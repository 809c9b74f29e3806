"""ZeRO-2 over the data-parallel axes, with MiCS's partition groups and 2-hop gradient synchronization.

The parameters whose gradients a data-parallel step sums (``grad_sync`` over every data-parallel
axis) are kept, per rank, as one flat vector in a fixed order (one per parameter group, so each group's
options, such as no weight decay on biases, apply to its own slice). After the last backward of a step:

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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar.ir.axes import data_axes
from autopar.ir.core import Replicate
from autopar.runtime.build.precision import cast_to
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.watch import guarded


class _Flat:
    """One parameter group's managed parameters as one padded flat vector; ``master`` is this rank's
    slice of it, the parameter the wrapped optimizer steps."""

    def __init__(
        self,
        names: list[str],
        params: list[torch.nn.Parameter],
        n_summed: int,
        comm: Comm,
        zero_axes: tuple[str, ...],
    ):
        self.names, self.params = names, params
        self.numel = sum(p.numel() for p in params)
        parts = math.prod(comm.sizes[a] for a in zero_axes)
        self.padded = -(-self.numel // parts) * parts
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        if params:
            flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in params])
        self.master = torch.nn.Parameter(local_slice(flat, comm, zero_axes).clone())
        # entries of gradients that are already whole on every rank (counted once in each reduction)
        self.whole = torch.zeros(self.padded, dtype=torch.bool, device=device)
        self.whole[n_summed : self.numel] = True

    def flat_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (one per parameter, in order) as one padded flat vector."""
        flat = torch.zeros(self.padded, dtype=self.master.dtype, device=self.master.device)
        if tensors:
            flat[: self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat


class ZeroOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls`` (a class, or a callable taking its groups and options) with ZeRO-2 sharding
    of the data-parallel gradient and optimizer states.

    ``groups``: the parameter groups, each (its options, the names of its parameters); default one
    group of every parameter. Each group's managed parameters are one flat vector, so the wrapped
    optimizer has the same groups with the same options (a learning-rate scheduler works on them). It
    is a ``torch.optim.Optimizer`` in what schedulers and checkpoints use: ``param_groups``, ``state``,
    ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        grad_sync: dict[str, list[str]],
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        comm: Comm,
        zero_axes: tuple[str, ...],
        replica_axes: tuple[str, ...] = (),
        whole: set[str] | frozenset[str] = frozenset(),
        groups: list[tuple[dict[str, Any], list[str]]] | None = None,
        **kwargs: Any,
    ):
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer holds the groups and states
        self.comm = comm
        self.zero_axes = tuple(zero_axes)
        self.replica_axes = tuple(replica_axes)
        need = set(self.zero_axes) | set(self.replica_axes)
        trainable = sorted(n for n, p in params.items() if p.requires_grad)
        if groups is None:
            groups = [({}, trainable)]
        self.names: list[str] = []
        self.flats: list[_Flat] = []
        torch_groups = []
        for options, members in groups:
            mine = sorted(n for n in members if n in params and params[n].requires_grad)
            summed = [n for n in mine if need <= set(grad_sync.get(n, ()))]
            flat_names = summed + [n for n in mine if n in whole and n not in set(summed)]
            flat = _Flat(
                flat_names,
                [params[n] for n in flat_names],
                sum(params[n].numel() for n in summed),
                comm,
                self.zero_axes,
            )
            others = [params[n] for n in mine if n not in set(flat_names)]
            self.names += flat_names
            self.flats.append(flat)
            torch_groups.append({**options, "params": ([flat.master] if flat.params else []) + others})
        self._managed = set(self.names)
        self._reduced = False
        self.optimizer = optimizer_cls(torch_groups, **kwargs)
        self.defaults = self.optimizer.defaults

    # -- the flat layout -------------------------------------------------------------------------
    def manages(self, name: str) -> bool:
        """Whether parameter ``name``'s data-parallel gradient sum is done here (not by REDUCE_GRADS)."""
        return name in self._managed

    @property
    def master(self) -> torch.nn.Parameter | None:
        """The first group's slice (``None`` when it manages no parameter)."""
        return self.flats[0].master if self.flats and self.flats[0].params else None

    def flat_name(self, p: torch.Tensor) -> str | None:
        """``zero.flat`` (the first group's slice), ``zero.flat.g{i}`` (group i's), else ``None``."""
        for i, f in enumerate(self.flats):
            if f.params and p is f.master:
                return "zero.flat" if i == 0 else f"zero.flat.g{i}"
        return None

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    # -- the step --------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Hops 1 and 2: this rank's slice of the summed gradient, into each group's ``master.grad``;
        once per step (``clip_grad_norm_`` may have done it before the step)."""
        if self._reduced:
            return
        self._reduced = True
        for f in self.flats:
            if not f.params:
                continue
            g = f.flat_of([p.grad if p.grad is not None else torch.zeros_like(p) for p in f.params])
            g = cast_to(g, self.comm.grad_dtype)  # mixed precision's reduce_dtype
            whole = f.whole
            for a in self.zero_axes:
                if self.comm.coords[a] != 0:
                    g.masked_fill_(whole, 0.0)
                g = _reduce_scatter(g, self.comm.groups[a], self.comm.sizes[a], self.comm.coords[a])
                whole = whole.chunk(self.comm.sizes[a])[self.comm.coords[a]]
            for a in self.replica_axes:
                if self.comm.coords[a] != 0:
                    g.masked_fill_(whole, 0.0)
                guarded(
                    self.comm.groups[a], a, "all_reduce (ZeRO gradients)", dist.all_reduce, g, group=self.comm.groups[a]
                )
            f.master.grad = g.to(f.master.dtype, copy=True)
            for p in f.params:
                p.grad = None  # ZeRO-2: only the slice's gradient is kept

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        if closure is not None:
            raise TypeError("autopar's ZeRO optimizer takes no closure")
        self.reduce_gradients()
        self.optimizer.step()
        self._reduced = False
        for f in self.flats:
            if not f.params:
                continue
            x = gather_slices(f.master.detach(), self.comm, self.zero_axes)
            for p, chunk in zip(f.params, x[: f.numel].split([p.numel() for p in f.params])):
                p.copy_(chunk.view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._reduced = False
        for f in self.flats:
            for p in f.params:
                p.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("give every parameter group to make_optimizer (param_groups=); ZeRO's flat slices are fixed")

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Copy the parameters into the flat slices again (after loading parameters from a checkpoint)."""
        for f in self.flats:
            if f.params:
                f.master.copy_(local_slice(f.flat_of([p.detach() for p in f.params]), self.comm, self.zero_axes))

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r}, zero_axes={self.zero_axes}, replica_axes={self.replica_axes})"


def local_slice(flat: torch.Tensor, comm: Comm, zero_axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's slice of a flat vector cut over the ZeRO axes one after the other (slices of
    slices); its length must divide by the product of their sizes."""
    for a in zero_axes:
        flat = flat.chunk(comm.sizes[a])[comm.coords[a]]
    return flat


def gather_slices(piece: torch.Tensor, comm: Comm, zero_axes: tuple[str, ...]) -> torch.Tensor:
    """The inverse of ``local_slice``: all-gather the slices over the ZeRO axes in reverse order."""
    x = piece
    for a in reversed(zero_axes):
        parts = [torch.empty_like(x) for _ in range(comm.sizes[a])]
        guarded(
            comm.groups[a], a, "all_gather (ZeRO slices)", dist.all_gather, parts, x.contiguous(), group=comm.groups[a]
        )
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
    # torch's registry holds the backend of a real group; the rank simulator's groups are not registered
    if (group.name() if getattr(group, "simulated", False) else dist.get_backend(group)) == "nccl":
        out = torch.empty(g.numel() // n, dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, g, group=group)
        return out
    guarded(group, None, "all_reduce (ZeRO gradients)", dist.all_reduce, g, group=group)  # gloo: no reduce-scatter
    return g.chunk(n)[coord].clone()


__all__ = ["ZeroOptimizer", "gather_slices", "local_slice", "whole_gradient_params", "zero_axes_of"]
