"""Differentiable stand-ins for the ATen ops the programs call that have no autograd formula.

Functionalization (``passes/functionalize.py``) turns a write into a tensor, ``x[..., :k] = y``, into the
functional ``aten.copy(x_slice, y)`` (and a scatter of the result back). ATen's ``copy`` has no derivative
("derivative for aten::copy is not implemented"), so a model that writes float activations in place
(DeepSeek-V3's attention assembles its query and key heads so, ``q.new_empty(...)`` then two slice writes)
failed in its first backward: on a pipeline the failing rank stopped and its peers waited for gradients
that never came. Codegen calls these functions instead; each computes what the ATen op does.
"""

from __future__ import annotations

import torch


def differentiable_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy(self, src)``: a new tensor of ``self``'s shape, dtype and device holding ``src`` broadcast to
    it. The gradient goes to ``src`` (summed over the broadcast dims by autograd) and none to ``self``, whose
    values are overwritten."""
    out = src.to(dtype=self.dtype, device=self.device, non_blocking=non_blocking).expand(self.shape)
    return out.clone(memory_format=torch.contiguous_format)


DIFFERENTIABLE = {"aten.copy": differentiable_copy}  # IR target -> the function codegen calls for it

__all__ = ["DIFFERENTIABLE", "differentiable_copy"]
