"""``autopar plan --list-models``: the model presets, read without importing torch (the command line answers it
before building its parser, whose subcommands import the whole stack)."""

from __future__ import annotations


def print_models() -> int:
    from autopar.models.preset_table import PRESET_TABLE  # list_presets() as of this version (refreshed, tested)

    for name, desc in PRESET_TABLE.items():
        print(f"{name:18s} {desc}")
    return 0


def wants_models(argv: list[str]) -> bool:
    """Whether ``argv`` asks only for the preset list (``plan --list-models``)."""
    return argv[:1] == ["plan"] and "--list-models" in argv and "-h" not in argv and "--help" not in argv
