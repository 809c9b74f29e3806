"""The `autopar` command line: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import importlib
import sys

from autopar.cli.listing import print_models, wants_models
from autopar.errors import AutoparError

# Subcommand name -> module under autopar.cli. Adding a subcommand is one line here plus its module.
SUBCOMMANDS = {
    "ir": "autopar.cli.ir",
    "plan": "autopar.cli.plan",
    "explain": "autopar.cli.explain",
    "simulate": "autopar.cli.simulate",
    "calibrate": "autopar.cli.calibrate",
    "check": "autopar.cli.check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description=(
            "Auto-parallelize PyTorch training: capture a model, inspect its IR, solve a sharding "
            "strategy, simulate pipeline schedules, and write a plan for a cluster offline."
        ),
        epilog=(
            "MODEL is a preset with optional overrides (gpt2, gpt2:n_layer=2,n_embd=64, llama-7b, ...; "
            "see `autopar plan --list-models`) or path/to/file.py:fn / package.module:fn returning "
            "(model, args) or (model, args, kwargs)."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:  # a subcommand still being written must not break the rest
            if e.name != module_name:
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_models(argv):  # answered without importing the stack (torch, transformers)
        return print_models()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
