"""The documented examples the issue found broken, as written (tests/test_docs_commands.py runs the shell
commands): the guide's and the README's Python snippets parse, and what they import and every ``autopar.X.Y``
they name exists; ``search_model(..., top=5).format()``; ``models.build`` with a hidden size the heads do not
divide says which override fixes it; ``autopar check --help``'s example runs; ``autopar plan --list-models``
prints without importing torch, from a table equal to ``list_presets()``."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.errors import PresetError, SearchError

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/user_guide.md")


def python_snippets(path: Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block."""
    out, block, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if block is None and line.strip().startswith("```python"):
            block, start = [], i + 1
        elif block is not None and line.strip().startswith("```"):
            out.append((start, textwrap.dedent("\n".join(block))))  # a block inside a list item is indented
            block = None
        elif block is not None:
            block.append(line)
    return out


def _resolve(dotted: str) -> None:
    """Import the longest module prefix of ``dotted`` and read the rest as attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(dotted)


@pytest.mark.parametrize("doc", DOCS)
def test_the_python_snippets_parse_and_name_what_exists(doc):
    snippets = python_snippets(ROOT / doc)
    assert snippets, doc
    for line, code in snippets:
        tree = ast.parse(code, filename=f"{doc}:{line}")  # a SyntaxError names the block's line
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
            elif isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for a in node.names:
                    assert hasattr(module, a.name) or importlib.util.find_spec(f"{node.module}.{a.name}"), (
                        f"{doc}:{line}: {node.module} has no {a.name}"
                    )
        for dotted in set(re.findall(r"\bautopar(?:\.[A-Za-z_]\w*)+", code)):
            try:
                _resolve(dotted)
            except (ImportError, AttributeError) as e:
                raise AssertionError(f"{doc}:{line}: {dotted} does not exist ({e})") from None


def test_the_search_keeps_what_format_shows():
    from autopar.search import search_model

    result = search_model("gpt2:n_layer=2", "dgx-a100", global_batch=8, top=2)
    text = result.format()
    assert len([row for row in text.splitlines() if re.match(r"\s*[12] ", row)]) == min(2, len(result.best))
    with pytest.raises(SearchError, match=r"search_model\(\.\.\., top=5\)"):
        result.format(top=5)


def test_a_hidden_size_the_heads_do_not_divide_names_the_fix():
    from autopar.models.resolve import build

    with pytest.raises(PresetError, match=r"n_embd=64 is not a multiple of the 12 attention heads.*n_head=8"):
        build("gpt2:n_layer=2,n_embd=64,batch=4,seq=16", device="meta")
    spec = build("gpt2:n_layer=2,n_embd=64,n_head=4,batch=4,seq=16", device="meta")  # the guide's spelling
    assert spec.model.config.n_head == 4


def test_check_help_example_runs(capsys):
    from autopar.cli import build_parser, main

    parser = build_parser()
    check = parser._subparsers._group_actions[0].choices["check"]  # the subcommand's own parser
    example = check.epilog.removeprefix("example: ").split()
    assert example[0] == "autopar" and "vocab_size=256" in example[2]
    assert main(example[1:]) == 0, capsys.readouterr()


def test_list_models_prints_at_once_from_the_current_table():
    from autopar.models.preset_table import PRESET_TABLE
    from autopar.models.presets import list_presets

    assert PRESET_TABLE == list_presets(), "refresh it: python -m autopar.models.preset_table"
    code = (
        "import sys; from autopar.cli import main; assert main(['plan', '--list-models']) == 0; "
        "assert 'torch' not in sys.modules, 'imported torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("gpt2 ") and len(out.stdout.splitlines()) == len(PRESET_TABLE)
