"""A ParallelModule's parameters and buffers as DTensors with the plan's placements, for torch's ecosystem.

``dtensor_view(pipe)`` returns a plain ``torch.nn.Module`` holding, under every key of the user's
``model.state_dict()`` this rank's stages hold, a DTensor over the plan's DeviceMesh (its pipeline axis
sliced off: each pipeline rank's view lives on its own sub-mesh) whose local tensor *is* the shard the
generated program runs on (same storage): ``Shard(d)`` where the plan splits dim ``d`` on an axis,
``_StridedShard(d, split_factor=k)`` for an interleaved split (a fused QKV's ``S(d,k)``), ``Replicate``
elsewhere. So torch's own tools work on it:

    view = pipe.as_dtensors()
    sd = get_model_state_dict(view)            # torch.distributed.checkpoint.state_dict
    dcp.save(sd, checkpoint_id=path)           # torch's DCP layout, loadable into the plain model
    dcp.load(sd, checkpoint_id=path); set_model_state_dict(view, sd)   # writes into the live shards
    view.grads_from_shards(); torch.nn.utils.clip_grad_norm_(view.parameters(), 1.0)   # no pp axis

An in-place write through the view (``load_state_dict``, ``copy_``, an optimizer step over
``view.parameters()``) is a write to the module's shards. ZeRO-3's flat slices are no DTensor
placement: such a plan is refused (``PlanError``), as is a module without a DeviceMesh.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import PlanError
from autopar.ir.axes import is_pipeline_axis
from autopar.ir.core import Partial, Shard, Value
from autopar.runtime.build.codegen import shard_param
from autopar.runtime.build.params import register


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


class DTensorView(torch.nn.Module):
    """The user's keys as DTensors sharing storage with a ParallelModule's shards (``dtensor_view``)."""

    def __init__(self, pipe):
        super().__init__()
        if pipe.zero3 is not None and pipe.zero3.names:
            raise PlanError(
                "ZeRO-3 holds flat 1/k slices of its parameters, which no DTensor placement describes: use "
                "autopar.checkpoint or full_state_dict with zero=3, or plan with zero=1 or 2 for a DTensor view"
            )
        mesh = _sub_mesh(pipe)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (DTensor parameter, the live local shard)
        made: dict[str, torch.Tensor] = {}
        self._strided: dict[str, tuple[torch.Tensor, Value]] = {}  # key -> (local shard, value): S(d,k) keys
        self._shard = lambda full, v: shard_param(full, v.type.placements, pipe.program.mesh.names,
                                                  pipe.program.mesh.sizes, pipe.comm.coords)  # fmt: skip
        keys, unread = pipe._state if pipe._state is not None else ({n: n for n in pipe._local.tensors}, {})
        for key, name in keys.items():
            local = pipe._local.tensors.get(name)
            if local is None:  # on another pipeline rank's stages
                continue
            if name not in made:
                v = pipe._values[name]
                placements = _placements(v, pipe.program.mesh.names)
                shape = torch.Size(v.type.shape)
                stride = torch.empty(shape, device="meta").stride()
                d = DTensor.from_local(local.detach(), mesh, placements, run_check=False, shape=shape, stride=stride)
                if isinstance(local, torch.nn.Parameter):
                    d = torch.nn.Parameter(d, requires_grad=local.requires_grad)
                    self._pairs.append((d, local))
                made[name] = d
            register(self, key, made[name])
            if any(isinstance(p, _StridedShard) for p in made[name].placements):
                self._strided[key] = (local, pipe._values[name])
        for key, whole in unread.items():  # held whole on every rank, read by no program
            register(self, key, DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False))

    def state_dict(self, *args, **kwargs):
        """The DTensors by key; an interleaved shard (``_StridedShard``, which DCP's planner reads as one
        contiguous chunk and so as overlapping) comes replicated over its axis instead: a gathered copy."""
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key in self._strided:
            d = out.get(prefix + key)
            if isinstance(d, DTensor):
                plain = [Replicate() if isinstance(p, _StridedShard) else p for p in d.placements]
                out[prefix + key] = d.redistribute(d.device_mesh, plain).detach()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict`` writing into the module's shards; an interleaved key takes a
        DTensor of any placement (or a whole tensor) and keeps this rank's slices of it."""
        rest = dict(state_dict)
        for key, (local, v) in self._strided.items():
            if key in rest:
                x = rest.pop(key)
                full = x.full_tensor() if isinstance(x, DTensor) else x
                local.copy_(self._shard(full.to(local.device), v))
        result = super().load_state_dict(rest, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k not in self._strided]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}")
        return result._replace(missing_keys=missing)

    @torch.no_grad()
    def grads_from_shards(self) -> DTensorView:
        """Give each DTensor parameter the module's current gradient (same storage, synced as the module
        syncs it), so torch's ``clip_grad_norm_`` over ``parameters()`` reads and scales the real ones."""
        for d, local in self._pairs:
            g = local.grad
            d.grad = None if g is None else DTensor.from_local(g, d.device_mesh, d.placements, run_check=False,
                                                               shape=d.shape, stride=d.stride())  # fmt: skip
        return self


def dtensor_view(pipe) -> DTensorView:
    """``pipe``'s parameters and buffers as DTensors over its DeviceMesh (see the module's docstring)."""
    return DTensorView(pipe)


__all__ = ["DTensorView", "dtensor_view"]
