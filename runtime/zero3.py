"""ZeRO-3: each rank keeps 1/k of the data-parallel-replicated parameters, on every mesh.

A managed parameter (the same set ``ZeroOptimizer`` manages: trainable, replicated over the ZeRO and
replica axes, its gradient summed over all of them or already whole on every rank) is flattened,
padded to a multiple of k (the product of the ZeRO axes' sizes) and cut into k equal slices, one
after the other over the ZeRO axes (slices of slices, as ``ZeroOptimizer``); the rank keeps its slice
as a ``torch.nn.Parameter``, and the attribute of every generated module that reads the parameter
(``attach``: a rank's forward program, its pipeline stages and their recomputation parts) is emptied.

- **forward**: ``gathered(names)`` all-gathers the slices of ``names`` (all, or one pipeline stage's)
  through ``_Gather``, writes the whole tensors into the modules' attributes, runs the body under
  ``saved_tensors()`` and empties the attributes again, so the whole parameters do not outlive the
  forward (a pipeline gathers a stage's parameters around each of its forwards and recomputations).
- **saved for backward**: a tensor the forward saves that lies in a gathered parameter's storage (the
  weight, or a view such as ``weight.t()``) is packed as a token (which parameter, size, stride,
  offset) and all-gathered again when the backward unpacks it. The autograd engine unpacks in the
  same order on every rank of the program, so the collectives match.
- **backward of the gather**: the whole gradient is reduce-scattered into the slice (summed over the
  ZeRO axes; a ``whole`` parameter's gradient, equal on every rank, is sliced without a sum), then
  all-reduced across the replica axes (MiCS's hop 2; not for ``whole`` ones).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime import collectives as coll
from autopar.runtime.precision import cast_to
from autopar.runtime.zero import _reduce_scatter, gather_slices, local_slice, whole_gradient_params, zero_axes_of


class _Gather(torch.autograd.Function):
    """slice -> padded whole flat vector; backward: the whole gradient -> this rank's slice of it."""

    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, owner: Zero3Params, i: int) -> torch.Tensor:
        ctx.owner, ctx.i = owner, i
        return owner.all_gather(piece)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return ctx.owner.scatter_grad(ctx.i, grad), None, None


class Zero3Params:
    """This rank's slices of the managed parameters ``names`` of ``params`` (name -> local shard)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        names: list[str],
        comm: coll.Comm,
        zero_axes: tuple[str, ...],
        replica_axes: tuple[str, ...] = (),
        whole: set[str] | frozenset[str] = frozenset(),
    ):
        self.comm = comm
        self.zero_axes, self.replica_axes = tuple(zero_axes), tuple(replica_axes)
        self.parts = math.prod(comm.sizes[a] for a in self.zero_axes)
        self.names = list(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.whole = [n in whole for n in self.names]
        self.shapes: list[torch.Size] = []
        self._owners: list[list[tuple[torch.nn.Module, str]]] = [[] for _ in self.names]
        self.slices: list[torch.nn.Parameter] = []
        for name in self.names:
            p = params[name]
            padded = -(-p.numel() // self.parts) * self.parts
            flat = torch.zeros(padded, dtype=p.dtype, device=p.device)
            flat[: p.numel()] = p.detach().reshape(-1)
            self.slices.append(
                torch.nn.Parameter(local_slice(flat, comm, self.zero_axes).clone(), requires_grad=p.requires_grad)
            )
            self.shapes.append(p.shape)
        self._live: dict[int, int] = {}  # storage data_ptr of a gathered flat vector -> parameter index
        self._gathered: list[weakref.ref] = []  # the last forward's whole tensors (for gathered_alive)

    def attach(self, module: torch.nn.Module) -> None:
        """Empty ``module``'s attribute of every managed parameter it holds; ``gather`` fills it."""
        for i, name in enumerate(self.names):
            path, _, attr = name.rpartition(".")
            try:
                owner = module.get_submodule(path) if path else module
            except AttributeError:
                continue
            if attr not in owner._parameters:
                continue
            del owner._parameters[attr]
            setattr(owner, attr, None)
            self._owners[i].append((owner, attr))

    # -- collectives -----------------------------------------------------------------------------
    def all_gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The padded flat vector from this rank's slice (the ZeRO axes in reverse order)."""
        return gather_slices(piece.detach(), self.comm, self.zero_axes)

    def scatter_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        g = grad.detach().reshape(-1).clone()
        if self.whole[i]:  # equal on every rank: no sum, just this rank's slice
            return local_slice(g, self.comm, self.zero_axes).contiguous()
        g = cast_to(g, self.comm.grad_dtype)  # mixed precision's reduce_dtype
        for a in self.zero_axes:
            g = _reduce_scatter(g, self.comm.groups[a], self.comm.sizes[a], self.comm.coords[a])
        for a in self.replica_axes:
            dist.all_reduce(g, group=self.comm.groups[a])
        return g.to(grad.dtype).contiguous()

    # -- one forward ----------------------------------------------------------------------------
    def _indices(self, names) -> list[int]:
        return list(range(len(self.names))) if names is None else [self._index[n] for n in names if n in self._index]

    def gather(self, names=None) -> None:
        """All-gather parameters ``names`` (default: all) into the modules (autograd-tracked)."""
        self._gathered = []
        for i in self._indices(names):
            flat = _Gather.apply(self.slices[i], self, i)
            self._gathered.append(weakref.ref(flat))
            self._live[flat.untyped_storage().data_ptr()] = i
            whole = flat[: math.prod(self.shapes[i])].view(self.shapes[i])
            for owner, attr in self._owners[i]:
                setattr(owner, attr, whole)

    def release(self, names=None) -> None:
        """Drop the whole parameters (the autograd graph holds tokens, not them)."""
        for i in self._indices(names):
            for owner, attr in self._owners[i]:
                setattr(owner, attr, None)
        self._live.clear()

    @contextlib.contextmanager
    def gathered(self, names=None):
        """Run the body with parameters ``names`` (default: all) gathered; saved ones become tokens."""
        self.gather(names)
        try:
            with self.saved_tensors():
                yield
        finally:
            self.release(names)

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks packing a saved tensor that is (a view of) a gathered parameter as a token."""

        def pack(t: torch.Tensor):
            if self._live and t.layout == torch.strided and t.device.type != "meta":
                i = self._live.get(t.untyped_storage().data_ptr())
                if i is not None:
                    return (_Token, i, t.size(), t.stride(), t.storage_offset(), t.requires_grad)
            return t

        def unpack(x):
            if isinstance(x, tuple) and x and x[0] is _Token:
                _, i, size, stride, offset, _rg = x
                with torch.no_grad():
                    flat = self.all_gather(self.slices[i])
                return flat.as_strided(size, stride, offset)
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def gathered_alive(self) -> int:
        """How many of the last forward's whole parameters are still alive (0 once it returned)."""
        return sum(r() is not None for r in self._gathered)

    # -- whole values ---------------------------------------------------------------------------
    @torch.no_grad()
    def whole_value(self, name: str, grad: bool = False) -> torch.Tensor:
        """Parameter ``name`` (its gradient with ``grad``: zeros where none) gathered whole over the
        ZeRO axes (a collective: call on every rank)."""
        i = self._index[name]
        piece = self.slices[i]
        if grad:
            piece = piece.grad if piece.grad is not None else torch.zeros_like(piece)
        return self.all_gather(piece)[: math.prod(self.shapes[i])].view(self.shapes[i])

    def slice_of(self, name: str) -> torch.nn.Parameter:
        return self.slices[self._index[name]]

    def manages(self, name: str) -> bool:
        return name in self._index


def shard_zero3(setup, program, params: dict[str, torch.nn.Parameter], comm: coll.Comm, modules) -> Zero3Params | None:
    """ZeRO-3 of a rank's ``params`` (name -> local shard) when the training ``setup`` asks for it: the
    managed ones sliced and emptied from every generated module of ``modules``; ``None`` otherwise."""
    if setup.zero < 3:
        return None
    zero_axes, replica_axes = zero_axes_of(setup, program.mesh)
    if not zero_axes:
        return None
    need = set(zero_axes) | set(replica_axes)
    whole = whole_gradient_params(program, zero_axes + replica_axes)
    names = [
        v.name
        for v in program.params
        if v.name in params
        and params[v.name].requires_grad
        and (need <= set(v.attrs.get("grad_sync", ())) or v.name in whole)
    ]
    zero3 = Zero3Params(params, names, comm, zero_axes, replica_axes, whole)
    for gm in modules:
        zero3.attach(gm)
    return zero3


class _Token:
    """Marks a packed saved tensor (see ``Zero3Params.saved_tensors``)."""


__all__ = ["Zero3Params", "shard_zero3"]
