"""Notebooks execute headless from a clean kernel, as a reader would run them."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> nbformat.NotebookNode:
    """Run every cell of ``notebooks/<name>`` in a fresh ``python3`` kernel of this interpreter.

    jupyter_client starts a kernel spec whose argv names ``python`` with ``sys.executable``, and the
    venv's own spec (``.venv/share/jupyter/kernels/python3``) comes first on the search path, so the
    kernel sees the editable autopar install. A failing cell raises ``CellExecutionError``.
    """
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    resources = {"metadata": {"path": str(NOTEBOOKS)}}
    NotebookClient(nb, kernel_name="python3", timeout=120, resources=resources).execute()
    return nb


def test_pipeline_schedules_notebook() -> None:
    nb = execute("pipeline_schedules.ipynb")
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 10  # 7 schedules + the transfer chart + the two plots
    text = "".join(o.get("text", "") for o in outputs)
    registered = next(line for line in text.splitlines() if line.startswith("registered schedules:"))
    assert {"gpipe", "1f1b", "interleaved", "wave", "scp"} <= set(registered.split(":")[1].replace(",", " ").split())


@pytest.mark.heavy  # 18 s; make test keeps the quickstart notebook, within its 15 minutes
def test_memory_vs_megatron_notebook() -> None:
    nb = execute("memory_vs_megatron.ipynb")
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    rows = [line for line in text.splitlines() if line.startswith("mmr-")]
    assert len(rows) >= 4 * 3 + 4  # the four model descriptions and the 12 table rows


def test_quickstart_notebook() -> None:
    nb = execute("quickstart.ipynb")
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the Gantt chart
    text = "".join(o.get("text", "") for o in outputs)
    assert "searched" in text and "MFU" in text  # the search's report
    assert "01-shard.ir" in text or "shard.ir" in text  # an IR dump per pass
    line = next(x for x in text.splitlines() if x.startswith("largest difference:"))
    assert float(line.split(":")[1]) < 1e-5  # the plan trains like one process
