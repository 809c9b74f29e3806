"""Save and resume training with torch.distributed.checkpoint (DCP), on every mesh.

Every rank writes its local shards under keys that name the shard, not the rank:

    model/transformer.h.0.attn.c_attn.weight|tp=1/2      a parameter sharded over tp (coordinate 1 of 2)
    model/transformer.ln_f.weight                        replicated: every replica writes the same key
    optim/transformer.ln_f.weight/exp_avg                the optimizer state of a parameter
    optim/zero.flat|dp=0/2/exp_avg_sq                    ZeRO-2: this rank's slice of the flat states
    optim.param_groups, extra                            hyper-parameters and the caller's objects

Replicas (data-parallel copies, and a tied parameter held by two pipeline ranks) write identical
values under one key; DCP's planner keeps one writer per key. A ZeRO-3 slice names its ZeRO axes
too. ``load`` reads back exactly the keys this rank owns, so resuming gives the numbers an
uninterrupted run would have (the optimizer's step counts and moments included). A checkpoint is for
the same model, mesh and plan: a mesh change would need resharding by global offsets, which these
shard-named keys do not describe.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from autopar.errors import PipelineError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.runtime.zero import ZeroOptimizer


def _optimizer_keys(pipe, optimizer) -> list[str]:
    """A checkpoint key for each parameter of ``optimizer``, in its param_groups order."""

    local = pipe.local_keys()
    by_id = {id(p): local[n] for n, p in pipe.named_parameters()}
    inner = optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer
    keys = []
    for group in inner.param_groups:
        for p in group["params"]:
            if isinstance(optimizer, ZeroOptimizer) and optimizer.flat_name(p) is not None:
                # the flat vector holds this pipeline rank's parameters: its key names the pipeline rank
                c, n = optimizer.comm.coords, optimizer.comm.sizes
                axes = tuple(a for a in (PIPELINE_AXIS, *optimizer.zero_axes) if a in c)
                keys.append(f"{optimizer.flat_name(p)}|" + ",".join(f"{a}={c[a]}/{n[a]}" for a in axes))
            elif id(p) in by_id:
                keys.append(by_id[id(p)])
            else:
                raise PipelineError("the optimizer holds a tensor that is not a parameter of this pipeline")
    return keys


def state_dict(pipe, optimizer=None, extra: Any = None) -> dict[str, Any]:
    """The flat dict ``save`` writes: local shards, optimizer states, hyper-parameters, ``extra``."""
    out: dict[str, Any] = {}
    for name, key in pipe.local_keys().items():
        out[f"model/{key}"] = _tensor(pipe, name)
    if optimizer is not None:
        sd = optimizer.state_dict()
        keys = _optimizer_keys(pipe, optimizer)
        for i, key in enumerate(keys):
            for k, v in sd["state"].get(i, {}).items():
                out[f"optim/{key}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
        out["optim.param_groups"] = _pack([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])
    if extra is not None:
        out["extra"] = _pack(extra)
    return out


def _pack(obj: Any) -> torch.Tensor:
    """A picklable object as a flat byte tensor (DCP would otherwise flatten nested containers)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpack(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())  # noqa: S301 - a checkpoint this code wrote


def _tensor(pipe, name: str) -> torch.Tensor:
    mod = pipe
    *path, attr = name.split(".")
    for p in path:
        mod = mod._modules[p]
    t = mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]
    return t.detach()


def save(path: str | os.PathLike, pipe, optimizer=None, extra: Any = None) -> None:
    """Write a checkpoint of ``pipe`` (and ``optimizer``, and any picklable ``extra``) to ``path``;
    collective over every rank."""
    dcp.save(state_dict(pipe, optimizer, extra), checkpoint_id=os.fspath(path))


@torch.no_grad()
def load(path: str | os.PathLike, pipe, optimizer=None) -> Any:
    """Restore ``pipe``'s shards (and ``optimizer``'s states) from ``path`` in place; returns ``extra``.
    Collective over every rank."""

    path = os.fspath(path)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd: dict[str, Any] = {}
    for name, key in pipe.local_keys().items():
        if f"model/{key}" not in meta:
            raise PipelineError(
                f"the checkpoint at {path} has no {key}: it was written for another model, mesh or plan"
            )
        sd[f"model/{key}"] = _tensor(pipe, name)
    keys: list[str] = []
    if optimizer is not None:
        keys = _optimizer_keys(pipe, optimizer)
        for key in keys:
            prefix = f"optim/{key}/"
            for k, m in meta.items():
                if k.startswith(prefix) and hasattr(m, "size"):
                    sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    for key in ("optim.param_groups", "extra") if optimizer is not None else ("extra",):
        if key in meta:
            sd[key] = torch.empty(tuple(meta[key].size), dtype=torch.uint8)
    dcp.load(sd, checkpoint_id=path)
    if optimizer is not None:
        current = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for i, key in enumerate(keys):
            prefix = f"optim/{key}/"
            entry = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
            if entry:
                state[i] = entry
        groups = current["param_groups"]
        saved = _unpack(sd["optim.param_groups"]) if "optim.param_groups" in sd else []
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.refresh_master()
    return _unpack(sd["extra"]) if "extra" in sd else None


__all__ = ["load", "save", "state_dict"]
