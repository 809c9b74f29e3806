"""A normal (non-editable) install ships ir/, schedule/, passes/, solver/ and runtime/ as autopar.* with their data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_maps_top_level_packages_under_autopar(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("autopar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "ir/core.py",
        "schedule/generators.py",
        "passes/shard.py",
        "solver/sharding/ilp.py",
        "solver/sharding/cost.py",
        "runtime/build/codegen.py",
    ):
        assert f"autopar/{module}" in names, module
    # every module of every folder: a subpackage missing from pyproject.toml's list would not ship
    for top in ("autopar", "ir", "schedule", "passes", "solver", "runtime"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT / top).as_posix()
            assert ("autopar/" + rel if top == "autopar" else f"autopar/{top}/{rel}") in names, path
    assert "autopar/solver/cluster/presets/dgx-a100.yaml" in names
    assert not any(n.startswith(("ir/", "schedule/", "passes/", "solver/", "runtime/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "autopar = autopar.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
