"""A checkpoint directory on disk: its manifest, the atomic commit, checksums, and reading DCP's metadata safely.

A directory is a checkpoint once ``autopar.json`` (the manifest) is in it. The manifest is written
last, by rank 0, after every rank's data and DCP's ``.metadata`` are on disk, to a temporary name
renamed over the final one (``os.replace`` is atomic): a save killed at any point before leaves no
manifest, so the directory is not a checkpoint and ``latest`` passes over it. The manifest records
each file's size and SHA-256 (each rank hashes a share of the files), so a truncated, missing or
altered file is found before anything is loaded.

DCP stores its metadata with ``pickle``; ``SafeReader`` reads it with an unpickler that builds only
DCP's metadata classes, paths, sizes and dtypes, so a checkpoint someone handed you cannot run code
through it (tensor data DCP reads with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from autopar.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

MANIFEST = "autopar.json"
FORMAT = "autopar-checkpoint"
VERSION = 1

# what DCP's .metadata pickle may build: module -> names
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the checkpoint's .metadata asks to build {module}.{name}, which DCP's metadata never holds: "
            "it was not written by torch.distributed.checkpoint and loading it could run code; do not use it"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader whose metadata is unpickled with the allow-list above, refusing checkpoints that
    hold pickled objects (DCP would ``torch.load`` those with ``weights_only=False``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
            raise CorruptCheckpointError(f"{path} cannot be read ({e}): the file is damaged") from None
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path} holds no DCP metadata")
        objects = [k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)]
        if objects:
            raise UnsafeCheckpointError(
                f"the checkpoint at {self.path} holds pickled objects ({', '.join(sorted(objects)[:5])}), which "
                "torch.distributed.checkpoint loads with weights_only=False (running any code they name); "
                "autopar never writes such: re-save it from trusted code with autopar.runtime.checkpoint.save_load.save"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def uncommit(path: Path) -> None:
    """Before writing into ``path``: rank 0 removes its manifest first (from then on it is no
    checkpoint, whatever happens next), then the old data; collective."""
    if _rank_world()[0] == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)
        for f in path.iterdir():
            if f.suffix == ".distcp" or f.name.startswith(".metadata"):
                f.unlink()
    _barrier()


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def commit(path: Path, metadata: Metadata, manifest: dict[str, Any]) -> None:
    """After DCP wrote ``metadata`` and its files: every rank hashes a share of the files, rank 0
    writes the manifest with them atomically; collective."""
    files = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
    rank, world = _rank_world()
    mine = {f: _digest(path / f) for f in files[rank::world]}
    digests: dict[str, Any] = {}
    for part in _gather(mine):
        digests.update(part)
    if rank == 0:
        body = {"format": FORMAT, "version": VERSION, **manifest, "files": digests}
        tmp = path / f".{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MANIFEST)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself reaches the disk
        finally:
            os.close(fd)
    _barrier()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; ``IncompleteCheckpointError`` when there is none."""
    if not path.is_dir():
        raise IncompleteCheckpointError(f"there is no checkpoint at {path}")
    try:
        with open(path / MANIFEST) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{path} has no {MANIFEST}: its save never committed (interrupted), so it is not a checkpoint; "
            "load the previous one (autopar.runtime.checkpoint.save_load.latest finds it)"
        ) from None
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{path / MANIFEST} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{path / MANIFEST} is not an autopar checkpoint of version {VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    return manifest


def verify(path: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size and checksum (each rank checks a share;
    every rank raises the first problem found); collective."""
    files = sorted(manifest["files"])
    rank, world = _rank_world()
    problems = []
    for name in files[rank::world]:
        want, f = manifest["files"][name], path / name
        if not f.exists():
            problems.append(("missing", f"{f} is missing: a shard of the checkpoint was lost"))
            continue
        got = _digest(f)
        if got["bytes"] != want["bytes"]:
            problems.append(("corrupt", f"{f} has {got['bytes']} bytes, the save wrote {want['bytes']}: truncated"))
        elif got["sha256"] != want["sha256"]:
            problems.append(("corrupt", f"{f} differs from what the save wrote (SHA-256 mismatch): it was altered"))
    found = [p for part in _gather(problems) for p in part]
    if found:
        kind, message = found[0]
        more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
        cls = IncompleteCheckpointError if kind == "missing" else CorruptCheckpointError
        raise cls(message + more)


def latest(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint under ``root`` (its subdirectories) with the highest step (ties: the
    newest manifest); ``None`` when there is none. Interrupted saves have no manifest and are passed over."""
    best: tuple | None = None
    root = Path(root)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        try:
            manifest = read_manifest(d)
        except (IncompleteCheckpointError, CorruptCheckpointError):
            continue
        rank = (manifest.get("step") if isinstance(manifest.get("step"), int) else -1, (d / MANIFEST).stat().st_mtime)
        if best is None or rank > best[0]:
            best = (rank, d)
    return best[1] if best is not None else None


__all__ = ["MANIFEST", "SafeReader", "commit", "latest", "read_manifest", "uncommit", "verify"]
