"""The whole model from the shards: every key of the user's state dict, gathered on every rank.

``whole_values`` gathers each value this rank's stages hold whole over the mesh axes without the
pipeline (ZeRO-3 slices first, then each ``Shard`` placement, innermost axis first): a collective
over those axes, whose groups hold the same stages, so every member walks the same names in the same
order. ``share_over_pipeline`` then broadcasts each value from the first pipeline rank holding it to
the others, so every rank ends with every value.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.ir.core import Program, Shard
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.comm.pending import gather


@torch.no_grad()
def whole_values(program: Program, local: Callable[[str], torch.Tensor | None], comm: Comm) -> dict[str, torch.Tensor]:
    """Each value of ``program`` for which ``local(name)`` gives this rank's piece (whole over the ZeRO
    axes), gathered whole over the program's mesh axes: new tensors, never views of ``local``'s."""
    out = {}
    with use_comm(comm):
        for v in program.inputs:
            if v.kind == "input":
                continue
            held = local(v.name)
            if held is None:
                continue
            x = held
            for p, name in reversed(list(zip(v.type.placements, program.mesh.names))):
                if isinstance(p, Shard):
                    x = gather(comm, x, name, p.dim, p.chunks)
            # nothing to gather (one process, a replicated value): a copy, never the module's live tensor
            out[v.name] = x.clone() if x.untyped_storage().data_ptr() == held.untyped_storage().data_ptr() else x
    return out


@torch.no_grad()
def share_over_pipeline(values: dict[str, torch.Tensor], group, device: torch.device) -> dict[str, torch.Tensor]:
    """Every pipeline rank's ``values`` on every pipeline rank of ``group`` (a collective over it); a
    value held by several (a tied parameter) comes from the first."""
    n = dist.get_world_size(group)
    if n == 1:
        return dict(values)
    metas: list = [None] * n
    dist.all_gather_object(metas, [(k, tuple(t.shape), t.dtype) for k, t in values.items()], group=group)
    out: dict[str, torch.Tensor] = {}
    for src, meta in enumerate(metas):
        for name, shape, dtype in meta:
            if name in out:
                continue
            t = values[name].contiguous() if name in values else torch.empty(shape, dtype=dtype, device=device)
            wire = t.view(torch.uint8) if t.dtype == torch.bool else t
            dist.broadcast(wire, group=group, group_src=src)
            out[name] = t
    return out


# -- a Hugging Face export that scales: one whole tensor at a time, gathered to rank 0 ---------------------------

WEIGHTS_INDEX = "model.safetensors.index.json"


def _size_bytes(text: int | str) -> int:
    """``max_shard_size`` as transformers takes it: bytes, or "5GB", "500MB", "2GiB"..."""
    if isinstance(text, int):
        return text
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
    }
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    if t.endswith("B"):
        t = t[:-1]
    return int(t)


@torch.no_grad()
def save_pretrained(pipe, directory, *, max_shard_size: int | str = "5GB", config=None) -> Path:
    """``pipe``'s whole model as a Hugging Face directory at ``directory``: sharded safetensors
    (``model-0000i-of-0000N.safetensors``, each at most ``max_shard_size`` but for a single larger tensor),
    ``model.safetensors.index.json`` and the model's ``config.json`` (``config``, default the compiled
    model's transformers config; none is written without one), which transformers' ``from_pretrained``
    loads. Collective over every rank; each tensor is gathered whole on the ranks of its stage only, then
    sent to rank 0, which keeps on the CPU at most one file's tensors: no rank ever holds the whole model.
    A tied tensor is written once, under its first name."""
    from safetensors.torch import save_file

    from autopar.runtime.checkpoint.state_pieces import tied_keys

    directory = Path(directory)
    limit = _size_bytes(max_shard_size)
    keys, unread = pipe.state_keys()
    _, aliases = tied_keys(keys)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    held = set(pipe._local.tensors) | (set(pipe.zero3.names) if pipe.zero3 is not None else set())
    holders: list = [held]
    if distributed and dist.get_world_size() > 1:
        holders = [None] * dist.get_world_size()
        dist.all_gather_object(holders, sorted(held))
    files: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    stage = directory.with_name(f".{directory.name}.tmp")
    if rank == 0:
        stage.mkdir(parents=True, exist_ok=True)

    def flush() -> None:  # rank 0: the current file to disk, its tensors dropped
        if files[-1]:
            save_file(files[-1], str(stage / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files[-1] = {k: torch.Size(v.shape) for k, v in files[-1].items()}  # only the names kept

    weight_map: dict[str, int] = {}

    def add(key: str, t: torch.Tensor) -> None:  # rank 0
        n = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + n > limit:
            flush()
            files.append({})
            sizes.append(0)
        files[-1][key] = t.cpu().contiguous()
        sizes[-1] += n
        weight_map[key] = len(files)

    for key, name in keys.items():
        if key in aliases:
            continue
        owners = [r for r, h in enumerate(holders) if name in h]
        if not owners:
            raise RuntimeError(f"no rank holds {key} ({name})")
        t = None
        if rank in owners:
            t = _whole_one(pipe, name)
        src = owners[0]
        if src != 0 and distributed:
            if rank == src:
                dist.send(t.contiguous().cpu() if pipe.device.type == "cpu" else t.contiguous(), dst=0)
            elif rank == 0:
                v = pipe._values[name]
                t = torch.empty(v.type.shape, dtype=_dtype_of(pipe, name, v), device=pipe.device)
                dist.recv(t, src=src)
        if rank == 0:
            add(key, t)
        del t
    if rank == 0:
        for key, t in unread.items():
            add(key, t.detach())
        flush()
        n = len(files)
        names = {i: f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
        for i, fname in names.items():
            os.replace(stage / f"part-{i:05d}.safetensors", stage / fname)
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
        }
        (stage / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = config if config is not None else getattr(pipe, "model_config", None)
        if config is not None:
            config.save_pretrained(str(stage))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(stage, directory)
    if distributed:
        dist.barrier()
    return directory


def _dtype_of(pipe, name: str, v) -> torch.dtype:
    t = pipe._local.tensors.get(name)
    return t.dtype if t is not None else v.type.torch_dtype


def _whole_one(pipe, name: str) -> torch.Tensor:
    """``name``'s whole value on the ranks of its stage (a collective over them: the non-pipeline axes)."""

    def local(n: str) -> torch.Tensor | None:
        if n != name:
            return None
        if pipe.zero3 is not None and pipe.zero3.manages(n):
            return pipe.zero3.whole_value(n)
        t = pipe._local.tensors.get(n)
        return None if t is None else t.detach()

    return whole_values(pipe.program, local, pipe.comm)[name]


__all__ = ["WEIGHTS_INDEX", "save_pretrained", "share_over_pipeline", "whole_values"]
