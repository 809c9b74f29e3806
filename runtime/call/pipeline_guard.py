"""The outputs of a pipelined module's call in training: a backward through them raises a named error.

On a mesh with a ``pp`` axis, ``model(**batch)`` runs the stages forward only (each rank computes its
stages and the last one's outputs are broadcast): no autograd graph spans the ranks, so the plain
training loop ``model(**batch).loss.backward()`` would fail in torch with "element 0 of tensors does not
require grad", which does not say what to do. In training mode with gradients enabled, each float output
instead carries a graph whose backward raises ``PipelineBackwardError`` saying to call ``train_step``
(forward, backward and the optimizer step of every microbatch under the schedule). Outside training
(``eval()`` or ``torch.no_grad()``) the outputs are returned as computed.
"""

from __future__ import annotations

import torch

from autopar.errors import PipelineBackwardError

MESSAGE = (
    "on a pipeline (a mesh with a pp axis) model(...)'s outputs carry no gradient across the stages: train "
    "with loss = model.train_step(**batch) (forward, backward and the optimizer's step of every microbatch; "
    "attach the optimizer with model.make_optimizer(...)), which works on every mesh"
)


class _RefuseBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, _anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *_grads):
        raise PipelineBackwardError(MESSAGE)


def refuse_backward(leaves: list) -> list:
    """``leaves`` (a call's flattened outputs) with every float tensor given a backward that raises
    ``PipelineBackwardError`` (see the module docstring)."""
    anchor = torch.zeros((), requires_grad=True)
    return [
        _RefuseBackward.apply(x, anchor) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in leaves
    ]


__all__ = ["MESSAGE", "refuse_backward"]
