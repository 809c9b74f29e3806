"""Cut the user's global batch into microbatches, and merge the microbatches' outputs back.

The runtime takes the global batch (as the model does) and cuts dim 0 of every tensor input into
equal microbatches (``split_batch``); with Merak's sub-pipelined tensor parallelism each microbatch
is cut once more into halves (``sub_microbatch`` gives the shape the stages are built for).
``merge_outputs`` joins what the microbatches returned: tensors with a batch dim concatenated on
dim 0, scalar floats averaged (the mean of equal microbatches' mean losses is the batch's loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.errors import CaptureError, SubPipelineError


def split_batch(args: tuple, kwargs: dict, microbatches: int) -> list[tuple[tuple, dict]]:
    """Cut dim 0 of every tensor in ``(args, kwargs)`` into ``microbatches`` equal parts."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    sizes = {x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise CaptureError(
            "every tensor input needs the batch as dim 0 (one size) to be cut into microbatches; "
            f"found sizes {sorted(sizes)}"
        )
    (batch,) = sizes
    if batch % microbatches:
        raise CaptureError(f"a batch of {batch} cannot be cut into {microbatches} equal microbatches")
    parts = [
        [x.chunk(microbatches, 0)[i] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in flat]
        for i in range(microbatches)
    ]
    return [pytree.tree_unflatten(p, spec) for p in parts]


def sub_microbatch(args: tuple, kwargs: dict, microbatches: int, sub: int) -> tuple[tuple, dict]:
    """The inputs the stages are built for: one microbatch, or with ``sub`` > 1 (sub-pipelined tensor
    parallelism) one ``sub``-th of one."""
    first = split_batch(args, kwargs, microbatches)[0] if microbatches > 1 else (tuple(args), dict(kwargs))
    if sub == 1:
        return first
    try:
        return split_batch(*first, sub)[0]
    except CaptureError:
        sizes = {x.shape[0] for x in pytree.tree_leaves(first) if isinstance(x, torch.Tensor) and x.dim() > 0}
        raise SubPipelineError(
            f"sub-pipelined tensor parallelism runs each microbatch as {sub} equal halves, but a microbatch has "
            f"{sorted(sizes)[0]} samples; make the batch a multiple of {sub * microbatches} ({sub} x "
            f"microbatches={microbatches}), use fewer microbatches, or compile without sub_pipeline_tp"
        ) from None


def merge_outputs(parts: Sequence[Sequence[Any]]) -> list[Any]:
    """Each output position over the microbatches' flat outputs: a tensor with a batch dim concatenated
    on dim 0, a scalar float averaged, anything else the same in every microbatch (kept once)."""
    if len(parts) == 1:
        return list(parts[0])
    merged = []
    for i, values in enumerate(zip(*parts)):
        x = values[0]
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            merged.append(torch.cat(values, 0))
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            merged.append(torch.stack(values).mean())
        elif isinstance(x, torch.Tensor) and all(torch.equal(x, v) for v in values[1:]):
            merged.append(x)
        elif not isinstance(x, torch.Tensor) and all(v == x for v in values[1:]):
            merged.append(x)
        else:
            raise CaptureError(
                f"output {i} of the model is a non-float scalar that differs between microbatches ({values}); "
                "it cannot be merged over the batch: compile with microbatches=1"
            )
    return merged


__all__ = ["merge_outputs", "split_batch", "sub_microbatch"]
