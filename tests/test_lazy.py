"""runtime/comm/lazy.py: a returned collective result is waited for when it is read, and a backward does not read it."""

from __future__ import annotations

import torch

from autopar.runtime.comm.lazy import Deferred, settle


class _Sum(torch.autograd.Function):
    """An all-reduce stand-in: forward returns the sum in flight (``Deferred``), backward passes the gradient."""

    @staticmethod
    def forward(ctx, x, waits: list):
        def result() -> torch.Tensor:
            waits.append(1)
            return x.detach() * 2  # "the other rank's partial" arrives

        return Deferred(x, result)

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_a_backward_does_not_wait_and_the_first_read_does_once():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    waits: list = []
    loss = _Sum.apply((w * w).sum(), waits)
    assert loss.requires_grad and loss.shape == () and loss.dtype == torch.float32
    loss.backward()  # seeds its gradient with ones_like: shape only
    assert waits == [] and torch.equal(w.grad, 2 * w.detach())
    assert loss.item() == 28.0 and waits == [1]
    assert float(loss.detach()) == 28.0 and torch.equal(loss.detach() + 1, torch.tensor(29.0)) and waits == [1]
    assert "28." in repr(loss)


def test_arithmetic_on_it_reads_it_and_keeps_the_graph():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    waits: list = []
    scaled = _Sum.apply((w * w).sum(), waits) * 0.5  # a user's loss scaling reads the value, tracked by autograd
    assert waits == [1] and scaled.item() == 5.0
    scaled.backward()
    assert torch.equal(w.grad, w.detach())


def test_settle_waits_for_what_nobody_read():
    waits: list = []
    outs = [_Sum.apply(torch.ones(()), waits), torch.zeros(2), 3]
    settle(outs)
    assert waits == [1]
    settle(outs)
    assert waits == [1]
