"""PassManager: run named passes in order, verify after each, time each, dump the IR between them.

    pm = PassManager(["shard", "insert-collectives"], dump_dir="out/ir")
    prog = pm.run(prog)

With ``dump_dir`` (or the AUTOPAR_DUMP_DIR environment variable) it writes ``00-input.ir``,
``01-shard.ir``, ... so any two stages can be diffed; when a pass fails it writes
``reproducer.ir`` (the IR the pass got) and ``reproducer.txt`` (the pipeline and the error).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.ir.core import Program
from autopar.ir.printer import print_program
from autopar.ir.verify import verify

PassFn = Callable[[Program, Any], Program]  # (program, the pass's options or None) -> program
PASSES: dict[str, PassFn] = {}


def register_pass(name: str):
    """Register ``fn(program, options) -> program`` under a kebab-case name."""

    def deco(fn: PassFn) -> PassFn:
        PASSES[name] = fn
        return fn

    return deco


@dataclass
class PassManager:
    pipeline: list[str] | str
    dump_dir: str | os.PathLike | None = None
    verify_each: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # pass name -> that pass's options
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.pipeline, str):
            self.pipeline = [p.strip() for p in self.pipeline.split(",") if p.strip()]
        _register_builtin()
        unknown = [p for p in self.pipeline if p not in PASSES]
        if unknown:
            raise AutoparError(f"unknown pass(es) {unknown}; registered passes: {sorted(PASSES)}")
        if self.dump_dir is None and os.environ.get("AUTOPAR_DUMP_DIR"):
            self.dump_dir = os.environ["AUTOPAR_DUMP_DIR"]

    def _dump(self, name: str, text: str) -> None:
        if self.dump_dir is None:
            return
        d = Path(self.dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)

    def run(self, prog: Program, first_index: int = 0) -> Program:
        if first_index == 0:
            self._dump("00-input.ir", print_program(prog))
        for i, name in enumerate(self.pipeline, first_index + 1):
            t0 = time.perf_counter()
            try:
                out = PASSES[name](prog, self.options.get(name))
                if self.verify_each:
                    verify(out)
            except Exception as e:
                self._dump("reproducer.ir", print_program(prog))
                self._dump(
                    "reproducer.txt",
                    f"pipeline: {','.join(self.pipeline)}\nfailed pass: {name}\n\n{traceback.format_exc()}",
                )
                if isinstance(e, AutoparError):
                    raise
                raise AutoparError(f"pass {name!r} failed: {type(e).__name__}: {e}") from e
            self.timings[name] = time.perf_counter() - t0
            prog = out
            self._dump(f"{i:02d}-{name}.ir", print_program(prog))
        return prog


def _register_builtin() -> None:
    if PASSES:
        return
    from autopar.passes import collectives, pipeline_split, shard

    register_pass("shard")(lambda p, opts: shard.shard(p, opts).program)
    register_pass("insert-collectives")(lambda p, opts: collectives.insert_collectives(p))
    register_pass("pipeline-split")(pipeline_split.pipeline_split)
