"""The executor's bookkeeping: posted receives, each microbatch's stash, the wire form of tensors gloo cannot
send, back-propagation from a stage's outputs, the RNG state a recomputation restores, and telling a
transport failure from a computation error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from autopar.runtime.comm.watch import is_comm_failure
from autopar.runtime.execute.split_backward import run_backward
from autopar.runtime.execute.subpipeline import Tape
from autopar.schedule.actions import Action

_WIRE = {torch.bool: torch.uint8}  # dtypes gloo cannot send are sent as their bytes


def to_wire(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(_WIRE[t.dtype]) if t.dtype in _WIRE else t


@dataclass
class PendingReceive:
    """A posted receive: its buffers and the works of the batch it was posted in."""

    buffers: list[torch.Tensor]
    works: list
    action: Action
    peer_rank: int


@dataclass
class Stash:
    """One (microbatch, stage)'s activations, one entry per sub-microbatch in each list."""

    leaves: list[dict[str, torch.Tensor]]  # the stage's inputs (received leaves and user inputs)
    outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # autograd goes back from these
    tape: Tape | None = None  # the sub-pipelined backward of the outputs (None: plain autograd)
    recompute: Fraction = Fraction(0)
    head_leaves: list[dict[str, torch.Tensor]] = field(default_factory=list)  # prefix outputs, as leaves
    head_outputs: list[tuple[torch.Tensor, ...]] | None = None  # prefix outputs with autograd (RECOMPUTE)
    head_tape: Tape | None = None
    rng: tuple | None = None


def wire_view(b: torch.Tensor) -> torch.Tensor:
    return b.view(_WIRE[b.dtype]) if b.dtype in _WIRE else b


def backprop(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], loss_scale: float | None = None
) -> None:
    """Back-propagate ``grads`` from ``outputs`` (``None``: no gradient flows back through it). With
    ``loss_scale`` the first output is the loss and its gradient is ``loss_scale``. Inside
    ``split_backward.deferring_weights`` only the input gradients (B; W deferred)."""
    if loss_scale is not None:
        grads = [torch.full_like(outputs[0], loss_scale)]
        outputs = outputs[:1]
    ts, gs = [], []
    for o, g in zip(outputs, grads):
        if g is None or not isinstance(o, torch.Tensor) or not o.requires_grad:
            continue
        ts.append(o)
        gs.append(g)
    if ts:
        run_backward(ts, gs)


def rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


class restored_rng:
    """Run a recomputation with the RNG state its forward saw (dropout masks come out the same)."""

    def __init__(self, state: tuple | None):
        self.state = state

    def __enter__(self):
        if self.state is None:
            return
        self.saved = rng_state()
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state_all(self.state[1])

    def __exit__(self, *exc):
        if self.state is None:
            return
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state_all(self.saved[1])


__all__ = [
    "PendingReceive",
    "Stash",
    "backprop",
    "is_comm_failure",
    "restored_rng",
    "rng_state",
    "to_wire",
    "wire_view",
]
