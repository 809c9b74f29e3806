"""Save training on one mesh and resume it on any other, with torch.distributed.checkpoint (DCP).

A checkpoint is laid out as the user's model, never as the mesh that saved it
(``runtime/checkpoint/state_pieces.py``): ``model/<key>`` for each key of ``model.state_dict()`` (a tied
parameter once, under its first name) and ``optim/<key>/<state>`` for its optimizer state, in the
parameter's own shape. Every rank writes the pieces it holds at their global offsets (a local shard,
a strided shard's pieces, a ZeRO-3 slice, ZeRO-2's states cut back per parameter; replicas write
once), and on load reads exactly the saved chunks that overlap what it holds on the new mesh
(``runtime/checkpoint/pieces.py``): nothing is gathered on one rank.

Everything else is JSON in the manifest ``autopar.json`` (``runtime/checkpoint/jsonstate.py``; nothing is
pickled): the optimizer's hyper-parameters, the learning-rate scheduler's state, the caller's
``Stateful`` objects (a data loader's position), a JSON ``extra``, the keyed dropouts' step, the
model's keys and shapes, and each file's size and SHA-256. A save writes to a staging folder, commits
it by writing the manifest and only then replaces the checkpoint at its path (``runtime/checkpoint/files.py``):
an interrupted save is no checkpoint and loses none, ``latest(root)`` returns the last whole one, and
``load`` refuses a checkpoint of another model, a missing, truncated or altered file, or pickled
objects, each with its own ``CheckpointError``.

    checkpoint.save(f"ckpt/step-{step}", pipe, opt, lr_scheduler=sched, objects={"data": loader}, step=step)
    ...  # any mesh, any plan of the same model, any number of processes
    extra = checkpoint.load(checkpoint.latest("ckpt"), pipe, opt, lr_scheduler=sched, objects={"data": loader})
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from autopar.errors import CheckpointError, CheckpointMismatchError
from autopar.runtime.checkpoint.files import (
    SafeReader,
    begin,
    commit,
    latest,
    publish,
    read_manifest,
    resolve,
    verify,
)
from autopar.runtime.checkpoint.jsonstate import decode, encode
from autopar.runtime.checkpoint.objects import checkpointable
from autopar.runtime.checkpoint.pieces import Pieces
from autopar.runtime.checkpoint.state_pieces import (
    Held,
    held_tensors,
    inner_optimizer,
    model_pieces,
    optimizer_params,
    state_pieces,
    tied_keys,
)
from autopar.runtime.comm.teardown import caches_groups
from autopar.runtime.grads.zero import ZeroOptimizer


class Stateful(Protocol):
    """What a caller's object needs to be saved with a checkpoint (DCP's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save(
    path: str | os.PathLike,
    pipe,
    optimizer=None,
    *,
    lr_scheduler=None,
    objects: dict[str, Stateful] | None = None,
    extra: Any = None,
    step: int | None = None,
    asynchronous: bool = False,
) -> Path | PendingSave:
    """Write a checkpoint of ``pipe`` (a ParallelModule), ``optimizer`` (``pipe.make_optimizer``'s or
    the caller's over ``pipe.parameters()``), ``lr_scheduler``, the caller's ``objects`` (by name) and
    a JSON ``extra`` to the directory ``path``; ``step`` orders checkpoints for ``latest``. Collective
    over every rank; the caller's objects are saved from rank 0.

    ``asynchronous``: the tensors are copied to host memory here and written by a background thread
    (DCP's ``async_save``, over a process group of its own) while training goes on; call ``wait()`` on
    the returned ``PendingSave`` on every rank before the next save (it commits the checkpoint)."""
    path = Path(_path(path, "save"))
    state, manifest = _prepare(pipe, optimizer, lr_scheduler, objects, extra, step)
    stage = begin(path)  # the files go to a staging folder: the checkpoint at path stays whole until publish
    if not asynchronous:
        commit(stage, dcp.save(state, storage_writer=FileSystemWriter(stage), no_dist=_no_dist()), manifest)
        publish(stage, path)
        return path
    future = dcp.async_save(
        state,
        storage_writer=FileSystemWriter(stage),
        process_group=None if _no_dist() else _checkpoint_group(),
        async_stager=_HostStager(),
        no_dist=_no_dist(),
    )
    return PendingSave(path, stage, future, manifest)


def _path(path: Any, verb: str) -> str | os.PathLike:
    """``path`` when it names a folder; a ``CheckpointError`` for ``None`` (what ``latest`` returns when
    there is no checkpoint yet) or another type, instead of a ``TypeError`` from deep inside."""
    if path is None:
        raise CheckpointError(
            f"checkpoint.{verb} got None for the checkpoint's folder: checkpoint.latest(root) returns None when "
            "root holds no whole checkpoint yet; start from scratch then (`if path is not None: load(...)`)"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint.{verb} takes a folder (str or os.PathLike), not {type(path).__name__}")
    return path


class PendingSave:
    """An asynchronous save in flight: ``wait()`` (collective, on every rank) waits for its files and
    commits the checkpoint."""

    def __init__(self, path: Path, stage: Path, future: Future, manifest: dict[str, Any]):
        self.path, self._stage, self._future, self._manifest = path, stage, future, manifest

    def wait(self) -> Path:
        commit(self._stage, self._future.result(), self._manifest)
        publish(self._stage, self.path)
        return self.path


class _HostStager:
    """DCP's ``AsyncStager``: a copy of every piece in host memory, made before ``async_save`` returns."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: v.staged() if isinstance(v, Pieces) else v.detach().to("cpu", copy=True) for k, v in state.items()}

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing is held between saves."""


_GROUPS: dict[int, Any] = {}


def _checkpoint_group():
    """A gloo group of every rank for the background writes, apart from training's collectives (made once
    per default group: a collective the first time)."""
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


caches_groups(_GROUPS.clear)


def _prepare(pipe, optimizer, lr_scheduler, objects, extra, step) -> tuple[dict[str, Any], dict]:
    """What a save writes: the pieces of every tensor by key, and the manifest."""
    held = held_tensors(pipe)
    manifest = _manifest(pipe, optimizer, held, lr_scheduler, objects, extra, step)  # refuses bad objects first
    state: dict[str, Any] = model_pieces(pipe, held)
    state.update({f"model/{key}": t for key, t in pipe.state_keys()[1].items()})
    if optimizer is not None:
        inner = inner_optimizer(optimizer)
        for p, parts in optimizer_params(pipe, optimizer, held):
            state.update(state_pieces(parts, inner.state.get(p, {})))
    return state, manifest


def _manifest(pipe, optimizer, held: dict[str, Held], lr_scheduler, objects, extra, step) -> dict[str, Any]:
    """What the manifest holds besides the files: the model's keys, every state that is not a tensor."""
    keys, unread = pipe.state_keys()
    types = {v.name: v.type for v in pipe.program.inputs}
    first, aliases = tied_keys(keys)
    tensors = {k: {"shape": list(types[n].shape), "dtype": str(types[n].torch_dtype)} for n, k in first.items()}
    tensors.update({k: {"shape": list(t.shape), "dtype": str(t.dtype)} for k, t in unread.items()})
    out: dict[str, Any] = {"step": step, "model": tensors, "aliases": aliases}
    out["saved_on"] = {"mesh": dict(zip(pipe.program.mesh.names, pipe.program.mesh.sizes)), "zero": pipe.setup.zero}
    rng = pipe.dropout_rng
    out["dropout_rng"] = {"seed": rng.seed, "step": rng.step} if rng is not None else None
    if optimizer is not None:
        inner = inner_optimizer(optimizer)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        scalars: dict[str, dict[str, Any]] = {}
        for p, parts in optimizer_params(pipe, optimizer, held):
            for name, value in inner.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    for h, _ in parts:
                        scalars.setdefault(h.key, {})[name] = value
        out["optimizer"] = encode({"param_groups": groups, "scalars": scalars}, "optimizer")
    if lr_scheduler is not None:
        out["lr_scheduler"] = encode(lr_scheduler.state_dict(), "lr_scheduler")
    objects = {name: checkpointable(obj, name) for name, obj in (objects or {}).items()}  # a DataLoader: its sampler's
    out["objects"] = {name: encode(obj.state_dict(), name) for name, obj in objects.items()}
    out["extra"] = encode(extra, "extra")
    return out


@torch.no_grad()
def load(
    path: str | os.PathLike,
    pipe,
    optimizer=None,
    *,
    lr_scheduler=None,
    objects: dict[str, Stateful] | None = None,
    check_files: bool = True,
) -> Any:
    """Restore ``pipe`` (and ``optimizer``, ``lr_scheduler``, the caller's ``objects``) in place from
    the checkpoint at ``path``, saved on any mesh; returns the saved ``extra``. ``check_files``: compare
    every file's size and SHA-256 with the manifest first. Collective over every rank. ``path`` is
    ``None`` (``latest`` found no checkpoint): a ``CheckpointError``."""
    path = resolve(Path(_path(path, "load")))
    manifest = read_manifest(path)
    if check_files:
        verify(path, manifest)
    meta = SafeReader(path).read_metadata().state_dict_metadata
    held = held_tensors(pipe)
    _check_model(path, pipe, manifest)
    state: dict[str, Any] = model_pieces(pipe, held)
    state.update({f"model/{key}": t for key, t in pipe.state_keys()[1].items()})
    loaded: list[tuple[list[str], dict]] = []
    if optimizer is not None:
        for p, parts in optimizer_params(pipe, optimizer, held):
            loaded.append(([h.key for h, _ in parts], _allocate_states(path, p, parts, meta, state)))
    dcp.load(state, storage_reader=SafeReader(path), no_dist=_no_dist())
    if isinstance(pipe.optimizer, ZeroOptimizer):
        pipe.optimizer.refresh_master()  # ZeRO-2's flat slice holds a copy of the parameters
    if optimizer is not None:
        _install_optimizer(path, optimizer, manifest, loaded)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(decode(_section(path, manifest, "lr_scheduler")))
    for name, obj in (objects or {}).items():
        saved = manifest.get("objects", {})
        if name not in saved:
            raise CheckpointMismatchError(f"the checkpoint at {path} holds no object {name!r} (it has {sorted(saved)})")
        checkpointable(obj, name).load_state_dict(decode(saved[name]))
    rng = manifest.get("dropout_rng")
    if rng is not None and pipe.dropout_rng is not None:
        pipe.dropout_rng.seed, pipe.dropout_rng.step = rng["seed"], rng["step"]
    return decode(manifest.get("extra"))


def _section(path: Path, manifest: dict[str, Any], name: str) -> Any:
    if manifest.get(name) is None:
        raise CheckpointMismatchError(f"the checkpoint at {path} was saved without {name.replace('_', ' ')} state")
    return manifest[name]


def _check_model(path: Path, pipe, manifest: dict[str, Any]) -> None:
    """The checkpoint holds this model: the same keys with the same shapes (dtypes may differ: loading
    casts)."""
    mine = _manifest(pipe, None, {}, None, None, None, None)["model"]
    saved = manifest.get("model", {})
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = [
        f"{k} {saved[k]['shape']} (this model: {mine[k]['shape']})"
        for k in mine
        if k in saved and saved[k]["shape"] != mine[k]["shape"]
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} of this model's tensors ({', '.join(missing[:4])})")
        if extra:
            parts.append(f"it has {len(extra)} tensors this model lacks ({', '.join(extra[:4])})")
        if shapes:
            parts.append(f"{len(shapes)} have another shape ({'; '.join(shapes[:4])})")
        raise CheckpointMismatchError(
            f"the checkpoint at {path} is of another model: {', '.join(parts)}; load it into its own model"
        )


def _allocate_states(path: Path, p: torch.Tensor, parts: list[tuple[Held, int]], meta, state: dict) -> dict:
    """This rank's tensors of every saved optimizer state of parameter ``p`` (laid out as ``p``),
    registered in ``state`` as the pieces DCP loads into."""
    names: set[str] | None = None
    for h, _ in parts:
        prefix = f"optim/{h.key}/"
        have = {k[len(prefix) :] for k in meta if k.startswith(prefix)}
        if names is not None and have != names:
            raise CheckpointMismatchError(
                f"the checkpoint at {path} has optimizer states {sorted(have)} for {h.key} but {sorted(names)} for "
                "other parameters sharded together (ZeRO): it cannot be loaded into this optimizer"
            )
        names = have
    out: dict[str, torch.Tensor] = {}
    for name in sorted(names or ()):
        first = meta[f"optim/{parts[0][0].key}/{name}"]
        if len(first.size) == 0:
            out[name] = torch.empty((), dtype=first.properties.dtype)
            state[f"optim/{parts[0][0].key}/{name}"] = out[name]
            continue
        t = torch.zeros(p.shape, dtype=first.properties.dtype, device=p.device)
        for h, at in parts:
            m = meta[f"optim/{h.key}/{name}"]
            if tuple(m.size) != h.shape:
                raise CheckpointMismatchError(
                    f"the checkpoint's optimizer state {name} of {h.key} has shape {list(m.size)}, the parameter "
                    f"{list(h.shape)}"
                )
            if h.start < h.stop:
                state[f"optim/{h.key}/{name}"] = h.pieces(t, at)
        out[name] = t
    return out


# how torch.optim steps, not what: a resumed run keeps the implementation its optimizer was built with (a
# checkpoint saved with torch's for-loop kernel does not turn make_optimizer's fused default off, nor the reverse)
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _install_optimizer(path: Path, optimizer, manifest: dict[str, Any], loaded: list[tuple[list[str], dict]]) -> None:
    """The loaded states (each parameter's, with the user keys it holds), the states that are not tensors
    and the saved hyper-parameters (not the implementation: ``IMPLEMENTATION_KEYS``) into ``optimizer``."""
    saved = decode(_section(path, manifest, "optimizer"))
    current = optimizer.state_dict()
    groups = current["param_groups"]
    if len(saved["param_groups"]) != len(groups):
        raise CheckpointMismatchError(
            f"the checkpoint at {path} has {len(saved['param_groups'])} optimizer parameter groups, this optimizer "
            f"{len(groups)}: build the optimizer with the same groups"
        )
    for g, s in zip(groups, saved["param_groups"]):  # hyper-parameters as saved; the kernel as built here
        g.update({k: v for k, v in s.items() if k not in ("params", *IMPLEMENTATION_KEYS)})
    states = {}
    for i, (keys, entry) in enumerate(loaded):
        entry = {**saved["scalars"].get(keys[0], {}), **entry} if keys else entry
        if entry:
            states[i] = entry
    optimizer.load_state_dict({"state": states, "param_groups": groups})


__all__ = ["PendingSave", "Stateful", "latest", "load", "save"]
