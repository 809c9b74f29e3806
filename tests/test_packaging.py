"""A normal (non-editable) install ships ir/, passes/, solver/ and runtime/ as autopar.* with their data."""

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
    for module in ("ir/core.py", "passes/shard.py", "solver/ilp.py", "solver/cost.py", "runtime/codegen.py"):
        assert f"autopar/{module}" in names, module
    assert "autopar/solver/clusters/dgx-a100.yaml" in names
    assert not any(n.startswith(("ir/", "passes/", "solver/", "runtime/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "autopar = autopar.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
