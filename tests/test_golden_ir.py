"""Golden IR: the printed IR after every pass of the flow, for a few small models and meshes, compared exactly.

Each case (``CASES``) plans one model on one mesh through ``passes/flow.py:plan_program`` with a dump folder and
compares every ``*.ir`` dump (``02-lower.ir`` ... ``08-insert-transfers.ir`` and ``08-insert-transfers.forward.ir``)
byte for byte with ``tests/golden/<case>/``; a file produced but not checked in, or checked in but no longer
produced, fails too. A change in what a pass emits is thereby seen in review, as a diff of these files.

Refresh after an intended change, then review ``git diff tests/golden`` and commit it with the change::

    make golden                                       # every case: python -m tests.test_golden_ir --refresh
    python -m tests.test_golden_ir --refresh mlp-one  # one case

Planning is made independent of the machine and the environment: priced on the ``dgx-a100`` preset with an
explicit budget (``planning_options``: the device memory, or the case's own), no plan cache
(``FlowOptions(cache=False)``, ``AUTOPAR_CACHE_DIR=off``), and ``AUTOPAR_DUMP_DIR`` unset. Planning only (meta
device), ~10 s, most of it capturing GPT-2.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.api import parse_mesh
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes.capture import Captured, capture
from autopar.passes.flow import FlowOptions, plan_program
from autopar.passes.shard import ShardOptions, planning_options
from autopar.solver.cluster.spec import ClusterSpec

GOLDEN = Path(__file__).resolve().parent / "golden"
REFRESH = "make golden (python -m tests.test_golden_ir --refresh)"
CLUSTER = "dgx-a100"
GPT2 = "gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,batch=4,seq=8"
# the environment a plan may read: the dump folder would add files, the plan cache could return an old solve
UNSET_ENV = ("AUTOPAR_DUMP_DIR",)
OFF_ENV = {"AUTOPAR_CACHE_DIR": "off"}
DIFF_LINES = 80  # of the first differing file's unified diff; the rest is counted


class TwoLayerMLP(nn.Module):
    """Linear, ReLU, Linear and the MSE loss: every line of its plans can be read in review."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), target)


@dataclass(frozen=True)
class Case:
    """One golden folder: a model planned on a mesh with these ShardOptions fields (besides the cluster)."""

    name: str
    model: str  # "mlp" (TwoLayerMLP) or "gpt2" (GPT2)
    mesh: str
    shard: dict = field(default_factory=dict)


# At these sizes the default (least step time within the device memory) replicates everything on dgx-a100, since
# communication costs more than it saves; the other cases ask for what makes the passes shard and communicate.
CASES = (
    Case("mlp-one", "mlp", "dp=1"),  # one device, the default options
    Case("mlp-dp2", "mlp", "dp=2", {"data_parallel": "activations"}),  # the batch split over dp
    Case("mlp-tp2-memory", "mlp", "tp=2", {"objective": "memory"}),  # weights sharded, reduce-scatter
    # the least time within a budget too small to replicate in (all of it replicated: 609 kB; the least: 307 kB)
    Case("gpt2-tp2-budget", "gpt2", "tp=2", {"budget_bytes": 400_000.0}),
    Case("gpt2-dp2-tp2-memory", "gpt2", "dp=2,tp=2", {"objective": "memory"}),  # gathers, local shards on two axes
    Case("gpt2-pp2-tp2", "gpt2", "pp=2,tp=2"),  # two stages, send/recv, the default options
    # roles by name (TrainConfig's default): dp splits the batch, tp lays the weights out as Megatron
    Case("gpt2-dp2-tp2-roles", "gpt2", "dp=2,tp=2", {"roles": "name"}),
)


@functools.cache
def captured(model: str) -> Captured:
    """The model captured on the meta device (once per process: torch.export takes seconds on GPT-2)."""
    if model == "mlp":
        with torch.device("meta"):
            mlp = TwoLayerMLP()
        x = torch.empty(8, 16, device="meta")
        return capture(mlp, (x, torch.empty_like(x)))
    spec = build(GPT2, device="meta")
    return capture(spec.model, spec.args, spec.kwargs)


def shard_options(case: Case) -> ShardOptions:
    """The case's options priced on the fixed cluster, with the budget ``planning_options`` gives (the device
    memory) unless the case sets its own."""
    return planning_options(ShardOptions(**case.shard), ClusterSpec.load(CLUSTER))


def read_ir(folder: Path) -> dict[str, str]:
    """Every ``*.ir`` file of ``folder`` by name, its exact text (no newline translation)."""
    return {p.name: p.read_bytes().decode() for p in sorted(folder.glob("*.ir"))}


def produce(case: Case, dump_dir: Path) -> dict[str, str]:
    """Plan ``case`` with its dumps in ``dump_dir``; the IR after every pass by file name. The caller clears
    ``AUTOPAR_DUMP_DIR`` and ``AUTOPAR_CACHE_DIR`` (``UNSET_ENV``, ``OFF_ENV``)."""
    assert not any(os.environ.get(k) for k in UNSET_ENV) and all(os.environ.get(k) == v for k, v in OFF_ENV.items())
    options = FlowOptions(shard_options(case), cache=False)
    plan_program(captured(case.model), parse_mesh(case.mesh), options, dump_dir=dump_dir)
    return read_ir(dump_dir)


def mismatch(case: str, produced: Mapping[str, str], golden: Mapping[str, str]) -> str | None:
    """None when ``produced`` equals ``golden`` file for file, byte for byte; else what differs: the files
    produced and not checked in, those checked in and not produced, and the unified diff of the first differing
    file, with how to refresh."""
    new = sorted(set(produced) - set(golden))
    gone = sorted(set(golden) - set(produced))
    changed = [n for n in sorted(set(produced) & set(golden)) if produced[n] != golden[n]]
    if not (new or gone or changed):
        return None
    where = f"tests/golden/{case}"
    lines = [f"golden IR of case {case!r} differs from {where}/:"]
    if new:
        lines.append(f"  produced, not checked in: {', '.join(new)}")
    if gone:
        lines.append(f"  checked in, no longer produced: {', '.join(gone)}")
    if changed:
        lines.append(f"  differ: {', '.join(changed)}; the first:")
        first = changed[0]
        diff = list(
            difflib.unified_diff(
                golden[first].splitlines(keepends=True),
                produced[first].splitlines(keepends=True),
                f"{where}/{first} (checked in)",
                f"{first} (produced)",
            )
        )
        shown = [d if d.endswith("\n") else d + "\n\\ No newline at end of file\n" for d in diff[:DIFF_LINES]]
        lines.append("".join(shown).rstrip("\n"))
        if len(diff) > DIFF_LINES:
            lines.append(f"... {len(diff) - DIFF_LINES} more diff lines")
    lines.append(
        f"If the change in what the passes emit is intended: {REFRESH}, then review `git diff tests/golden` and "
        "commit it with the change (tests/golden/README.md)."
    )
    return "\n".join(lines)


def refresh(cases: tuple[Case, ...], dump_root: Path) -> None:
    """Rewrite ``tests/golden/<case>/`` for ``cases`` (the files of each exactly those produced now), planning
    in ``dump_root``."""
    for case in cases:
        produced = produce(case, dump_root / case.name)
        folder = GOLDEN / case.name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in set(read_ir(folder)) - set(produced):
            (folder / stale).unlink()
        for name, text in produced.items():
            (folder / name).write_bytes(text.encode())
        print(f"{folder.relative_to(GOLDEN.parent.parent)}: {len(produced)} files")


@pytest.fixture
def planning_env(monkeypatch):
    for k in UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in OFF_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ir_after_every_pass_is_the_golden_ir(case, planning_env, tmp_path):
    produced = produce(case, tmp_path)
    assert "02-lower.ir" in produced and "08-insert-transfers.forward.ir" in produced, sorted(produced)
    problem = mismatch(case.name, produced, read_ir(GOLDEN / case.name))
    if problem:
        pytest.fail(problem, pytrace=False)


def test_golden_folders_are_the_cases():
    """A case renamed or removed leaves no folder behind, and every case has one."""
    folders = {p.name for p in GOLDEN.iterdir() if p.is_dir()}
    names = {c.name for c in CASES}
    assert folders == names, (
        f"folders without a case: {sorted(folders - names)}, cases without a folder: {sorted(names - folders)}; "
        f"{REFRESH}"
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_files_parse_verify_and_print_back(case):
    files = read_ir(GOLDEN / case.name)
    assert files, f"tests/golden/{case.name}/ has no IR: {REFRESH}"
    for name, text in files.items():
        prog = parse(text)
        verify(prog)
        assert print_program(prog) == text, name


def test_a_changed_line_or_file_is_reported(planning_env, tmp_path):
    """The comparison is not vacuous: against one case's IR as produced, one placement changed, a file missing,
    a file extra and one byte more each fail it."""
    ir = produce(next(c for c in CASES if c.name == "mlp-tp2-memory"), tmp_path)
    assert mismatch("mlp-tp2-memory", dict(ir), ir) is None
    name = "03-shard.ir"
    lines = ir[name].splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith("param %fc1.weight") and "{S(0)}" in line)
    changed = dict(ir, **{name: "".join(lines[:i] + [lines[i].replace("{S(0)}", "{R}")] + lines[i + 1 :])})
    report = mismatch("mlp-tp2-memory", changed, ir)
    assert report is not None and "differ: 03-shard.ir;" in report
    assert f"-{lines[i]}" in report and f"+{lines[i].replace('{S(0)}', '{R}')}" in report
    assert "make golden" in report
    missing = {k: v for k, v in ir.items() if k != "05-split.ir"}
    assert "checked in, no longer produced: 05-split.ir" in mismatch("mlp-tp2-memory", missing, ir)
    extra = dict(ir, **{"09-new-pass.ir": ir[name]})
    assert "produced, not checked in: 09-new-pass.ir" in mismatch("mlp-tp2-memory", extra, ir)
    one_byte = dict(ir, **{name: ir[name] + "\n"})
    assert mismatch("mlp-tp2-memory", one_byte, ir) is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.test_golden_ir", description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true", help="rewrite tests/golden/ from what the passes emit now")
    ap.add_argument("cases", nargs="*", help="case names (default: all): " + ", ".join(c.name for c in CASES))
    args = ap.parse_args(argv)
    if not args.refresh:
        ap.error("nothing to do: pass --refresh (the check itself runs under pytest)")
    known = {c.name: c for c in CASES}
    unknown = [n for n in args.cases if n not in known]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; cases: {', '.join(known)}")
    for k in UNSET_ENV:
        os.environ.pop(k, None)
    os.environ.update(OFF_ENV)
    torch.set_num_threads(1)
    if not args.cases:  # a case no longer in CASES leaves no folder behind
        for folder in (p for p in GOLDEN.iterdir() if p.is_dir() and p.name not in known):
            for stale in read_ir(folder):
                (folder / stale).unlink()
            folder.rmdir()
            print(f"removed tests/golden/{folder.name}")
    with tempfile.TemporaryDirectory(prefix="autopar-golden-") as tmp:
        refresh(tuple(known[n] for n in args.cases) or CASES, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
