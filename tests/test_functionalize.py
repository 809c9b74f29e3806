"""passes/functionalize.py: in-place ops and writes through views become out-of-place SSA values."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import CaptureError
from autopar.passes.capture import capture
from autopar.passes.functionalize import _mutated_arg, functionalize


class ShiftRight(torch.nn.Module):
    """Hugging Face's _shift_right (T5, BART): writes through a slice and a select, then in place."""

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 7
        shifted.masked_fill_(shifted == -100, 0)
        return shifted * 2


class Views(torch.nn.Module):
    """Views taken before a write are read after it; writes through a chain of views and a transpose;
    an in-place op's result used in place of its input; an in-place op that would promote the dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        row = y[1]  # a view taken before the writes below, read after them
        first, rest = y.split([1, 3], dim=0)  # pieces of a multi-output view, read after the writes
        y.view(2, 2, 5)[0, 1].add_(1.0)  # a write through a chain of views
        y.t()[2].mul_(3.0)  # a write through a transpose
        z = y.unsqueeze(0).sub_(0.5)  # the in-place result (a view of y) is used below
        w = torch.zeros(4, 5, dtype=torch.float32)
        w.add_(x.double())  # stays float32, as in-place ops keep their input's dtype
        return row * 10 + z.sum(0) + w + first.sum() + rest.mean(0)


def _run(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.fx.GraphModule]:
    """The functionalized captured graph of ``module`` (no parameters) run on ``inputs``."""
    ep = capture(module, inputs).exported
    gm = functionalize(ep.graph_module)
    users = iter(inputs)
    flat = [ep.constants[s.target] if s.target in ep.constants else next(users) for s in ep.graph_signature.input_specs]
    return gm(*flat)[0], gm


@pytest.mark.parametrize(
    "module,inputs",
    [
        (ShiftRight(), (torch.tensor([[5, -100, 3, 4], [-100, 9, 2, -100]]),)),
        (Views(), (torch.randn(4, 5, generator=torch.Generator().manual_seed(0)),)),
    ],
)
def test_functionalized_graph_computes_the_model_without_mutation(module, inputs):
    assert any(_mutated_arg(n) is not None for n in capture(module, inputs).exported.graph_module.graph.nodes)
    out, gm = _run(module, *inputs)
    assert not [n.target for n in gm.graph.nodes if _mutated_arg(n) is not None]
    expected = module(*(x.clone() for x in inputs))
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_graph_without_mutation_is_unchanged():
    class Pure(torch.nn.Module):
        def forward(self, x):
            return x.view(2, -1).t() * 2

    gm = capture(Pure(), (torch.randn(4, 3),)).exported.graph_module
    assert functionalize(gm) is gm


def test_write_through_an_unsupported_view_is_a_clear_error():
    class Diagonal(torch.nn.Module):
        def forward(self, x):
            y = x.clone()
            y.unfold(0, 2, 2).zero_()
            return y

    gm = capture(Diagonal(), (torch.randn(4, 4),)).exported.graph_module
    with pytest.raises(CaptureError, match="writes through a view made by aten.unfold"):
        functionalize(gm)
