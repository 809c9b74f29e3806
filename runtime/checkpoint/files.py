"""A checkpoint directory on disk: its manifest, the atomic commit, checksums, and reading DCP's metadata safely.

A directory is a checkpoint once ``autopar.json`` (the manifest) is in it. A save never writes into the
folder it saves to: every rank writes into a hidden staging sibling (``.<name>.saving``); the manifest
is written last, by rank 0, after every rank's data and DCP's ``.metadata`` are on disk, to a temporary
name renamed over the final one (``os.replace`` is atomic); then rank 0 moves the checkpoint that was at
``<name>`` aside (``.<name>.previous``), renames the staging folder to ``<name>`` and deletes the old one.
A save killed at any point leaves a whole checkpoint for ``<name>``: the old one in place, or moved aside
(``resolve``, ``latest`` and the next save find it there), or the new one. The manifest records each
file's size and SHA-256 (each rank hashes a share of the files), so a truncated, missing or altered file
is found before anything is loaded, and ``latest`` passes over such a checkpoint to the one before.

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
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from autopar.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

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


def staging(path: Path) -> Path:
    """Where a save to ``path`` writes before it is committed: a hidden sibling, renamed to ``path`` once
    complete (``publish``), so the checkpoint that was at ``path`` stays whole until then."""
    return path.parent / f".{path.name}.saving"


def previous(path: Path) -> Path:
    """Where ``publish`` moves the checkpoint that was at ``path`` for the moment between its two renames."""
    return path.parent / f".{path.name}.previous"


# what a directory may hold for a save to replace it: autopar's and DCP's files (an old checkpoint, an old save)
_CHECKPOINT_FILES = (MANIFEST, f".{MANIFEST}.tmp", ".metadata")


def _replaceable(path: Path) -> bool:
    return all(f.is_file() and (f.name in _CHECKPOINT_FILES or f.suffix == ".distcp") for f in path.iterdir())


def begin(path: Path) -> Path:
    """Before a save to ``path``: rank 0 recovers a checkpoint an earlier save left between its renames,
    refuses a ``path`` holding anything but a checkpoint (replacing it would delete the user's files) and
    makes an empty staging directory; returns it. Collective."""
    stage = staging(path)
    problem = None
    if _rank_world()[0] == 0:
        _recover(path)
        if path.exists() and not (path.is_dir() and _replaceable(path)):
            problem = (
                f"{path} exists and holds files that are not a checkpoint's: a save replaces the whole folder, "
                "so it would delete them; save to another folder (or move them away)"
            )
        else:
            if stage.exists():  # an earlier save to this path was interrupted: its files are no checkpoint
                shutil.rmtree(stage)
            stage.mkdir(parents=True)
    found = [p for p in _gather(problem) if p is not None]
    if found:
        raise CheckpointError(found[0])
    return stage


def _recover(path: Path) -> None:
    """A save killed between ``publish``'s renames left the old checkpoint at ``previous(path)``, nothing
    at ``path``: it goes back."""
    old = previous(path)
    if not path.exists() and (old / MANIFEST).is_file():
        os.rename(old, path)


def publish(stage: Path, path: Path) -> None:
    """After the staged save committed: rank 0 puts it at ``path`` (the checkpoint there moved aside first,
    deleted last), so a crash at any point leaves one whole checkpoint for ``path`` (``resolve``); collective."""
    if _rank_world()[0] == 0:
        old = previous(path)
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            os.rename(path, old)
        os.rename(stage, path)
        _sync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    _barrier()


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # renames in the directory reach the disk
    finally:
        os.close(fd)


def resolve(path: Path) -> Path:
    """The checkpoint saved to ``path``: ``path`` itself, or, when a save to it was killed between its
    renames, the previous one it moved aside (with a warning)."""
    old = previous(path)
    if not (path / MANIFEST).is_file() and (old / MANIFEST).is_file():
        warnings.warn(
            f"{path} is missing: a save to it was interrupted while replacing it; loading the checkpoint it "
            f"replaced ({old})",
            stacklevel=3,
        )
        return old
    return path


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
        _sync_dir(path)
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


def _problems(path: Path, manifest: dict[str, Any], names: list[str]) -> list[tuple[str, str]]:
    """What is wrong with the files ``names`` of the checkpoint at ``path``: (kind, message) for each."""
    problems = []
    for name in names:
        want, f = manifest["files"][name], path / name
        if not f.exists():
            problems.append(("missing", f"{f} is missing: a shard of the checkpoint was lost"))
            continue
        got = _digest(f)
        if got["bytes"] != want["bytes"]:
            problems.append(("corrupt", f"{f} has {got['bytes']} bytes, the save wrote {want['bytes']}: truncated"))
        elif got["sha256"] != want["sha256"]:
            problems.append(("corrupt", f"{f} differs from what the save wrote (SHA-256 mismatch): it was altered"))
    return problems


def verify(path: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size and checksum (each rank checks a share;
    every rank raises the first problem found); collective."""
    files = sorted(manifest["files"])
    rank, world = _rank_world()
    found = [p for part in _gather(_problems(path, manifest, files[rank::world])) for p in part]
    if found:
        kind, message = found[0]
        more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
        cls = IncompleteCheckpointError if kind == "missing" else CorruptCheckpointError
        raise cls(message + more)


def latest(root: str | os.PathLike, *, checksums: bool = True) -> Path | None:
    """The newest whole checkpoint under ``root`` (its subdirectories): the highest step (ties: the newest
    manifest) whose files all have the size and SHA-256 the save recorded; ``None`` when there is none.
    Interrupted saves (no manifest, or still in their hidden staging folder) are passed over; a damaged
    checkpoint (a file missing, truncated or altered) is passed over with a warning, so a restart resumes
    from the one before instead of failing on it again. Not collective: each caller reads the files it
    checks (every file of the checkpoint it returns; ``checksums=False``: their sizes only, for huge ones)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for d in root.iterdir():
        if d.name.startswith("."):
            # a checkpoint moved aside by a save killed mid-replace is the one for its path; staging is none
            if not (d.name.endswith(".previous") and not (root / d.name[1 : -len(".previous")] / MANIFEST).exists()):
                continue
        try:
            manifest = read_manifest(d)
        except (IncompleteCheckpointError, CorruptCheckpointError):
            continue
        step = manifest.get("step") if isinstance(manifest.get("step"), int) else -1
        found.append(((step, (d / MANIFEST).stat().st_mtime), d, manifest))
    for _, d, manifest in sorted(found, key=lambda f: f[0], reverse=True):
        problems = _problems(d, manifest, sorted(manifest.get("files", {}))) if checksums else _sizes(d, manifest)
        if not problems:
            return d
        warnings.warn(
            f"checkpoint.latest: passing over the damaged checkpoint {d} ({problems[0][1]}); trying the one before",
            stacklevel=2,
        )
    return None


def _sizes(path: Path, manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """The files of the checkpoint at ``path`` that are missing or not of their recorded size."""
    out = []
    for name, want in sorted(manifest.get("files", {}).items()):
        f = path / name
        if not f.exists():
            out.append(("missing", f"{f} is missing"))
        elif f.stat().st_size != want["bytes"]:
            out.append(("corrupt", f"{f} has {f.stat().st_size} bytes, the save wrote {want['bytes']}: truncated"))
    return out


__all__ = ["MANIFEST", "SafeReader", "begin", "commit", "latest", "publish", "read_manifest", "resolve", "verify"]
