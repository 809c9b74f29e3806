"""The pipeline split's caches: a fingerprint of a program's structure, and splits kept in-process and on disk.

Keys include ``code_fingerprint()``: a plan solved by other code is never reused. On disk a split is
``split-<key>.json`` in the plan cache, ``$AUTOPAR_CACHE_DIR`` (default
``~/.cache/autopar/plans``; ``off``, ``0`` or empty disables the disk). ``cache_dir(kind)`` also names
the folders beside it that the search keeps (``profiles``, ``schedules``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

from autopar.ir.core import MeshSpec, Program
from autopar.ir.printer import print_program
from autopar.passes.subgraphs import SPLIT_VERSION, Split, SplitOptions

_MEMORY: dict[str, Split] = {}


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the source of the packages a plan comes from (the IR, the schedules, the passes, the solver): a
    cached plan or split is reused only by the code that made it, so a new autopar (or an edited
    cost model) never runs a stale plan."""
    import autopar.ir
    import autopar.passes
    import autopar.schedule
    import autopar.solver

    h = hashlib.sha256()
    for pkg in (autopar.ir, autopar.schedule, autopar.passes, autopar.solver):
        for path in sorted(Path(pkg.__file__).parent.rglob("*.py")):
            h.update(path.relative_to(Path(pkg.__file__).parent).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir(kind: str = "plans") -> Path | None:
    """The plan cache ($AUTOPAR_CACHE_DIR, default ~/.cache/autopar/plans) for ``kind="plans"``, the
    folder ``kind`` beside it otherwise; None when the cache is off ("", "0" or "off")."""
    plans = os.environ.get("AUTOPAR_CACHE_DIR", str(Path.home() / ".cache" / "autopar" / "plans"))
    if plans in ("", "0", "off"):
        return None
    return Path(plans) if kind == "plans" else Path(plans).parent / kind


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so that a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def program_fingerprint(prog: Program) -> str:
    """sha256 of the program printed without annotations: no op, value or program attrs, no mesh
    and no placements, so the split is found again after sharding or stage annotation. Op targets,
    arguments, shapes, dtypes, module paths and FLOPs all count (the split depends on each).
    (``autopar.plan.fingerprint`` is another thing: the captured torch graph a plan was made for.)"""
    inputs = tuple(dataclasses.replace(v, attrs={}, type=v.type.with_placements(())) for v in prog.inputs)
    ops = tuple(op.with_(attrs={}, types=tuple(t.with_placements(()) for t in op.types)) for op in prog.ops)
    bare = Program(MeshSpec(), inputs, ops, prog.outputs)
    return hashlib.sha256(print_program(bare).encode()).hexdigest()


def _key(fp: str, opts: SplitOptions) -> str:
    return hashlib.sha256(f"v{SPLIT_VERSION};{code_fingerprint()};{fp};{opts.key()}".encode()).hexdigest()[:32]


def cached_split(fp: str, opts: SplitOptions, num_ops: int) -> Split | None:
    """The split of the program with fingerprint ``fp`` kept in-process or on disk (``source`` says
    which), or None."""
    key = _key(fp, opts)
    hit = _MEMORY.get(key)
    if hit is not None:
        return dataclasses.replace(hit, source="memory")
    d = cache_dir()
    path = d / f"split-{key}.json" if d else None
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != SPLIT_VERSION or data.get("fingerprint") != fp or data.get("num_ops") != num_ops:
        return None
    split = Split.from_dict(data, source="disk")
    _MEMORY[key] = split
    return split


def remember_split(opts: SplitOptions, split: Split) -> None:
    """Keep ``split`` in-process and on disk (a read-only cache folder only costs the next run the split)."""
    key = _key(split.fingerprint, opts)
    _MEMORY[key] = split
    d = cache_dir()
    if d is None:
        return
    try:
        write_atomic(d / f"split-{key}.json", json.dumps(split.to_dict()))
    except OSError:
        pass


def clear_memory_cache() -> None:
    _MEMORY.clear()


__all__ = [
    "cache_dir",
    "cached_split",
    "clear_memory_cache",
    "code_fingerprint",
    "program_fingerprint",
    "remember_split",
    "write_atomic",
]
