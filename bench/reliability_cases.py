"""Run the reliability cases of issue 34 and print their table with the outcome of this run.

Each row of the table in ``docs/reliability.md`` names the case, what it did before, what it does now and the
test that drives it (``tests/test_faults.py`` unless the row says another file). This script runs those tests
(one pytest invocation, gloo ranks spawned where a case needs them) and prints the table with a last column,
``this run``: passed or failed, from pytest's JUnit report. ``--write`` puts that column into the docs' table.
A row without a test ("not done") is listed as not run. About five minutes on 2 cores.

    OMP_NUM_THREADS=1 .venv/bin/python bench/reliability_cases.py [--write]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"


def rows(text: str) -> list[list[str]]:
    """The table's data rows, each as its cells."""
    out = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| case") and not line.startswith("| ---"):
            out.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return out


def tests_of(cell: str) -> list[str]:
    """The pytest node ids a row's test cell names."""
    file = re.search(r"(tests/test_\w+\.py)", cell)
    path = file.group(1) if file else "tests/test_faults.py"
    return [f"{path}::{name}" for name in re.findall(r"`(test_\w+)`", cell)]


def run(nodes: list[str]) -> dict[str, tuple[str, float]]:
    """Each test function's outcome (passed/failed/skipped) and seconds, over its parametrizations."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodes]
        subprocess.run(cmd, cwd=ROOT, check=False)
        tree = ET.parse(report)
    out: dict[str, tuple[str, float]] = {}
    for case in tree.iter("testcase"):
        name = case.get("name", "").split("[")[0]
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else "passed"
        if case.find("skipped") is not None:
            state = "skipped"
        old_state, old_t = out.get(name, ("passed", 0.0))
        worst = state if state != "passed" else old_state
        out[name] = (worst, old_t + float(case.get("time", 0)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="put this run's column into docs/reliability.md")
    args = ap.parse_args()
    text = DOC.read_text()
    table = rows(text)
    named: list[list[str]] = []  # each row's node ids; "same test" repeats the row above's
    for r in table:
        named.append(named[-1] if r[3].startswith("same") and named else tests_of(r[3]))
    nodes = sorted({n for ns in named for n in ns})
    results = run(nodes)
    lines = [
        "| case | before | now | test (tests/test_faults.py unless said) | this run |",
        "| --- | --- | --- | --- | --- |",
    ]
    failed = 0
    for r, ns in zip(table, named):
        names = [n.split("::")[1] for n in ns]
        got = [results.get(n, ("not collected", 0.0)) for n in names]
        if not got:
            verdict = "not run (no test)"
        else:
            bad = [f"{n}: {s}" for n, (s, _t) in zip(names, got) if s != "passed"]
            failed += bool(bad)
            verdict = "; ".join(bad) if bad else "passed"
        lines.append("| " + " | ".join([*r[:4], verdict]) + " |")
    print("\n".join(lines))
    if args.write:
        old = [ln for ln in text.splitlines() if ln.startswith("| ")]
        start = text.index(old[0])
        end = text.index(old[-1]) + len(old[-1])
        DOC.write_text(text[:start] + "\n".join(lines) + text[end:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
