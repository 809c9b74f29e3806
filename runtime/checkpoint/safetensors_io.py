"""The whole model to a safetensors file, and a ParallelModule's weights from one (or a plain state dict).

``save_safetensors`` writes every key of the user's ``model.state_dict()`` (``full_state_dict``), a
tied tensor once under its first name (the others listed in the header's ``autopar.tied``), from rank
0, atomically. ``load_safetensors`` reads it back as the user's whole state dict, tied names restored,
for ``model.load_state_dict(..., strict=True)``. ``load_weights`` is the reverse direction: a compiled
module starts from a safetensors file or a plain state dict, each rank reading only the boxes it holds
(``runtime/checkpoint/state_pieces.py``; safetensors reads a slice of a file without the rest), whatever the mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from autopar.errors import CheckpointMismatchError
from autopar.runtime.checkpoint.state_pieces import held_tensors, tied_keys
from autopar.runtime.grads.zero import ZeroOptimizer

TIED = "autopar.tied"


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_safetensors(pipe, path: str | os.PathLike) -> Path:
    """The whole model of ``pipe`` as a safetensors file at ``path`` (collective: every rank gathers;
    rank 0 writes)."""
    path = Path(path)
    full = pipe.full_state_dict()
    _, aliases = tied_keys(pipe.state_keys()[0])
    if _rank0():
        tensors = {k: v.detach().cpu().contiguous() for k, v in full.items() if k not in aliases}
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt", TIED: json.dumps(aliases)})
        os.replace(tmp, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The user's whole state dict from ``save_safetensors``'s file (tied names restored)."""
    with safe_open(str(path), framework="pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
        aliases = json.loads((f.metadata() or {}).get(TIED, "{}"))
    out.update({alias: out[key] for alias, key in aliases.items() if key in out})
    return out


@contextlib.contextmanager
def _source(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> Iterator[Callable[[str], object | None]]:
    """key -> something sliced like a tensor (``shape``, ``[index]``), or None when ``source`` lacks it."""
    if isinstance(source, Mapping):
        yield source.get
        return
    path = Path(source)
    if path.is_dir() or path.name.endswith(".index.json"):  # a Hugging Face sharded directory (save_pretrained's)
        index = path / "model.safetensors.index.json" if path.is_dir() else path
        if not index.exists():
            single = path / "model.safetensors"
            if not single.exists():
                raise CheckpointMismatchError(f"{path} has neither model.safetensors.index.json nor model.safetensors")
            index = None
        with contextlib.ExitStack() as stack:
            if index is None:
                files = {"model.safetensors": stack.enter_context(safe_open(str(single), framework="pt"))}
                where = {k: "model.safetensors" for k in files["model.safetensors"].keys()}  # noqa: SIM118
            else:
                where = json.loads(index.read_text())["weight_map"]
                files = {
                    f: stack.enter_context(safe_open(str(index.parent / f), framework="pt"))
                    for f in set(where.values())
                }
            yield lambda key: files[where[key]].get_slice(key) if key in where else None
        return
    with safe_open(str(source), framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118 - safe_open has no iteration
        aliases = json.loads((f.metadata() or {}).get(TIED, "{}"))

        def get(key: str):
            key = aliases.get(key, key) if key not in keys else key
            return f.get_slice(key) if key in keys else None

        yield get


def _shape(x) -> tuple[int, ...]:
    return tuple(x.get_shape()) if hasattr(x, "get_shape") else tuple(x.shape)


@torch.no_grad()
def load_weights(pipe, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
    """Set ``pipe``'s parameters and buffers from ``source`` (a safetensors file, a Hugging Face directory of
    sharded safetensors with its ``model.safetensors.index.json`` (``save_pretrained``'s), or the user's state
    dict): each rank reads only the pieces it holds. A tied tensor may come under any of its names."""
    keys, unread = pipe.state_keys()
    names: dict[str, list[str]] = {}
    for key, name in keys.items():
        names.setdefault(name, []).append(key)
    local = pipe.local_tensors()
    missing, shapes = [], []
    with _source(source) as get:
        for name, h in held_tensors(pipe).items():
            src = next((s for s in map(get, names[name]) if s is not None), None)
            if src is None:
                missing.append(h.key)
            elif _shape(src) != h.shape:
                shapes.append(f"{h.key} {list(_shape(src))} (this model: {list(h.shape)})")
            else:
                for b in h.boxes(local[name].detach()):
                    index = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.view.shape))
                    b.view.copy_(src[index] if index else src[...])
        for key, t in unread.items():
            src = get(key)
            if src is not None:
                t.copy_(src[tuple(slice(None) for _ in t.shape)] if t.dim() else src[...])
    if missing or shapes:
        raise CheckpointMismatchError(
            f"the weights are of another model: {len(missing)} tensors missing ({', '.join(missing[:4])}), "
            f"{len(shapes)} of another shape ({'; '.join(shapes[:4])})"
        )
    if isinstance(pipe.optimizer, ZeroOptimizer):
        pipe.optimizer.refresh_master()


__all__ = ["load_safetensors", "load_weights", "save_safetensors"]
