"""A step whose gradients are NaN or infinite is never applied: skipped (with a warning) or raised, on every rank.

A bad input row, a corrupted shard or a diverging learning rate makes one rank's loss NaN; its gradients
reach every rank through the gradient all-reduce and one optimizer step spreads the NaN into every
parameter, silently. ``NonFinite.step_ok`` runs at ``STEP`` before the optimizer: it looks at this rank's
gradients and agrees with every rank (the clipped norm when ``max_grad_norm`` is set: already global, no
extra collective; where every rank holds the same gradients, the sums of pure data parallelism untouched since
their all-reduce, this rank's own look; else one all-reduce of a flag over the world), then, as ``on_nonfinite`` says,
``"warn_skip"`` (the default, like the fp16 loss scaler's skipped steps) drops the gradients with a
warning, ``"skip"`` without one, ``"raise"`` raises ``NonFiniteError``. ``skipped`` counts skipped steps.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from autopar.errors import NonFiniteError
from autopar.runtime.comm.watch import guarded

POLICIES = ("warn_skip", "skip", "raise")


class NonFinite:
    """``STEP``'s check of the gradients, under ``policy`` (one of ``POLICIES``)."""

    def __init__(self, policy: str = "warn_skip"):
        self.policy, self.skipped = policy, 0

    def step_ok(
        self, params: dict[str, torch.nn.Parameter], optimizer, norm: torch.Tensor | None, agreed: bool = False
    ) -> bool:
        """True to take the step; False (the gradients dropped on every rank) or ``NonFiniteError`` when some
        rank's gradients are not finite. ``norm``: the global gradient norm when clipping computed it;
        ``agreed``: every rank holds these very gradients (``GradSync.world_identical``), so none need ask the
        others (DDP's step has no such collective either: a NaN summed in is a NaN on every rank)."""
        if norm is not None:
            bad = not math.isfinite(float(norm))
        else:
            local = not _all_finite([p.grad for p in params.values() if p.grad is not None])
            flag = torch.tensor([1.0 if local else 0.0])
            if not agreed and dist.is_initialized() and dist.get_world_size() > 1:
                world = dist.group.WORLD
                guarded(
                    world, "every rank", "all_reduce (non-finite flag)", dist.all_reduce, flag, op=dist.ReduceOp.MAX
                )
            bad = bool(flag.item())
        if not bad:
            return True
        what = f"the gradient norm is {float(norm)}" if norm is not None else "some gradients are NaN or infinite"
        if self.policy == "raise":
            raise NonFiniteError(
                f"{what} on some rank (a bad input row, a corrupted shard, a diverging learning rate): the step "
                "was not applied on any rank; on_nonfinite='warn_skip' skips such steps instead"
            )
        for p in params.values():
            p.grad = None
        if optimizer is not None:
            optimizer.zero_grad()
        self.skipped += 1
        if self.policy == "warn_skip":
            warnings.warn(
                f"train_step: {what}; the step was skipped on every rank ({self.skipped} so far; "
                "on_nonfinite='raise' stops instead, 'skip' skips without this warning)",
                RuntimeWarning,
                stacklevel=2,
            )
        return False


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every element of every gradient is finite (a sparse gradient, a sparse embedding's: its values), read
    with one host synchronization: the max-norm of each (``torch._foreach_norm``, one fused pass; NaN and inf
    propagate into it, a finite tensor's is finite), not one ``bool`` per parameter (a sync each on a GPU)."""
    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in dense:
        if g.numel():  # the max-norm of an empty tensor has no value (nothing in it is non-finite)
            by_device.setdefault(g.device, []).append(g)
    return all(
        bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(gs, math.inf)])).all())
        for gs in by_device.values()  # one read a device: a rank's gradients are on one
    )


__all__ = ["POLICIES", "NonFinite"]
