"""ZeRO-3: each rank keeps 1/k of the data-parallel-replicated parameters, gathered one unit at a time.

A managed parameter (the same set ``ZeroOptimizer`` manages: trainable, replicated over the ZeRO and
replica axes, its gradient summed over all of them or already whole on every rank) is flattened,
padded to a multiple of k (the product of the ZeRO axes' sizes) and cut into k equal slices, one
after the other over the ZeRO axes (slices of slices, as ``ZeroOptimizer``); the rank keeps its slice
as a ``torch.nn.Parameter``. The parameters are grouped in units (``solver/sharding/blocks.py``: one per
repeated block, plus the root), FSDP2's ``fully_shard`` per block:

- **forward**: ``runtime/grads/unit_gathers.py`` puts a ``gather(u, next)`` before the first reader of unit
  ``u`` in every generated module: one all-gather of the unit's slices (concatenated), copied out into
  the unit's whole parameters (``_GatherUnit``), and the asynchronous all-gather of the next unit
  issued before ``u`` computes; ``release`` after its last reader. At most the root and two blocks
  are whole at once (the one computing, the one arriving).
- **across nodes** (a ZeRO group spanning nodes, ranks per node from ``RuntimeOptions.ranks_per_node`` or
  torchrun's ``LOCAL_WORLD_SIZE``): the gather runs as MiCS's, inter-node among one rank per node first (the
  asynchronous part), then inside the node, the rows laid out by a view (bit for bit the flat gather's); the
  gradient's reduce-scatter mirrored, inside the node first (``runtime/grads/node_gather.py``).
- **saved for backward**: inside ``scope()`` a tensor the forward saves that lies in a gathered unit's
  storage is packed as a token (unit, size, stride, offset); any other goes to the saved-tensor hooks in
  force around the scope (they would otherwise never see it: only the innermost hooks run). In the
  backward the first token of a unit gathers the unit again (or takes its prefetch), frees the unit
  gathered before it and issues the gather of the unit the forward read before it; the autograd engine
  unpacks in the same order on every rank, so the collectives match.
- **mixed precision**: the compute-dtype copies of a unit's parameters (``cast_to``, made just after its
  gather, ``unit_gathers.py``) are handed to ``release``, which notes their storages; a saved copy (or a view
  of one) is packed as a token too, and unpacked as the unit gathered again, cast again (once per backward
  unit): the same bits, so no copy is held from the forward to the backward (FSDP2's
  ``reshard_after_forward``). ``cast_again = False`` lets autograd save the copies themselves (a test's
  reference).
- **backward of the gather**: when every gradient of a unit is in, the unit's gradient is
  reduce-scattered in one collective (``reduce_scatter_single``, on gloo too), asynchronously, while
  the backward goes on (a ``whole``
  parameter's gradient, equal on every rank, counts once: ranks off coordinate 0 send zeros), then
  all-reduced across the replica axes (MiCS's hop 2); the end of the backward waits for them and adds
  the slices into ``.grad`` (running the slices' post-accumulate hooks, as AccumulateGrad would):
  ``runtime/grads/unit_grads.py``.

``LiveBytes`` counts the gathered bytes alive; ``peak_gathered`` is their most since ``reset_peak``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.runtime.build.precision import cast_to
from autopar.runtime.comm.context import Comm
from autopar.runtime.grads.node_gather import NodeGroups, node_groups
from autopar.runtime.grads.unit_gathers import LiveBytes, place_gathers
from autopar.runtime.grads.unit_grads import Unit, UnitGrads, free_storage
from autopar.runtime.grads.zero import gather_slices, local_slice, whole_gradient_params, zero_axes_of
from autopar.solver.sharding.blocks import param_units


@dataclass
class _Pass:
    """One forward (a scope): the units whose tokens it saved, in order, for the backward's prefetch."""

    order: list[int] = field(default_factory=list)

    def saw(self, u: int) -> None:
        if u not in self.order:
            self.order.append(u)

    def before(self, u: int) -> int:
        i = self.order.index(u) if u in self.order else 0
        return self.order[i - 1] if i > 0 else -1


class _GatherUnit(torch.autograd.Function):
    """slices of a unit -> its whole parameters; backward: their gradients -> reduce-scatter (async)."""

    @staticmethod
    def forward(ctx: Any, owner: Zero3Params, u: int, *slices: torch.Tensor):
        ctx.owner, ctx.u = owner, u
        whole = owner._take(u)
        return owner._views(u, whole)

    @staticmethod
    def backward(ctx: Any, *grads):
        ctx.owner._scatter(ctx.u, grads)
        return (None, None) + (None,) * len(grads)


class Zero3Params:
    """This rank's slices of the managed parameters ``names`` of ``params`` (name -> local shard),
    gathered by ``units`` (lists of names; default one unit of all)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        names: list[str],
        comm: Comm,
        zero_axes: tuple[str, ...],
        replica_axes: tuple[str, ...] = (),
        whole: set[str] | frozenset[str] = frozenset(),
        units: list[tuple[str, list[str]]] | None = None,
        node_groups: NodeGroups | None = None,
    ):
        self.comm = comm
        self.node_groups = node_groups  # the ZeRO group gathered hierarchically across nodes (node_gather.py)
        self.zero_axes, self.replica_axes = tuple(zero_axes), tuple(replica_axes)
        self.parts = math.prod(comm.sizes[a] for a in self.zero_axes)
        self.names = list(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.whole = [n in whole for n in self.names]
        self.shapes: list[torch.Size] = []
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
        self.units = [self._layout(label, members) for label, members in (units or [("all", self.names)])]
        self.unit_of = {self.names[i]: u for u, unit in enumerate(self.units) for i in unit.params}
        self.gathered_bytes = LiveBytes()
        self._live: dict[int, int] = {}  # storage data_ptr of a unit gathered in a forward -> the unit
        # storage data_ptr of a compute-dtype copy of a gathered parameter -> (its storage, unit, index, dtype)
        self._copies: dict[int, tuple[StorageWeakRef, int, int, torch.dtype]] = {}
        # False: autograd saves the copies themselves, held to the backward (the same bits, more memory)
        self.cast_again = True
        self._pending: dict[int, tuple] = {}  # unit -> its gather in flight (a prefetch)
        self._grads = UnitGrads(
            comm, self.zero_axes, self.replica_axes, self.parts, self.units, self.slices, self.whole, node_groups
        )
        self._cache: dict[int, torch.Tensor] = {}  # the backward's gathered units
        self._cast: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # the backward's copies of their parameters
        self._current = -1  # the unit the backward works in
        self._depth = 0  # scopes entered
        self._pass: _Pass | None = None
        self._queued = False

    def _layout(self, label: str, members: list[str]) -> Unit:
        idx = [self._index[n] for n in members]
        lens = [self.slices[i].numel() for i in idx]
        offs = [sum(lens[:j]) for j in range(len(idx))]
        return Unit(label, idx, lens, offs, [o * self.parts for o in offs], sum(lens))

    def attach(self, module: torch.fx.GraphModule) -> None:
        """Empty ``module``'s attribute of every managed parameter it holds, and place the gathers and
        frees of its units in its graph (``runtime/grads/unit_gathers.py``)."""
        for name in self.names:
            path, _, attr = name.rpartition(".")
            try:
                owner = module.get_submodule(path) if path else module
            except AttributeError:
                continue
            if attr in owner._parameters:
                del owner._parameters[attr]
                setattr(owner, attr, None)
        place_gathers(module, self.unit_of, self._gather_unit, self._release_unit, self._members)

    def _members(self, u: int) -> list[str]:
        return [self.names[i] for i in self.units[u].params]

    # -- gathering one unit ----------------------------------------------------------------------
    def _start(self, u: int) -> tuple:
        """Issue the all-gather of unit ``u``'s slices (asynchronously): across the nodes among the ranks of this
        rank's local index when the group is gathered hierarchically (``runtime/grads/node_gather.py``), else over
        the innermost ZeRO axis."""
        unit = self.units[u]
        local = torch.cat([self.slices[i].detach().reshape(-1) for i in unit.params])
        if self.node_groups is not None:
            n, group = self.node_groups.nodes, self.node_groups.inter
        else:
            a = self.zero_axes[-1]
            n, group = self.comm.sizes[a], self.comm.groups[a]
        out = torch.empty(n * unit.width, dtype=local.dtype, device=local.device)
        self.gathered_bytes.add(out)
        work = dist.all_gather_single(out, local, group=group, async_op=True)
        return u, out, work, local

    def _finish(self, pending: tuple) -> torch.Tensor:
        """Wait for a gather, gather inside the node (hierarchical) or over the outer ZeRO axes, and lay the
        parameters out one after the other (rows in member order: the hierarchical gather's through a view)."""
        u, out, work, local = pending
        work.wait()
        unit = self.units[u]
        h = self.node_groups
        if h is not None:
            gathered = torch.empty(self.parts * unit.width, dtype=out.dtype, device=out.device)
            dist.all_gather_single(gathered, out, group=h.intra)
            rows = h.gathered_rows(gathered, unit.width)  # (node, local index, width)
        else:
            gathered = gather_slices(out, self.comm, self.zero_axes[:-1])
            rows = gathered.view(1, self.parts, unit.width)
        whole = torch.empty(self.parts * unit.width, dtype=out.dtype, device=out.device)
        for n, so, wo in zip(unit.slice_len, unit.slice_off, unit.whole_off):
            whole[wo : wo + n * self.parts].view(*rows.shape[:2], n).copy_(rows[..., so : so + n])
        if gathered is not out:
            free_storage(gathered)
        free_storage(local)
        self.gathered_bytes.drop(out)
        free_storage(out)  # now: the finished collective may still hold a reference to it (FSDP2 frees the same way)
        self.gathered_bytes.add(whole)
        return whole

    def _take(self, u: int) -> torch.Tensor:
        """Unit ``u`` whole: its prefetch, else gathered now."""
        pending = self._pending.pop(u, None)
        return self._finish(pending if pending is not None else self._start(u))

    def _prefetch(self, u: int) -> None:
        if u >= 0 and u not in self._pending and u not in self._cache:
            self._pending[u] = self._start(u)

    def _views(self, u: int, whole: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unit = self.units[u]
        return tuple(
            whole[wo : wo + math.prod(self.shapes[i])].view(self.shapes[i])
            for i, wo in zip(unit.params, unit.whole_off)
        )

    # -- the forward (called by the nodes place_gathers puts in the graph) ------------------------
    def _gather_unit(self, u: int, nxt: int) -> tuple[torch.Tensor, ...]:
        outs = _GatherUnit.apply(self, u, *(self.slices[i] for i in self.units[u].params))
        self._live[outs[0].untyped_storage().data_ptr()] = u
        self._prefetch(nxt)
        return outs

    def _release_unit(self, gathered: tuple, copies: tuple = ()) -> None:
        u = self._live.pop(gathered[0].untyped_storage().data_ptr(), None)
        for j, c in copies if u is not None and self.cast_again else ():  # mixed precision's copies
            s = c.untyped_storage()
            self._copies[s.data_ptr()] = (StorageWeakRef(s), u, j, c.dtype)
            self.gathered_bytes.add(c)

    @contextlib.contextmanager
    def scope(self):
        """One forward, recomputation or backward of a stage: saved parameters become tokens; the
        prefetches and the backward's gathered units are dropped at the end."""
        self._depth += 1
        outer = self._pass
        self._pass = _Pass()
        try:
            with self.saved_tensors():
                yield
        finally:
            self._pass = outer
            self._depth -= 1
            if not self._depth:
                self._drop()

    def _drop(self) -> None:
        for pending in self._pending.values():
            pending[2].wait()  # no collective left behind
        self._pending.clear()
        self._cache.clear()
        self._cast.clear()
        self._current = -1
        self._live.clear()  # a forward stopped by an error released nothing: its addresses must not match later
        self._copies.clear()

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks packing a saved tensor that is (a view of) a gathered unit as a token; every other saved
        tensor goes to the hooks that were in force outside (a user's ``save_on_cpu``, a counter of saved
        bytes, an outer scope): only the innermost hooks run, so these hand on what they do not keep."""
        fwd = self._pass
        # the enclosing (pack, unpack), or None; torch's own functorch reads the stack the same way
        outer_pack, outer_unpack = torch._C._autograd._top_saved_tensors_default_hooks(True) or (_same, _same)

        def pack(t: torch.Tensor):
            held = self._live or self._copies
            if fwd is not None and held and t.layout == torch.strided and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                u = self._live.get(ptr)
                if u is not None:
                    fwd.saw(u)
                    return (_Token, fwd, u, t.size(), t.stride(), t.storage_offset())
                copy = self._copies.get(ptr)
                if copy is not None and not copy[0].expired():
                    _, u, j, dtype = copy
                    fwd.saw(u)
                    return (_Token, fwd, (u, j, dtype), t.size(), t.stride(), t.storage_offset())
            return outer_pack(t)

        def unpack(x):
            if isinstance(x, tuple) and x and x[0] is _Token:
                _, p, u, size, stride, offset = x
                if isinstance(u, tuple):  # a copy: cast again from the unit gathered again
                    return self._backward_copy(p, *u).as_strided(size, stride, offset)
                return self._backward_unit(p, u).as_strided(size, stride, offset)
            return outer_unpack(x)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    # -- the backward -----------------------------------------------------------------------------
    def _backward_unit(self, p: _Pass, u: int) -> torch.Tensor:
        """Unit ``u`` whole for the backward; the unit before stays gathered no longer, and the unit the
        forward read before ``u`` starts travelling."""
        self._after_backward()
        if u in self._cache:
            return self._cache[u]
        self._forget(self._current)
        with torch.no_grad():
            self._cache[u] = self._take(u)
        self._current = u
        self._prefetch(p.before(u))
        return self._cache[u]

    def _backward_copy(self, p: _Pass, u: int, j: int, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``j`` of unit ``u`` in ``dtype`` for the backward: cast (once) from the unit gathered again,
        as the forward cast it (the same bits)."""
        whole = self._backward_unit(p, u)
        key = (u, j, dtype)
        if key not in self._cast:
            with torch.no_grad():
                self._cast[key] = cast_to(self._views(u, whole)[j], dtype)
            self.gathered_bytes.add(self._cast[key])
        return self._cast[key]

    def _forget(self, u: int) -> None:
        """Unit ``u`` and its copies gathered for the backward no longer."""
        self._cache.pop(u, None)
        for key in [k for k in self._cast if k[0] == u]:
            del self._cast[key]

    def _scatter(self, u: int, grads: tuple) -> None:
        """Start reduce-scattering unit ``u``'s gradients (``runtime/grads/unit_grads.py``)."""
        self._after_backward()
        self._forget(u)  # every reader of the unit has run
        self._grads.start(u, grads)

    def _after_backward(self) -> None:
        """Queue ``_end_backward`` once per backward (called from inside the autograd engine)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._queued = False
        self._grads.finish()
        if not self._depth:
            self._drop()

    def peak_gathered(self) -> int:
        """The most bytes of gathered parameters alive at once since ``reset_peak``."""
        return self.gathered_bytes.peak

    def reset_peak(self) -> None:
        self.gathered_bytes.reset_peak()

    def unit_bytes(self) -> list[tuple[str, int]]:
        """(label, bytes of the unit's whole parameters as gathered) of every unit."""
        return [
            (unit.label, unit.width * self.parts * self.slices[unit.params[0]].element_size()) for unit in self.units
        ]

    # -- whole values ---------------------------------------------------------------------------
    @torch.no_grad()
    def whole_value(self, name: str, grad: bool = False) -> torch.Tensor:
        """Parameter ``name`` (its gradient with ``grad``: zeros where none) gathered whole over the
        ZeRO axes (a collective: call on every rank)."""
        i = self._index[name]
        piece = self.slices[i]
        if grad:
            piece = piece.grad if piece.grad is not None else torch.zeros_like(piece)
        return gather_slices(piece.detach(), self.comm, self.zero_axes)[: math.prod(self.shapes[i])].view(
            self.shapes[i]
        )

    def slice_of(self, name: str) -> torch.nn.Parameter:
        return self.slices[self._index[name]]

    def manages(self, name: str) -> bool:
        return name in self._index


def shard_zero3(
    setup, program, params: dict[str, torch.nn.Parameter], comm: Comm, modules, per_node: int | None = None, mesh=None
) -> Zero3Params | None:
    """ZeRO-3 of a rank's ``params`` (name -> local shard) when the training ``setup`` asks for it: the
    managed ones sliced, grouped in units by the program's repeated blocks (``solver/sharding/blocks.py``), and
    gathered unit by unit in every generated module of ``modules``; ``None`` otherwise. ``per_node``: the ranks each
    node runs (``node_gather.ranks_per_node``; given only where ``setup.hierarchical_gather``, else None: flat), with
    ``mesh`` (the DeviceMesh; None: row-major) for the hierarchical gathers of a group spanning nodes."""
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
    hier = node_groups(comm, zero_axes, per_node, mesh)
    zero3 = Zero3Params(params, names, comm, zero_axes, replica_axes, whole, param_units(program, names), hier)
    for gm in modules:
        zero3.attach(gm)
    return zero3


class _Token:
    """Marks a packed saved tensor (see ``Zero3Params.saved_tensors``)."""


def _same(x):
    return x


__all__ = ["Zero3Params", "shard_zero3"]
