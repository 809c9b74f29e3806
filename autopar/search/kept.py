"""What the search keeps on disk between runs, besides its profiles and schedules: results of pure functions of
the model's units and the pipeline's shape that take seconds to compute (the V layouts, ``stage_layout.py``; the
zero-bubble schedules' stash points, ``price.py``), in ``cache_dir(kind)`` beside the plan cache, keyed by the
function's arguments and ``code_fingerprint()`` (other code never reads them), as JSON."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

from autopar.passes.split_cache import cache_dir, code_fingerprint, write_atomic

T = TypeVar("T")


def kept(kind: str, name: str, args: Any, compute: Callable[[], T], decode: Callable[[Any], T]) -> T:
    """``compute()``, read back from ``cache_dir(kind)`` when this code computed it before for ``args`` (their
    ``repr`` is the key), else computed and written there (its JSON form); ``decode`` turns the JSON form back into
    the value (lists into tuples). ``name`` starts the file's name. Without a cache, computed."""
    d = cache_dir(kind)
    if d is None:
        return compute()
    key = repr((code_fingerprint(), args))
    path = d / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.exists():
        try:
            entry = json.loads(path.read_text())
            if entry["key"] == key:
                return decode(entry["value"])
        except (ValueError, KeyError, TypeError):  # a damaged entry: compute again
            pass
    value = compute()
    write_atomic(path, json.dumps({"key": key, "value": value}))
    return value


__all__ = ["kept"]
