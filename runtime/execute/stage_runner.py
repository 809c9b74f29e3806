"""What the executor runs for one stage of a rank: its GraphModule parts and its boundary buffers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx

from autopar.ir.core import Program


@dataclass
class Part:
    """A GraphModule and the names of its placeholders (the program's ``input`` values, in order); ``call``,
    when set, runs the module in its place (its compiled form, ``runtime/build/compiled.py``); ``last``, when
    set, (a microbatch, what runs in its place for that one): the compiled program whose backward reduces the
    gradient buckets, run for the step's last microbatch of the stage (``call`` then only accumulates)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    grad: tuple[bool, ...]  # whether a gradient flows through each input
    call: Callable[..., tuple] | None = None
    last: tuple[int, Callable[..., tuple]] | None = None

    @classmethod
    def of(cls, module: fx.GraphModule, prog: Program) -> Part:
        values = [v for v in prog.inputs if v.kind == "input"]
        return cls(module, tuple(v.name for v in values), tuple(bool(v.attrs.get("grad")) for v in values))

    def __call__(self, env: dict[str, torch.Tensor], mb: int | None = None) -> tuple[torch.Tensor, ...]:
        """The part on ``env``, for microbatch ``mb`` of a step (the executor's; None: outside a schedule)."""
        fn = self.last[1] if self.last is not None and mb == self.last[0] else (self.call or self.module)
        return tuple(fn(*(env[n] for n in self.inputs)))


@dataclass
class Buffer:
    """A tensor crossing a stage boundary: its local shape and dtype, and whether a gradient returns."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


@dataclass
class StageRunner:
    """Everything the executor needs about one stage held by this rank."""

    index: int
    whole: Part
    recv: list[Buffer]  # received values, in message order (the placeholders of the same names)
    send: list[Buffer]  # sent values, in message order (the module's outputs, in order)
    is_last: bool
    # recompute fraction -> (prefix run without autograd in F, rest or None when all is recomputed)
    variants: dict[Fraction, tuple[Part, Part | None]] = field(default_factory=dict)
    tail: Any = None  # a batch tail's StageTail (runtime/execute/batch_tail.py): the step's forwards at once


__all__ = ["Buffer", "Part", "StageRunner"]
