"""Where a rank's parameters come from and where they live: whole values, local shards, the user's names.

``value_source`` gives a tensor's whole value by name: the model's own tensor, or for a model built on
the meta device its deterministic initialization (``autopar.runtime.build.init_weights``), so a rank materializes
only its shards. ``LocalTensors`` slices each value the rank's programs read once into this rank's
shard and registers it on the runtime module under the user's name (``register``), shared by every
generated module of the rank. ``state_keys`` maps every key of the user's ``model.state_dict()`` to
the program value holding it (tied names to one value), and keeps whole the few tensors no program
reads, so the whole model can be exported key for key.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.errors import PipelineError
from autopar.ir.core import MeshSpec, Value
from autopar.passes.capture import Captured
from autopar.runtime.build.codegen import shard_param
from autopar.runtime.build.init_weights import init_value


def value_source(model: torch.nn.Module, captured: Captured, seed: int) -> Callable[[str], torch.Tensor]:
    """name -> whole value: the model's own tensor, or for a meta-device model its deterministic init."""
    named = _named(model)
    constants = dict(captured.exported.constants.items())

    def get(name: str) -> torch.Tensor:
        t = named.get(name)
        if t is None:
            t = constants.get(name)
            if t is None:
                raise PipelineError(f"the program reads {name}, which the model does not have")
            if t.device.type == "meta":
                raise PipelineError(f"the constant {name} was captured on the meta device; build the model on the CPU")
            return t
        if t.device.type == "meta":
            return init_value(model, name, seed)
        return t

    return get


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def state_keys(
    model: torch.nn.Module, read: set[str], get_value: Callable[[str], torch.Tensor]
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(every key of ``model.state_dict()`` -> the name of the program value ``read`` holding the same
    tensor, whole values of the keys no program reads)."""
    named = _named(model)
    by_id = {id(named[n]): n for n in read if n in named}
    keys: dict[str, str] = {}
    unread: dict[str, torch.Tensor] = {}
    for key in model.state_dict(keep_vars=True):
        t = named.get(key)
        name = by_id.get(id(t)) if t is not None else None
        if name is not None:
            keys[key] = name
        else:
            unread[key] = get_value(key).detach().clone()
    return keys, unread


class LocalTensors:
    """name -> this rank's local shard, made once and registered on ``root`` under the user's name."""

    def __init__(
        self,
        root: torch.nn.Module,
        get_value: Callable[[str], torch.Tensor],
        mesh: MeshSpec,
        coords: dict[str, int],
        device: torch.device,
    ):
        self.root, self.get_value, self.mesh, self.coords, self.device = root, get_value, mesh, coords, device
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, v: Value) -> torch.Tensor:
        if v.name not in self.tensors:
            full = self.get_value(v.name)
            local = shard_param(full, v.type.placements, self.mesh.names, self.mesh.sizes, self.coords)
            local = local.detach().to(self.device).clone().contiguous()
            del full
            if v.kind == "param":
                local = torch.nn.Parameter(local, requires_grad=v.type.is_float and not v.attrs.get("frozen"))
            self.tensors[v.name] = local
            register(self.root, v.name, local)
        return self.tensors[v.name]

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return {n: t for n, t in self.tensors.items() if isinstance(t, torch.nn.Parameter)}


def register(root: torch.nn.Module, qualname: str, t: torch.Tensor) -> None:
    """Put ``t`` at ``qualname`` under ``root`` (a parameter if it is one, else a buffer), making the
    intermediate modules; replaces what is there."""
    *path, attr = qualname.split(".")
    mod = root
    for p in path:
        if p not in mod._modules:
            mod.add_module(p, torch.nn.Module())
        mod = mod._modules[p]
    mod._parameters.pop(attr, None)
    mod._buffers.pop(attr, None)
    if isinstance(t, torch.nn.Parameter):
        mod.register_parameter(attr, t)
    else:
        mod.register_buffer(attr, t)


def lookup(root: torch.nn.Module, qualname: str) -> torch.Tensor:
    """The parameter or buffer at ``qualname`` under ``root``."""
    *path, attr = qualname.split(".")
    mod = root
    for p in path:
        mod = mod._modules[p]
    if attr in mod._parameters:
        return mod._parameters[attr]
    return mod._buffers[attr]


__all__ = ["LocalTensors", "lookup", "register", "state_keys", "value_source"]
