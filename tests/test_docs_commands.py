"""Every `autopar` command shown in README.md and docs/user_guide.md runs, so a documented command that breaks fails.

What is a command: a line in a fenced code block whose language is empty or a shell (``sh``, ``bash``,
``shell``, ``console``) that starts with ``autopar ``, ``python -m autopar``, ``torchrun``, ``srun`` or
``sbatch`` (a trailing ``\\`` joins the next line). Inline spans in prose (`autopar explain`) name
commands, they are not examples, and blocks in other languages (python, json) are not shell.

How each is checked, in file order, all of one file in one temporary directory (so ``explain plan.json``
reads the plan an earlier ``plan ... -o plan.json`` wrote):

- ``autopar ...`` / ``python -m autopar ...``: run in-process through ``autopar.cli.main`` (no
  interpreter start per command) with a time cap; it must exit 0, and every file it was told to write
  (``-o``, ``--output``, ``--chart``, ``--dump-dir``) must exist afterwards. The cap is a hang guard set
  far above the measured time (``CAP_SECONDS``), not a performance check; a command past it fails the
  test, though its thread cannot be stopped.
- a line with ``torchrun``, ``srun``, ``sbatch`` or a GPU (``cuda``, ``nccl``) cannot run here: it is
  parsed only. torchrun's own arguments go through torch's ``torchrun`` parser; an ``autopar`` command
  inside it must have a subcommand whose ``--help`` works and arguments that parse.
- a usage synopsis (``autopar plan MODEL --mesh dp=2,tp=4 [--zero 0-3] ...``) has placeholders and
  cannot run: its block is marked by ``<!-- doc-test: synopsis -->`` on the line before the fence, and
  each of its commands (indented lines continue the one above) is checked for a subcommand that
  exists and options that subcommand knows. An unmarked synopsis fails as a command that does not run.
- a line ending in ``# doc-test: skip``, or following ``<!-- doc-test: skip -->``, is not checked.
  Use it only for a command that cannot run anywhere without a cluster and say why beside it.

Failures name the file and line. Cost, measured on the shared 2-core machine (wall, with other work
running; about 80 s of CPU in all): README.md 65 s (gpt2-xl on pp=4,dp=2,tp=2: 40 s, gpt2 on dp=2,tp=4
with its baselines: 15 s), docs/user_guide.md 90 s (the gpt3-175b search writing its plan: 70 s, two
captures of the 96-layer model, torch.export's time; gpt2-xl's search: 19 s). Nothing here is faster
without changing what the documents show, so these run as documented, under the cap.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/user_guide.md")
CAP_SECONDS = 600.0  # hang guard (the suite's own timeout): gpt3-175b took 70 s alone, 149 s beside 2 workers
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
LAUNCHERS = ("torchrun", "srun", "sbatch")
OUTPUT_FLAGS = ("-o", "--output", "--chart", "--dump-dir")
MARK_SKIP = "doc-test: skip"
MARK_SYNOPSIS = "doc-test: synopsis"


@dataclass(frozen=True)
class Command:
    file: str
    line: int  # 1-based line of the command's first line
    text: str
    kind: str  # "run" | "parse" (launcher / GPU lines) | "synopsis"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _is_command(text: str) -> bool:
    words = text.split()
    if not words:
        return False
    if words[0] == "autopar" or words[0] in LAUNCHERS:
        return True
    return re.match(r"python3?\s+-m\s+autopar(\s|$)", text) is not None


def extract(path: Path, name: str | None = None) -> list[Command]:
    """The commands in the fenced shell blocks of a markdown file, in order (see the module docstring)."""
    name = name or str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    out: list[Command] = []
    lang: str | None = None  # inside a fence: its language
    synopsis = skip_next = False
    pending: tuple[int, str] | None = None  # a command continued with a trailing backslash
    for i, raw in enumerate(lines, 1):
        stripped = raw.strip()
        fence = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
        if fence:
            if lang is None:
                lang = fence.group(2).lower()
                synopsis = i >= 2 and MARK_SYNOPSIS in lines[i - 2]
            else:
                lang, synopsis = None, False
            continue
        if lang is None:
            skip_next = stripped.startswith("<!--") and MARK_SKIP in stripped
            continue
        if lang not in SHELL_LANGS:
            continue
        if pending is not None:
            start, text = pending
            text = text + " " + stripped.rstrip("\\").strip()
            pending = (start, text) if stripped.endswith("\\") else None
            if pending is None:
                out.append(_command(name, start, text, synopsis))
            continue
        if synopsis and out and raw[:1].isspace() and stripped.startswith("["):
            prev = out[-1]
            out[-1] = Command(prev.file, prev.line, prev.text + " " + stripped, prev.kind)
            continue
        if not _is_command(stripped) or MARK_SKIP in stripped or skip_next:
            skip_next = False
            continue
        if stripped.endswith("\\"):
            pending = (i, stripped.rstrip("\\").strip())
        else:
            out.append(_command(name, i, stripped, synopsis))
    return out


def _command(name: str, line: int, text: str, synopsis: bool) -> Command:
    text = _strip_comment(text)
    words = text.split()
    gpu = re.search(r"\b(cuda|nccl)\b", text) is not None
    kind = "synopsis" if synopsis else "parse" if words[0] in LAUNCHERS or gpu else "run"
    return Command(name, line, text, kind)


def _strip_comment(text: str) -> str:
    return re.sub(r"\s+#.*$", "", text).strip()


def autopar_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``autopar`` / ``python -m autopar`` in words, or None if there is none."""
    for k, w in enumerate(words):
        if w == "autopar" or w.endswith("/autopar"):
            return words[k + 1 :]
        if w == "-m" and k + 1 < len(words) and words[k + 1] == "autopar":
            return words[k + 2 :]
    return None


def run_autopar(argv: list[str], cap: float = CAP_SECONDS) -> tuple[int | None, str]:
    """Run ``autopar argv`` in-process in a thread: (exit status or None past the cap, stdout + stderr)."""
    from autopar.cli import main

    buf = io.StringIO()
    result: list[int] = []

    def target() -> None:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                result.append(int(main(argv) or 0))
            except SystemExit as e:  # argparse: --help, usage errors
                result.append(e.code if isinstance(e.code, int) else 1 if e.code else 0)
            except Exception as e:  # noqa: BLE001 - reported with the command's file and line
                result.append(1)
                print(f"{type(e).__name__}: {e}", file=buf)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(cap)
    return (result[0] if result else None), buf.getvalue()


def check_parses(cmd: Command) -> str | None:
    """A launcher / GPU line: torchrun's arguments parse; an autopar command in it has a subcommand with a
    working ``--help`` and arguments that parse. Returns what is wrong, or None."""
    words = shlex.split(cmd.text)
    argv = autopar_argv(words)
    if argv is not None:
        return _check_autopar_parses(argv)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                get_args_parser().parse_args(words[1:])
        except SystemExit:
            return f"torchrun does not accept it: {err.getvalue().strip().splitlines()[-1]}"
        return None
    return f"{words[0]} line without an autopar or torchrun command to check: mark it `# {MARK_SKIP}` and say why"


def _check_autopar_parses(argv: list[str]) -> str | None:
    from autopar.cli import build_parser

    if not argv:
        return "`autopar` without a subcommand"
    rc, out = run_autopar([argv[0], "--help"], cap=60.0)
    if rc != 0:
        return f"`autopar {argv[0]} --help` exited {rc}: {out[-2000:]}"
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            build_parser().parse_args(argv)
    except SystemExit:
        return f"the arguments do not parse: {err.getvalue().strip()}"
    return None


def check_synopsis(cmd: Command) -> str | None:
    """A usage synopsis: its subcommand exists and every option it names is one that subcommand knows."""
    from autopar.cli import build_parser

    words = cmd.text.replace("[", " ").replace("]", " ").replace("|", " ").split()
    argv = autopar_argv(words)
    if not argv:
        return "a synopsis without a subcommand"
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    if argv[0] not in sub.choices:
        return f"no subcommand {argv[0]!r}; there are {', '.join(sub.choices)}"
    known = set(sub.choices[argv[0]]._option_string_actions)
    named = [w.split("=")[0] for w in argv[1:] if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]
    unknown = [w for w in named if w not in known]
    return f"`autopar {argv[0]}` has no option {', '.join(unknown)}" if unknown else None


def run_command(cmd: Command) -> str | None:
    """Check one extracted command in the current directory; returns what is wrong, or None."""
    if cmd.kind == "synopsis":
        return check_synopsis(cmd)
    if cmd.kind == "parse":
        return check_parses(cmd)
    words = shlex.split(cmd.text)
    argv = autopar_argv(words)
    if argv is None:
        return f"not an autopar command: {cmd.text}"
    t0 = time.perf_counter()
    rc, out = run_autopar(argv)
    seconds = time.perf_counter() - t0
    if rc is None:
        return f"still running after {CAP_SECONDS:.0f} s (the cap)"
    if rc != 0:
        return f"exited {rc} after {seconds:.1f} s:\n{out[-3000:]}"
    missing = [argv[k + 1] for k, w in enumerate(argv[:-1]) if w in OUTPUT_FLAGS and not Path(argv[k + 1]).exists()]
    if missing:
        return f"exited 0 but did not write {', '.join(missing)}"
    print(f"{cmd.where}: {seconds:.1f} s  {cmd.text}")
    return None


def check_file(path: Path, name: str | None = None) -> list[str]:
    """Run every command of one markdown file in order; one 'file:line: `command`: problem' per failure."""
    failures = []
    for cmd in extract(path, name):
        problem = run_command(cmd)
        if problem:
            failures.append(f"{cmd.where}: `{cmd.text}`: {problem}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_documented_commands_run(doc, tmp_path, monkeypatch):
    commands = extract(ROOT / doc)
    assert any(c.kind == "run" for c in commands), f"no runnable autopar command found in {doc}"
    monkeypatch.chdir(tmp_path)
    failures = check_file(ROOT / doc)
    assert not failures, "documented commands that do not work:\n" + "\n".join(failures)


def test_extraction_and_failures_name_the_file_and_line(tmp_path, monkeypatch):
    """The checker itself: what it extracts, and that broken commands fail it with their file and line
    (so the documented-commands test cannot pass vacuously)."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Intro `autopar plan gpt2` (inline: not a command).\n"
        "```python\n"
        "autopar = 1  # python, not shell\n"
        "```\n"
        "```\n"
        "make demo\n"
        "autopar simulate --schedule 1f1b --stages 2 \\\n"
        "    --microbatches 4 --chart g.png   # a comment\n"
        "autopar plan no-such-preset --mesh tp=2\n"
        "autopar simulate --no-such-option\n"
        "autopar plan tiny-mlp --mesh tp=2 --no-baselines   # doc-test: skip (an example of the marker)\n"
        "torchrun --nproc-per-node 4 train.py\n"
        "torchrun --no-such-torchrun-flag train.py\n"
        "srun autopar plan tiny-mlp --mesh tp=2 --device cuda\n"
        "```\n"
        "<!-- doc-test: synopsis -->\n"
        "```\n"
        "autopar plan MODEL --mesh dp=2,tp=4 [--zero 0-3]\n"
        "             [--no-such-flag] [-o plan.json]\n"
        "autopar explain plan.json OP\n"
        "```\n"
    )
    commands = extract(doc, "doc.md")
    assert [(c.line, c.kind) for c in commands] == [
        (7, "run"),
        (9, "run"),
        (10, "run"),
        (12, "parse"),
        (13, "parse"),
        (14, "parse"),
        (18, "synopsis"),
        (20, "synopsis"),
    ]
    assert commands[0].text == "autopar simulate --schedule 1f1b --stages 2 --microbatches 4 --chart g.png"
    assert commands[6].text.endswith("[--no-such-flag] [-o plan.json]")
    monkeypatch.chdir(tmp_path)
    failures = check_file(doc, "doc.md")
    assert [f.split(":")[1] for f in failures] == ["9", "10", "13", "14", "18"], failures
    problems = [f.split("`: ", 1)[1] for f in failures]
    assert "no-such-preset" in problems[0] and "exited 2" in problems[0]
    assert "--no-such-option" in problems[1]
    assert "--no-such-torchrun-flag" in problems[2]
    assert "--device" in problems[3]  # autopar plan has no --device option
    assert "--no-such-flag" in problems[4] and "--zero" not in problems[4]
    assert (tmp_path / "g.png").exists()
