"""A ParallelModule's parameters, buffers and optimizer states as DTensors with the plan's placements.

``dtensor_view(pipe)`` returns a plain ``torch.nn.Module`` holding, under every key of the user's
``model.state_dict()`` this rank's stages hold, a DTensor over the plan's DeviceMesh (its pipeline axis
sliced off: each pipeline rank's view lives on its own sub-mesh): ``Shard(d)`` where the plan splits dim
``d`` on an axis, ``_StridedShard(d, split_factor=k)`` for an interleaved split (a fused QKV's ``S(d,k)``),
``Replicate`` elsewhere. Its local tensor *is* the shard the generated program runs on (same storage),
but under ZeRO-3 (``Zero3Params``: each parameter's local shard kept as a 1/k slice of its padded flat
vector over the ZeRO axes):

- a slice that is whole rows of the local shard (dim 0 divides by the ZeRO ranks, no other axis splits dim
  0) is a ``Shard(0)`` over the ZeRO axes as FSDP2 lays parameters out, sharing the slice's storage;
- any other slice has no DTensor placement: its DTensor holds a gathered copy of the local shard
  (``Replicate`` over the ZeRO axes), refreshed by ``state_dict()``, written back into the slice by
  ``load_state_dict()``; building the view gathers it (a collective over the ZeRO axes).

``view.optimizer_view(opt)`` does the same for an optimizer (``make_optimizer``'s, ZeRO-1/2's flat slices
included, or the caller's over ``pipe.parameters()``): a ``torch.optim.Optimizer`` over the view's
DTensor parameters whose states are DTensors laid out as their parameter (ZeRO-1/2's flat slices as
gathered copies: a flat vector of several parameters is no DTensor), so torch's own tools work:

    view = pipe.as_dtensors(); opt = view.optimizer_view(pipe.optimizer)
    msd, osd = get_state_dict(view, opt)       # torch.distributed.checkpoint.state_dict
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)   # torch's DCP layout, any mesh reads it
    dcp.load(...); set_state_dict(view, opt, model_state_dict=msd, optim_state_dict=osd)  # into the live ones
    view.grads_from_shards(); torch.nn.utils.clip_grad_norm_(view.parameters(), 1.0)   # no pp axis

An in-place write through the view (``load_state_dict``, ``copy_``) is a write to the module's shards;
after one, ZeRO-1/2's flat master copy of the parameters is refreshed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import CheckpointError, CheckpointMismatchError, OptimizerError, PlanError
from autopar.ir.axes import is_pipeline_axis
from autopar.ir.core import Partial, Shard, Value
from autopar.runtime.build.codegen import shard_param
from autopar.runtime.build.params import register
from autopar.runtime.grads.zero import ZeroOptimizer, gather_slices, local_slice

# how torch.optim steps, not what: loading a state dict keeps the implementation the optimizer was built with
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _placements(v: Value, names: tuple[str, ...]) -> list:
    out = []
    for p, axis in zip(v.type.placements, names):
        if is_pipeline_axis(axis):
            continue
        if isinstance(p, Shard):
            out.append(TorchShard(p.dim) if p.chunks == 1 else _StridedShard(p.dim, split_factor=p.chunks))
        elif isinstance(p, Partial):
            raise PlanError(f"{v.name} is held as a partial sum ({p}), which no parameter of a plan should be")
        else:
            out.append(Replicate())
    return out


def _sub_mesh(pipe):
    mesh = getattr(pipe, "device_mesh", None)
    if mesh is None or not hasattr(mesh, "mesh_dim_names"):
        raise PlanError(
            "this module has no DeviceMesh to build DTensors on: compile it on autopar.init_mesh(...) "
            "(or torch's init_device_mesh) in a process group, not on the rank simulator"
        )
    names = tuple(n for n in pipe.program.mesh.names if not is_pipeline_axis(n))
    if tuple(mesh.mesh_dim_names) == names:
        return mesh
    return mesh[names]


@dataclass
class _Buffer:
    """How a live tensor holds this rank's values of user tensors (``members``: program name, local-shard
    shape, offset in the flat concatenation): the local shard itself (``axes`` empty, one member), or this
    rank's slice of the members' flat concatenation padded to ``padded`` and cut over the ZeRO ``axes``
    (a ZeRO-3 parameter, a ZeRO-1/2 flat vector, and their optimizer states). ``rows``: one member whose
    slice is whole rows of its local shard (a ``Shard(0)`` view, nothing gathered)."""

    members: list[tuple[str, torch.Size, int]]
    padded: int
    comm: Any = None
    axes: tuple[str, ...] = ()
    rows: bool = False
    parts: int = field(init=False)

    def __post_init__(self) -> None:
        self.parts = math.prod(self.comm.sizes[a] for a in self.axes) if self.axes else 1

    def read(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each member's values from ``t`` (a tensor of this layout): its local shard (its rows of it for
        ``rows``), a view of ``t`` unless sliced over the ZeRO axes (then gathered: a collective over them)."""
        t = t.detach()
        if self.rows:
            ((name, shape, _),) = self.members
            return {name: t.view(shape[0] // self.parts, *shape[1:])}
        flat = gather_slices(t.reshape(-1), self.comm, self.axes) if self.axes else t.reshape(-1)
        return {n: flat[o : o + math.prod(s)].view(s) for n, s, o in self.members}

    @torch.no_grad()
    def write(self, t: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Write ``values`` (each member's, laid out as ``read`` returns them) into ``t``'s elements."""
        if self.rows or not self.axes:
            ((name, _, _),) = self.members
            t.copy_(values[name].reshape(t.shape))
            return
        flat = torch.zeros(self.padded, dtype=t.dtype, device=t.device)
        for n, s, o in self.members:
            flat[o : o + math.prod(s)] = values[n].reshape(-1)
        t.copy_(local_slice(flat, self.comm, self.axes).view_as(t))


def _rows(v: Value, plan: list, local_shape: torch.Size, zero3, names: tuple[str, ...]) -> list | None:
    """The placements of a ZeRO-3 slice that is whole rows of the local shard (``Shard(0)`` on each ZeRO
    axis, as FSDP2 lays parameters out), or ``None`` when no placement describes it."""
    axes = zero3.zero_axes
    where = [names.index(a) for a in axes]
    if not local_shape or local_shape[0] % zero3.parts or where != sorted(where):
        return None
    if any(isinstance(p, (TorchShard, _StridedShard)) and (p.dim == 0 or isinstance(p, _StridedShard)) for p in plan):
        return None  # dim 0 split by another axis first (FSDP2 would need a strided shard), or interleaved
    if any(not isinstance(plan[i], Replicate) for i in where):
        return None
    out = list(plan)
    for i in where:
        out[i] = TorchShard(0)
    return out


def _dcp_ready(d: torch.Tensor) -> torch.Tensor:
    """A DTensor as DCP can save it: an interleaved shard (``_StridedShard``, which DCP's planner reads as one
    contiguous chunk and so as overlapping) replicated over its axis instead (a gathered copy)."""
    if isinstance(d, DTensor) and any(isinstance(p, _StridedShard) for p in d.placements):
        plain = [Replicate() if isinstance(p, _StridedShard) else p for p in d.placements]
        return d.redistribute(d.device_mesh, plain).detach()
    return d


class DTensorView(torch.nn.Module):
    """The user's keys as DTensors over a ParallelModule's shards (``dtensor_view``)."""

    def __init__(self, pipe):
        super().__init__()
        mesh = _sub_mesh(pipe)
        self.__dict__["_pipe"] = pipe  # not a submodule: the view holds only its DTensors
        self._mesh = mesh
        names = tuple(n for n in pipe.program.mesh.names if not is_pipeline_axis(n))
        live_tensors = pipe.local_tensors()
        zero3 = pipe.zero3 if pipe.zero3 is not None and pipe.zero3.names else None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, _Buffer]] = []  # (DTensor parameter, live tensor, how)
        self.made: dict[str, torch.Tensor] = {}  # program name -> its DTensor (a Parameter for a parameter)
        self.plan: dict[str, list] = {}  # program name -> the plan's placements (of the local shard)
        self.buffers: dict[str, tuple[torch.Tensor, _Buffer]] = {}  # program name -> (live tensor, how it holds it)
        self._gathered: dict[str, torch.Tensor] = {}  # name -> the local tensor of a gathered copy (ZeRO-3)
        self._strided: set[str] = set()
        self._shard = lambda full, v: shard_param(full, v.type.placements, pipe.program.mesh.names,
                                                  pipe.program.mesh.sizes, pipe.comm.coords)  # fmt: skip
        keys, unread = pipe.state_keys()
        for key, name in keys.items():
            live = live_tensors.get(name)
            if live is None:  # on another pipeline rank's stages
                continue
            if name not in self.made:
                v = pipe._values[name]
                plan = _placements(v, pipe.program.mesh.names)
                local_shape = torch.Size(v.type.local_shape(pipe.program.mesh))
                placements = plan
                if zero3 is not None and zero3.manages(name):
                    rows = _rows(v, plan, local_shape, zero3, names)
                    how = _Buffer([(name, local_shape, 0)], live.numel() * zero3.parts, zero3.comm, zero3.zero_axes,
                                  rows=rows is not None)  # fmt: skip
                    placements = rows or plan
                else:
                    how = _Buffer([(name, live.shape, 0)], live.numel())
                local = how.read(live)[name]  # a view of the live tensor, or a gathered copy
                if how.axes and not how.rows:
                    self._gathered[name] = local
                d = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(v.type.shape),
                                       stride=torch.empty(v.type.shape, device="meta").stride())  # fmt: skip
                if isinstance(live, torch.nn.Parameter):
                    d = torch.nn.Parameter(d, requires_grad=live.requires_grad)
                    self._pairs.append((d, live, how))
                self.made[name], self.plan[name], self.buffers[name] = d, plan, (live, how)
                if any(isinstance(p, _StridedShard) for p in placements):
                    self._strided.add(name)
            register(self, key, self.made[name])
        self._names = {key: name for key, name in keys.items() if name in self.made}
        for key, whole in unread.items():  # held whole on every rank, read by no program
            register(self, key, DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False))

    # -- this rank's values of a user tensor --------------------------------------------------------
    def local_values(self, x: torch.Tensor, name: str, how: _Buffer) -> torch.Tensor:
        """This rank's values of user tensor ``name`` from ``x`` (a DTensor of any placement, or the whole
        tensor), laid out as ``how`` reads them: its local shard, or its rows of it (a collective over the
        mesh when ``x``'s placements are not these)."""
        d = self.made[name]
        target = d.placements if how.rows else self.plan[name]
        if isinstance(x, DTensor) and x.device_mesh == self._mesh and tuple(x.placements) == tuple(target):
            return x.to_local()
        full = x.full_tensor() if isinstance(x, DTensor) else x
        local = self._shard(full.to(d.device), self._pipe._values[name])
        if how.rows:
            local = local_slice(local.reshape(-1), how.comm, how.axes).view(d.to_local().shape)
        return local

    @torch.no_grad()
    def refresh(self) -> DTensorView:
        """Gather ZeRO-3's copies again from the live slices (``state_dict`` does it; a collective over
        the ZeRO axes when there are any)."""
        for name, local in self._gathered.items():
            live, how = self.buffers[name]
            local.copy_(how.read(live)[name])
        return self

    def state_dict(self, *args, **kwargs):
        """The DTensors by key (ZeRO-3's gathered copies refreshed first); an interleaved shard replicated
        over its axis (``_dcp_ready``)."""
        self.refresh()
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key, name in self._names.items():
            if name in self._strided and prefix + key in out:
                out[prefix + key] = _dcp_ready(out[prefix + key])
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict`` writing into the module's shards; an interleaved key or a
        ZeRO-3 gathered copy takes a DTensor of any placement (or a whole tensor) and keeps this rank's
        values of it; ZeRO-1/2's flat master copy of the parameters follows."""
        rest = dict(state_dict)
        special = [k for k, n in self._names.items() if n in self._strided or n in self._gathered]
        done: set[str] = set()
        for key in special:
            if key not in rest:
                continue
            x, name = rest.pop(key), self._names[key]
            if name in done:  # a tied tensor under its second name
                continue
            done.add(name)
            live, how = self.buffers[name]
            local = self.local_values(x, name, how)
            if name in self._gathered:
                self._gathered[name].copy_(local)
            how.write(live, {name: local})
        result = super().load_state_dict(rest, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k not in special]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}")
        if isinstance(self._pipe.optimizer, ZeroOptimizer):
            self._pipe.optimizer.refresh_master()  # ZeRO-2's flat slice holds a copy of the parameters
        return result._replace(missing_keys=missing)

    @torch.no_grad()
    def grads_from_shards(self) -> DTensorView:
        """Give each DTensor parameter the module's current gradient (same storage, synced as the module
        syncs it), so torch's ``clip_grad_norm_`` over ``parameters()`` reads and scales the real ones. Refused
        (``PlanError``) where torch's clipping would not clip the model: on a pipeline (a rank's view holds its
        stages only), under make_optimizer's ZeRO-1/2 (gradients summed at its step) and for ZeRO-3's gathered
        copies."""
        mesh = self._pipe.device_mesh
        if any(is_pipeline_axis(a) and n > 1 for a, n in zip(mesh.mesh_dim_names, mesh.shape)):
            raise PlanError(
                "a pipeline rank's view holds only its stages' parameters, so torch's clip_grad_norm_ over it would "
                "clip by those stages' norm, not the model's: clip with pipe.clip_grad_norm_ (or "
                "make_optimizer(max_grad_norm=...))"
            )
        opt = self._pipe.optimizer
        if isinstance(opt, ZeroOptimizer) and any(opt.manages(n) for n in self.made):
            raise PlanError(
                "under ZeRO-1/2 the attached optimizer sums the data-parallel gradients itself, at its step (a "
                "reduce-scatter into its flat slices), so after backward each rank holds its own unsummed gradients, "
                "not the DTensors' ones: clip with pipe.clip_grad_norm_ (or make_optimizer(max_grad_norm=...))"
            )
        gathered = [n for n in self._gathered if isinstance(self.made[n], torch.nn.Parameter)]
        if gathered:
            raise PlanError(
                f"under ZeRO-3, {len(gathered)} parameters (e.g. {gathered[0]}) are slices no DTensor placement "
                "describes: their DTensors are gathered copies, whose gradients clipping would not reach; clip "
                "with pipe.clip_grad_norm_ (or make_optimizer(max_grad_norm=...))"
            )
        for d, live, how in self._pairs:
            g = live.grad
            if g is not None and how.rows:
                g = g.view(d.to_local().shape)
            d.grad = None if g is None else DTensor.from_local(g, d.device_mesh, d.placements, run_check=False,
                                                               shape=d.shape, stride=d.stride())  # fmt: skip
        return self

    def optimizer_view(self, optimizer=None) -> DTensorOptimizer:
        """``optimizer`` (default the one ``make_optimizer`` attached) over this view's DTensor parameters,
        for torch's ``get_state_dict``/``set_state_dict`` (see the module's docstring)."""
        optimizer = optimizer if optimizer is not None else self._pipe.optimizer
        if optimizer is None:
            raise OptimizerError(
                "optimizer_view needs an optimizer: give it yours (built over pipe.parameters()) or build one "
                "with pipe.make_optimizer(...) first"
            )
        return DTensorOptimizer(self, optimizer)


class _LazyState(Mapping):
    """``DTensorOptimizer.state``: each view parameter's states, built when read (gathered for a slice)."""

    def __init__(self, owner: DTensorOptimizer):
        self._owner = owner

    def _params(self) -> list[torch.Tensor]:
        o = self._owner
        return [o._view.made[n] for e in o._entries if o._inner.state.get(e[1]) for n, _, _ in e[2].members]

    def __len__(self) -> int:
        return len(self._params())

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params())

    def __getitem__(self, d: torch.Tensor) -> dict[str, Any]:
        o = self._owner
        for e in o._entries:
            for n, _, _ in e[2].members:
                if o._view.made[n] is d:
                    return o._entry_states(e)[n]
        raise KeyError(d)


class DTensorOptimizer(torch.optim.Optimizer):
    """A ParallelModule's optimizer seen over a ``DTensorView``'s parameters (``DTensorView.optimizer_view``):
    ``param_groups`` (the optimizer's groups, their hyper-parameters read from it), ``state`` and
    ``state_dict()`` (DTensors laid out as their parameters), ``load_state_dict`` (into the optimizer's own
    states, which it creates when the optimizer has not stepped yet). It carries state; it does not train:
    ``step()`` only serves torch's state initialization (``_init_optim_state``: zero gradients, lr 0) and
    steps the module's optimizer once with zero gradients; train with the module's optimizer."""

    def __init__(self, view: DTensorView, optimizer):
        # torch.optim.Optimizer.__init__ is not called: the module's optimizer holds the groups and states
        self._view, self._outer = view, optimizer
        self._inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
        pipe = view._pipe
        by_id = {id(t): n for n, t in pipe.local_tensors().items()}
        flats = {id(f.master): f for f in optimizer.flats if f.params} if isinstance(optimizer, ZeroOptimizer) else {}
        self._entries: list[tuple[int, torch.Tensor, _Buffer, dict[str, list]]] = []
        for gi, group in enumerate(self._inner.param_groups):
            for p in group["params"]:
                if id(p) in flats:
                    f, members, off = flats[id(p)], [], 0
                    for n, q in zip(f.names, f.params):
                        members.append((n, q.shape, off))
                        off += q.numel()
                    how = _Buffer(members, f.padded, optimizer.comm, optimizer.zero_axes)
                    where = {n: view.plan[n] for n, _, _ in members}
                elif id(p) in by_id and by_id[id(p)] in view.buffers:
                    n = by_id[id(p)]
                    how = view.buffers[n][1]
                    where = {n: list(view.made[n].placements)}
                else:
                    raise CheckpointError(
                        "the optimizer holds a tensor that is not a parameter of this module: build it over "
                        "pipe.parameters() or with pipe.make_optimizer"
                    )
                self._entries.append((gi, p, how, where))
        self._real_index: list[int] = []  # view group -> the optimizer's group
        self.param_groups: list[dict[str, Any]] = []
        for gi, group in enumerate(self._inner.param_groups):
            params = [view.made[n] for e in self._entries if e[0] == gi for n, _, _ in e[2].members]
            if params:  # a group holding none of this (pipeline) rank's parameters is left out
                self._real_index.append(gi)
                self.param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        self.defaults = self._inner.defaults

    @property
    def state(self) -> _LazyState:  # type: ignore[override]
        return _LazyState(self)

    def __repr__(self) -> str:
        return f"DTensorOptimizer({self._outer!r})"

    def _refresh_groups(self) -> None:
        for g, gi in zip(self.param_groups, self._real_index):
            g.update({k: v for k, v in self._inner.param_groups[gi].items() if k != "params"})

    def _entry_states(self, entry) -> dict[str, dict[str, Any]]:
        """Each member's states of one optimizer parameter: tensors as DTensors laid out as the member's
        parameter (views of the states, or gathered copies of a slice's)."""
        _, p, how, where = entry
        out: dict[str, dict[str, Any]] = {n: {} for n, _, _ in how.members}
        values = self._view._pipe._values
        for s, value in self._inner.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for n, local in how.read(value).items():
                    shape = torch.Size(values[n].type.shape)
                    out[n][s] = DTensor.from_local(local, self._view._mesh, where[n], run_check=False, shape=shape,
                                                   stride=torch.empty(shape, device="meta").stride())  # fmt: skip
            else:
                for n in out:
                    out[n][s] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (states by parameter index, ``param_groups`` with their indices)
        over the view's parameters; an interleaved state replicated over its axis (``_dcp_ready``)."""
        self._refresh_groups()
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for d in g["params"]:
                index[id(d)] = len(index)
                ids.append(index[id(d)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state: dict[int, dict[str, Any]] = {}
        for entry in self._entries:
            for n, states in self._entry_states(entry).items():
                if states:
                    state[index[id(self._view.made[n])]] = {k: _dcp_ready(v) for k, v in states.items()}
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Write ``state_dict`` (``state_dict()``'s form; its parameters matched to this view's by position,
        as torch's optimizers do; states DTensors of any placement) into the module's optimizer: its states
        (made when it has none yet) and its hyper-parameters (not its implementation: ``IMPLEMENTATION_KEYS``)."""
        saved_groups = state_dict["param_groups"]
        mine = [d for g in self.param_groups for d in g["params"]]
        ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_groups) != len(self.param_groups) or len(ids) != len(mine):
            raise CheckpointMismatchError(
                f"the optimizer state dict has {len(saved_groups)} parameter groups of {len(ids)} parameters, this "
                f"optimizer {len(self.param_groups)} of {len(mine)}: build the optimizer with the same groups"
            )
        saved = {id(d): state_dict["state"].get(i) or {} for i, d in zip(ids, mine)}
        for _, p, how, _ in self._entries:
            per = {n: saved[id(self._view.made[n])] for n, _, _ in how.members}
            first = per[how.members[0][0]]
            if not any(per.values()):
                continue
            state = self._inner.state[p]
            for s, value in first.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    missing = [n for n in per if s not in per[n]]
                    if missing:
                        raise CheckpointMismatchError(f"the optimizer state dict has no {s!r} for {missing[0]}")
                    local = {n: self._view.local_values(per[n][s], n, how) for n in per}
                    t = state.get(s)
                    if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                        t = state[s] = torch.zeros_like(p, dtype=value.dtype)
                    how.write(t, local)
                elif isinstance(value, torch.Tensor):  # a scalar state (Adam's step), the same for every member
                    whole = value.full_tensor() if isinstance(value, DTensor) else value
                    t = state.get(s)
                    if isinstance(t, torch.Tensor) and t.shape == whole.shape:
                        t.copy_(whole)
                    else:
                        state[s] = whole.detach().clone()
                else:
                    state[s] = value
        for g, gi in zip(saved_groups, self._real_index):
            self._inner.param_groups[gi].update(
                {k: v for k, v in g.items() if k not in ("params", *IMPLEMENTATION_KEYS)}
            )
        self._refresh_groups()

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        """torch's state initialization (``get_state_dict``/``set_state_dict`` on an optimizer that has not
        stepped): the module's optimizer steps once with zero gradients at this view's hyper-parameters (lr
        0 there), its own gradients kept. Anything else is refused: train with the module's optimizer."""
        if closure is not None:
            raise TypeError("DTensorOptimizer.step takes no closure")
        views = [d for g in self.param_groups for d in g["params"]]
        if any(d.grad is not None and bool(d.grad.to_local().any()) for d in views):
            raise OptimizerError(
                "DTensorOptimizer carries the module optimizer's state for torch's state dicts; it does not train: "
                "step the module's optimizer (pipe.train_step, or the optimizer itself after backward)"
            )
        saved = [(p, p.grad) for g in self._inner.param_groups for p in g["params"]]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self._inner.param_groups]
        try:
            for p, _ in saved:
                p.grad = torch.zeros_like(p)
            for g, gi in zip(self.param_groups, self._real_index):
                self._inner.param_groups[gi].update({k: v for k, v in g.items() if k != "params"})
            self._inner.step()
        finally:
            for p, grad in saved:
                p.grad = grad
            for g, h in zip(self._inner.param_groups, hyper):
                g.update(h)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The view's gradients only (``grads_from_shards`` made them; the module's own are its optimizer's)."""
        for g in self.param_groups:
            for d in g["params"]:
                d.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("a DTensorOptimizer's groups are its module optimizer's: give them to make_optimizer")


def dtensor_view(pipe) -> DTensorView:
    """``pipe``'s parameters and buffers as DTensors over its DeviceMesh (see the module's docstring)."""
    return DTensorView(pipe)


__all__ = ["DTensorOptimizer", "DTensorView", "dtensor_view"]
