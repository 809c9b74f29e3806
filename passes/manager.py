"""PassManager: run registered passes in their pipeline's order; number, verify, time and keep each one's output.

    pm = PassManager(["shard", "insert-collectives"], dump_dir="out/ir")
    prog = pm.run(prog)                 # 00-input.ir, 01-shard.ir, 02-insert-collectives.ir
    pm = PassManager(FLOW, dump_dir="out/ir", options={"lower": mesh})
    prog = pm.run(captured, start="lower", stop="shard")  # 02-lower.ir, 03-shard.ir: FLOW's numbers

A pass is a ``Pass`` registered by name (``register_pass``): its function ``(value, options) -> value``, or
``(value, info)`` with its report (the solver's ``ShardResult``, the stage plan) kept in ``PassManager.info``;
how its output is dumped (a program's text, ``.ir``; the code of a model's export or of a GraphModule, ``.py``);
whether its output is kept on disk. The flow's passes are registered beside its list (``passes/flow.py``:
``capture`` ... ``insert-transfers``) but ``codegen``, which the runtime registers (``runtime/build/codegen.py``);
``import autopar`` loads both. Adding a pass is one registration and one entry in the pipeline.

A run goes through a slice of the pipeline (``start`` ... ``stop``): a flow taken up midway (a plan file's
program) is the same pipeline run from a later pass. Each pass's output is verified (a ``Program``), timed,
kept in ``outputs`` and dumped as ``NN-name.ir``, NN its position in the pipeline; a run from the pipeline's
head writes its input program as ``00-input.ir``.

A pass may fork its value into ``Variants``: ``prune-outputs`` makes the training program (the main variant)
and keeps the forward one (every output) as variant ``forward``. The passes after a fork run on each variant,
and each variant's dump carries its name (``08-insert-transfers.forward.ir``; the codegen of a rank's part:
``09-codegen.rank0.stage0.py``); a variant a fork carries over unchanged is not dumped again.

Dumps go to ``dump_dir`` (or the AUTOPAR_DUMP_DIR environment variable); a manager told its directory only
after it ran (``dump_into``: a module built before its caller dumps it) writes there what it made. When a pass
fails the manager writes ``reproducer.ir`` (what the pass got) and ``reproducer.txt`` (the pipeline, the pass,
the error). A pass registered ``cached`` (``shard``: the ILP) keeps its output on disk (``split_cache.cache_dir``)
when the manager's ``cache`` is on and nothing is dumped, keyed by content: its input's IR, its options, its
name and the planning code's fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.ir.core import Program
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.passes.split_cache import cache_dir, code_fingerprint, write_atomic

PassFn = Callable[[Any, Any], Any]  # (value, the pass's options or None) -> value, or (value, info)
MAIN = ""  # the main variant's name: its dump carries none


class Variants(dict[str, Any]):
    """One value in named versions (name -> value, ``MAIN`` first), which the passes after the fork that made
    them rewrite alike."""


@dataclass(frozen=True)
class Pass:
    """A registered pass: its function, how its output is written to the dump directory, and whether its
    output is kept on disk by content (``PassManager.cache``)."""

    name: str
    fn: PassFn
    dump: Callable[[Any], str] = print_program  # its output as the dump file's text
    suffix: str = ".ir"  # the dump file's extension
    cached: bool = False


PASSES: dict[str, Pass] = {}


def register_pass(
    name: str,
    fn: PassFn | None = None,
    *,
    dump: Callable[[Any], str] = print_program,
    suffix: str = ".ir",
    cached: bool = False,
):
    """Register ``fn(value, options)`` under a kebab-case name; without ``fn``, a decorator that does.
    ``dump``/``suffix``: its output's dump text and extension; ``cached``: its output kept on disk."""

    def deco(f: PassFn) -> PassFn:
        PASSES[name] = Pass(name, f, dump, suffix, cached)
        return f

    return deco(fn) if fn is not None else deco


@dataclass
class PassManager:
    """Runs slices of its pipeline on a value: each pass's output verified, timed, kept and dumped by its number."""

    pipeline: Sequence[str] | str  # pass names in order ("shard,insert-collectives" also)
    dump_dir: str | os.PathLike | None = None
    verify_each: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # pass name -> that pass's options
    timings: dict[str, float] = field(default_factory=dict)  # pass name -> seconds, over every run and variant
    info: dict[str, Any] = field(default_factory=dict)  # pass name (.variant) -> what it reported besides its value
    outputs: dict[str, Any] = field(default_factory=dict)  # pass name -> its output (variants gathered over runs)
    cache: bool = False  # cached passes read and keep their outputs on disk while nothing is dumped
    dump_env: bool = True  # AUTOPAR_DUMP_DIR applies when dump_dir is None
    _made: dict[str, tuple[Callable[[Any], str], Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.pipeline, str):
            self.pipeline = [p.strip() for p in self.pipeline.split(",") if p.strip()]
        self.pipeline = list(self.pipeline)
        unknown = [p for p in self.pipeline if p not in PASSES]
        if unknown:
            raise AutoparError(f"unknown pass(es) {unknown}; registered passes: {sorted(PASSES)}")
        self.dump_dir = self.dump_dir or (os.environ.get("AUTOPAR_DUMP_DIR") if self.dump_env else None) or None

    def number(self, name: str) -> int:
        """The number ``name``'s dumps carry: its position in the pipeline, from 1."""
        return self.pipeline.index(name) + 1

    def run(self, value: Any, start: str | None = None, stop: str | None = None, *, options: dict | None = None):
        """Run the passes from ``start`` through ``stop`` (default: the whole pipeline) on ``value``; return the
        last one's output. ``options``: this run's, by pass name, over the manager's."""
        lo, hi = self._position(start, 0), self._position(stop, len(self.pipeline) - 1) + 1
        opts = {**self.options, **(options or {})}
        if lo == 0 and isinstance(value, Program):
            self._dump("00-input.ir", print_program, value)
        names = self.pipeline[lo:hi]
        for i in range(lo, hi):
            value = self._step(PASSES[self.pipeline[i]], i + 1, value, opts.get(self.pipeline[i]), names)
        return value

    def dump(self, name: str, value: Any, variant: str = MAIN) -> None:
        """Dump ``value`` as pass ``name``'s output (made before the run: the captured model the flow starts from)."""
        p = PASSES[name]
        self._dump(f"{self.number(name):02d}-{_join(name, variant)}{p.suffix}", p.dump, value)

    def dump_into(self, dump_dir: str | os.PathLike) -> None:
        """Dump into ``dump_dir`` from now on, and write there every dump made so far."""
        self.dump_dir = dump_dir
        for name, (text, value) in self._made.items():
            self._write(name, text(value))

    def _position(self, name: str | None, default: int) -> int:
        if name is None:
            return default
        if name not in self.pipeline:
            raise AutoparError(f"{name!r} is not in the pipeline {','.join(self.pipeline)}")
        return self.pipeline.index(name)

    # -- one pass ----------------------------------------------------------------------------------
    def _step(self, p: Pass, n: int, value: Any, options: Any, names: list[str]) -> Any:
        """``p`` on every variant of ``value``: a variant it forks goes on as ``variant.fork``."""
        inputs = value if isinstance(value, Variants) else Variants({MAIN: value})
        out = Variants()
        seconds: float | None = None
        for variant, x in inputs.items():
            t0 = time.perf_counter()
            y, ran = self._apply(p, n, x, options, variant, names)
            if ran:
                seconds = (seconds or 0.0) + time.perf_counter() - t0
            forked = isinstance(y, Variants)
            for sub, z in (y if forked else {MAIN: y}).items():
                out[_join(variant, sub)] = z
                if not (forked and z is x):  # a fork's carry-over: the pass before dumped it
                    self._dump(f"{n:02d}-{_join(p.name, _join(variant, sub))}{p.suffix}", p.dump, z)
        if seconds is not None:
            self.timings[p.name] = self.timings.get(p.name, 0.0) + seconds
        result = out if isinstance(value, Variants) or list(out) != [MAIN] else out[MAIN]
        before = self.outputs.get(p.name)
        both = isinstance(before, Variants) and isinstance(result, Variants)
        self.outputs[p.name] = Variants({**before, **result}) if both else result
        return result

    def _apply(self, p: Pass, n: int, x: Any, options: Any, variant: str, names: list[str]) -> tuple[Any, bool]:
        """``p`` on one value, or its output from the disk cache; whether it ran."""
        path = self._cache_path(p, x, options)
        if path is not None and path.exists():
            return parse(path.read_text()), False
        try:
            y = p.fn(x, options)
            if isinstance(y, tuple):
                y, self.info[_join(p.name, variant)] = y
            if self.verify_each:
                for prog in y.values() if isinstance(y, Variants) else (y,):
                    if isinstance(prog, Program):
                        verify(prog)
        except Exception as e:
            self._reproducer(p, n, x, variant, names)
            if isinstance(e, AutoparError):
                raise
            raise AutoparError(f"pass {p.name!r} failed: {type(e).__name__}: {e}") from e
        if path is not None:
            write_atomic(path, print_program(y))
        return y, True

    def _cache_path(self, p: Pass, x: Any, options: Any) -> Path | None:
        folder = cache_dir() if p.cached and self.cache and self.dump_dir is None and isinstance(x, Program) else None
        if folder is None:
            return None
        text = print_program(x) + repr(options) + p.name + code_fingerprint()
        return folder / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.ir"

    def _reproducer(self, p: Pass, n: int, x: Any, variant: str, names: list[str]) -> None:
        """What the failed pass got (a program, or as the pass before it dumps its output) and why it failed."""
        if self.dump_dir is None:
            return
        if isinstance(x, Program):
            self._write("reproducer.ir", print_program(x))
        elif n > 1:  # as the pass before dumps what it made (lower's input: the captured model's code)
            maker = PASSES[self.pipeline[n - 2]]
            self._write(f"reproducer{maker.suffix}", maker.dump(x))
        on = f" (variant {variant})" if variant else ""
        self._write(
            "reproducer.txt", f"pipeline: {','.join(names)}\nfailed pass: {p.name}{on}\n\n{traceback.format_exc()}"
        )

    # -- the dump directory ------------------------------------------------------------------------
    def _dump(self, name: str, text: Callable[[Any], str], value: Any) -> None:
        self._made[name] = (text, value)
        if self.dump_dir is not None:
            self._write(name, text(value))

    def _write(self, name: str, text: str) -> None:
        d = Path(self.dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)


def _join(a: str, b: str) -> str:
    return ".".join(s for s in (a, b) if s)
