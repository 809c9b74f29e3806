"""PassManager: run named passes in order, verify after each, time each, dump the IR between them.

    pm = PassManager(["shard", "insert-collectives"], dump_dir="out/ir")
    prog = pm.run(prog)

Every pass of the flow (``autopar.passes.flow.FLOW``) that rewrites IR is registered here by name:
``shard``, ``insert-collectives``, ``split``, ``assign-stages``, ``prune-outputs``, ``insert-transfers``.
A pass returns the new program, or ``(program, info)`` where ``info`` is its report (the solver's
``ShardResult``, the stage plan), kept in ``PassManager.info`` under the pass's name.

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
from autopar.passes.assign_stages import assign_stages_pass
from autopar.passes.collectives import insert_collectives
from autopar.passes.pipeline_split import pipeline_split
from autopar.passes.prune import prune_outputs
from autopar.passes.shard import ShardOptions, ShardResult, shard
from autopar.passes.transfers import insert_transfers

PassFn = Callable[[Program, Any], Any]  # (program, the pass's options or None) -> program or (program, info)
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
    info: dict[str, Any] = field(default_factory=dict)  # pass name -> what it reported besides the program

    def __post_init__(self):
        if isinstance(self.pipeline, str):
            self.pipeline = [p.strip() for p in self.pipeline.split(",") if p.strip()]
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
                if isinstance(out, tuple):
                    out, self.info[name] = out
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


def _shard(prog: Program, opts: ShardOptions | None) -> tuple[Program, ShardResult]:
    result = shard(prog, opts)
    return result.program, result


register_pass("shard")(_shard)
register_pass("insert-collectives")(lambda p, opts: insert_collectives(p))
register_pass("split")(pipeline_split)
register_pass("assign-stages")(assign_stages_pass)
register_pass("prune-outputs")(lambda p, opts: prune_outputs(p))
register_pass("insert-transfers")(lambda p, opts: insert_transfers(p, **(opts or {})))
