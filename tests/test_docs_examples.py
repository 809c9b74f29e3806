"""The documented examples the issue found broken, as written (tests/test_docs_commands.py runs the shell
commands): the guide's and the README's Python snippets parse, and what they import and every ``autopar.X.Y``
they name exists; every Python snippet of README.md and docs/*.md runs as written (``<!-- snippet: ... -->`` on
the line before its fence says how: ``setup=NAME`` the names it takes from the page around it, ``ranks=N`` on N
spawned gloo ranks, ``heavy`` not in the default suite, ``skip: why`` for a sketch that cannot run here);
``search_model(..., top=5).format()``; ``models.build`` with a hidden size the heads do not
divide says which override fixes it; ``autopar check --help``'s example runs; ``autopar plan --list-models``
prints without importing torch, from a table equal to ``list_presets()``."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autopar.errors import PresetError, SearchError
from tests._dist import run_distributed

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


# -- every snippet runs as written --------------------------------------------------------------------------

SNIPPET_DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
MARK = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")


def marked_snippets() -> list[dict]:
    """Every ```python block of ``SNIPPET_DOCS`` with what its marker line says: doc, line (of its first
    line of code), code, ranks, setup, heavy, skip (the reason, or None), mark (the marker, or None)."""
    out = []
    for doc in SNIPPET_DOCS:
        lines = (ROOT / doc).read_text().splitlines()
        for line, code in python_snippets(ROOT / doc):
            fence = line - 2  # 0-based index of the fence line
            m = MARK.match(lines[fence - 1]) if fence > 0 else None
            entry = {"doc": doc, "line": line, "code": code, "ranks": 1, "setup": "none", "heavy": False}
            entry.update(skip=None, mark=m.group(1) if m else None)
            if m is not None:
                text = m.group(1)
                if text.startswith("skip:"):
                    entry["skip"] = text.removeprefix("skip:").strip()
                for word in text.split() if entry["skip"] is None else ():
                    key, _, value = word.partition("=")
                    if key == "heavy" and not value:
                        entry["heavy"] = True
                    elif key == "ranks":
                        entry["ranks"] = int(value)
                    elif key == "setup":
                        entry["setup"] = value
                    else:
                        raise AssertionError(f"{doc}:{line}: unknown snippet marker word {word!r}")
            out.append(entry)
    return out


def _tiny_lm():
    """A tiny GPT-2 (Hugging Face, float32) and three batches of 4 x 16 tokens."""
    from tests.equivalence import tiny_gpt2

    return tiny_gpt2(seed=0)


def _setup_none() -> dict:
    return {}


def _setup_cluster_file() -> dict:
    """docs/cluster_spec.md: a cluster file of its own to load (the preset it loads first, written out)."""
    from autopar.solver.cluster.spec import ClusterSpec

    ClusterSpec.load("dgx-a100:nodes=16").save("my_cluster.yaml")
    return {}


def _setup_prog() -> dict:
    """docs/pipeline.md: a captured program to cut into 4 stages (a 4-layer tiny GPT-2, 2 rows)."""
    from autopar.ir.core import MeshSpec
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.prune import prune_outputs

    spec = build("tiny-gpt2:n_layer=4", device="meta")
    kw = {k: v[:2] for k, v in spec.kwargs.items()}
    return {"prog": prune_outputs(lower(capture(spec.model, spec.args, kw), MeshSpec()))}


def _setup_lm() -> dict:
    """The README's and the guide's names: ``model`` (not compiled), ``ids``, ``labels``, ``batch``, ``loader``."""
    model, batches = _tiny_lm()
    b = batches[0]
    return {"model": model, "ids": b["input_ids"], "labels": b["labels"], "batch": b, "loader": batches[:2]}


def _setup_pipeline() -> dict:
    """docs/runtime.md's pipeline: ``model``, ``batch`` and ``data`` of a 4-layer tiny GPT-2, batches of 8 rows
    (dp=2 x 4 microbatches)."""
    from tests.equivalence import tiny_gpt2

    model, batches = tiny_gpt2(seed=0, batch=8, layers=4)
    return {"model": model, "batch": batches[0], "data": batches[:2]}


def _setup_mesh() -> dict:
    """``_setup_lm``'s names and ``mesh``, dp=2 x tp=2."""
    import autopar

    return {**_setup_lm(), "mesh": autopar.init_mesh("cpu", dp=2, tp=2)}


def _setup_compiled() -> dict:
    """``model`` compiled on dp=2 x tp=2 (README's plain loop)."""
    import autopar

    ns = _setup_mesh()
    ns["model"] = autopar.compile(ns["model"], ns["mesh"], kwargs=ns["batch"])
    return ns


def _dataset(n: int = 64, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (n, seq), generator=g)
    return [{"input_ids": x, "labels": torch.roll(x, -1, 0)} for x in ids]


def _setup_local_batches() -> dict:
    """The training loop's names: ``dataset`` (64 items), ``global_example`` (a global batch of 32),
    ``warmup_cosine``, ``val_batch`` (this rank's 16 rows), ``model`` and ``mesh``."""
    ns = _setup_mesh()
    dataset = _dataset()
    whole = torch.utils.data.default_collate(dataset[:32])
    ns.update(dataset=dataset, global_example=whole, warmup_cosine=lambda step: min(1.0, (step + 1) / 4))
    rows = slice(16 * ns["mesh"]["dp"].get_local_rank(), 16 * (ns["mesh"]["dp"].get_local_rank() + 1))
    ns["val_batch"] = {k: v[rows] for k, v in whole.items()}
    return ns


def _setup_trained() -> dict:
    """The checkpoint section's names: ``pipe`` (the Hugging Face model compiled on dp=2 x tp=2, one step
    trained), ``opt`` (make_optimizer's AdamW), ``sched``, ``loader`` (over autopar's BatchSampler), ``step``."""
    import autopar

    ns = _setup_mesh()
    pipe = autopar.compile(ns["model"], ns["mesh"], kwargs=ns["batch"])
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
    dataset = _dataset(16)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=autopar.data.BatchSampler(len(dataset), 4, pipe))
    pipe.train_step(**next(iter(loader)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return {**ns, "pipe": pipe, "opt": opt, "sched": sched, "loader": loader, "step": 1}


SETUPS = {
    "none": _setup_none,
    "cluster_file": _setup_cluster_file,
    "prog": _setup_prog,
    "lm": _setup_lm,
    "pipeline": _setup_pipeline,
    "mesh": _setup_mesh,
    "compiled": _setup_compiled,
    "local_batches": _setup_local_batches,
    "trained": _setup_trained,
}


def _run_snippet(s: dict, where: Path) -> None:
    """Run snippet ``s`` in a fresh namespace from its setup, in folder ``where`` (its relative paths);
    a traceback names the doc and its line."""
    import autopar

    where.mkdir(parents=True, exist_ok=True)
    old = os.getcwd()
    os.chdir(where)
    try:
        ns = {"__name__": "__snippet__", "torch": torch, "autopar": autopar, **SETUPS[s["setup"]]()}
        code = "\n" * (s["line"] - 1) + s["code"]  # tracebacks give the doc's own line numbers
        exec(compile(code, f"{s['doc']}", "exec"), ns)
    finally:
        os.chdir(old)


def _on_ranks(rank: int, world: int, root: str, chosen: list[dict]) -> list[str]:
    torch.manual_seed(0)
    done = []
    for i, s in enumerate(chosen):
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            _run_snippet(s, Path(root) / f"snippet-{i}")  # one folder for all ranks: a checkpoint's ranks share it
        torch.distributed.barrier()
        done.append(f"{s['doc']}:{s['line']}")
    return done


def _chosen(heavy: bool, ranks: int | None) -> list[dict]:
    return [
        s
        for s in marked_snippets()
        if s["skip"] is None and s["heavy"] == heavy and (s["ranks"] == 1 if ranks is None else s["ranks"] == ranks)
    ]


def test_every_python_snippet_says_how_it_runs():
    """A new snippet needs a marker: running it, or saying why it cannot run here."""
    found = marked_snippets()
    assert len(found) >= 15
    unmarked = [f"{s['doc']}:{s['line']}" for s in found if s["mark"] is None]
    assert not unmarked, f"give these a <!-- snippet: ... --> line before the fence: {unmarked}"
    assert {s["setup"] for s in found} <= set(SETUPS)
    assert all(s["skip"] for s in found if s["mark"].startswith("skip")), "a skip says why"
    ran = [s for s in found if s["skip"] is None]
    assert len(ran) >= 2 * len([s for s in found if s["skip"]]), "most snippets run"


@pytest.mark.parametrize("s", _chosen(False, None), ids=lambda s: f"{s['doc']}:{s['line']}")
def test_the_single_process_snippets_run(s, tmp_path):
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        _run_snippet(s, tmp_path)


@pytest.mark.multiproc
def test_the_four_rank_snippets_run(tmp_path):
    """The README's loops and the guide's quickstart, as written, on 4 gloo ranks (one spawn)."""
    chosen = _chosen(False, 4)
    assert chosen
    for done in run_distributed(_on_ranks, 4, str(tmp_path), chosen):
        assert done == [f"{s['doc']}:{s['line']}" for s in chosen]


@pytest.mark.heavy
def test_the_heavy_snippets_run(tmp_path):
    """The snippets that compile several models or search a large one: in one process, on 4 ranks, on 8."""
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        for i, s in enumerate(_chosen(True, None)):
            _run_snippet(s, tmp_path / f"single-{i}")
    for ranks in (4, 8):
        chosen = _chosen(True, ranks)
        if chosen:
            for done in run_distributed(_on_ranks, ranks, str(tmp_path / f"ranks{ranks}"), chosen, timeout=900.0):
                assert done == [f"{s['doc']}:{s['line']}" for s in chosen]


@pytest.mark.heavy
def test_the_demo_names_the_roles_it_used(tmp_path):
    """``make demo`` (examples/train_gpt2.py, 4 gloo processes under torchrun; here 2 steps): rank 0 prints the
    plan's block, which names the roles (by name), tp's Megatron layout and dp's batch split, and holds about
    half the model (tp=2 splits it), not all of it as before roles by name; the losses match one process."""
    import argparse
    import runpy

    demo = runpy.run_path(str(ROOT / "examples" / "train_gpt2.py"))
    args = argparse.Namespace(seq=64, n_embd=128, n_layer=2, n_head=4, seed=0)  # the demo's defaults
    total = sum(p.numel() for p in demo["build_model"](args).parameters())
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt2.py"), "--steps", "2", "--out", str(tmp_path / "p.json")],
        capture_output=True, text=True, cwd=tmp_path, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "plan on mesh [dp=2, tp=2] (roles by name)" in text
    assert "tp=2: tensor parallel (Megatron)" in text and "dp=2: data parallel: batch split" in text
    held = int(re.search(r"holds ([\d,]+) parameters", text).group(1).replace(",", ""))
    assert held < 0.6 * total, (held, total)
    assert "largest relative loss difference" in text
