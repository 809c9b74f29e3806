"""A collective's result that is waited for when it is first read, not when it is returned.

The loss a data-parallel module returns is the all-reduce of each rank's partial loss. Waiting for it
at the end of the forward is a second sync point per step (DDP has one, in its backward): the ranks'
skew is waited out twice. But a backward does not read the loss, only its shape (``ones_like`` seeds
the gradient; an all-reduce's backward passes the gradient through), and users read it after the step
(``loss.item()`` for a log line). ``Deferred`` is a tensor that holds the collective in flight: reading
it in any way (``item``, arithmetic, printing, ``detach``) waits and reads the result; ``ones_like`` /
``zeros_like`` / ``empty_like`` (the backward's seed) do not. Autograd sees an ordinary tensor
(``_make_wrapper_subclass``). torch's ``AsyncCollectiveTensor`` is the same idea, but it waits on
``ones_like``, which is the first thing a backward does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.utils import _pytree as pytree

_aten = torch.ops.aten
_SEEDS = {
    _aten.ones_like.default: torch.ones,
    _aten.zeros_like.default: torch.zeros,
    _aten.empty_like.default: torch.empty,
}


class Deferred(torch.Tensor):
    """A tensor shaped like ``like`` whose value ``result()`` returns, called once at the first read."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, result: Callable[[], torch.Tensor]):
        r = torch.Tensor._make_wrapper_subclass(cls, like.size(), dtype=like.dtype, device=like.device)
        r._result, r._value = result, None
        return r

    def value(self) -> torch.Tensor:
        """The collective's result (waited for once)."""
        if self._value is None:
            self._value = self._result()
            self._result = None
        return self._value

    def __repr__(self) -> str:
        return repr(self.value())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SEEDS:  # a backward's seed needs the shape only
            like = args[0]
            return _SEEDS[func](like.shape, dtype=kwargs.get("dtype") or like.dtype, device=like.device)
        read = lambda t: t.value() if isinstance(t, Deferred) else t  # noqa: E731
        return func(*pytree.tree_map(read, args), **pytree.tree_map(read, kwargs))


def settle(tensors: Iterable) -> None:
    """Wait for the ``Deferred`` ones among ``tensors`` (a module's last outputs nobody read)."""
    for t in tensors:
        if isinstance(t, Deferred):
            t.value()


__all__ = ["Deferred", "settle"]
