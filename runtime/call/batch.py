"""The batch: cut into microbatches, dealt to the data-parallel ranks, weighted, merged back.

The runtime takes the global batch (as the model does) and cuts dim 0 of every tensor input into
equal microbatches (``split_batch``); with Merak's sub-pipelined tensor parallelism each microbatch
is cut once more into halves (``sub_microbatch`` gives the shape the stages are built for). These
*pieces* are what the stages run. ``DataLayout`` says which rows of the global batch a data-parallel
rank computes on: its share of every piece, the rows ``data_rows`` lists (the ``DistributedSampler``
convention with the plan's microbatches: a rank passing only those rows, ``batch="local"``, runs the
same numbers as one passing the whole batch). ``merge_outputs`` joins what the pieces returned:
tensors with a batch dim concatenated on dim 0, scalar floats averaged, or weighted by each piece's
``loss_weight`` (``token_count``: a mean over the targets that are not ignored, weighed as one mean
over the whole batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.errors import BatchError, CaptureError, SubPipelineError
from autopar.ir.axes import data_axes

# a piece's weight from its inputs (by the user's names): how many items its loss is the mean of
LossWeight = Callable[[Mapping[str, torch.Tensor]], "float | torch.Tensor"]


@dataclass(frozen=True)
class DataLayout:
    """How one step's global batch is dealt to the ranks: ``pieces`` equal pieces of ``piece_rows``
    rows each (microbatches, or their halves), each split over the data-parallel ``axes`` (the mesh's
    ``dp*`` axes, in mesh order, the first outermost: MiCS's partition and replica axes alike). Ranks
    with the same coordinates on those axes (tensor- and pipeline-parallel peers) take the same rows;
    ``inputs``: the user's inputs this rank's stages read (none on a pipeline's middle stages)."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: tuple[int, ...]
    pieces: int
    piece_rows: int
    inputs: tuple[str, ...] = ()

    @classmethod
    def of(cls, names, sizes, coords: Mapping[str, int], pieces: int, piece_rows: int, inputs=()) -> DataLayout:
        axes = data_axes(names)
        size = dict(zip(names, sizes))
        return cls(
            axes, tuple(size[a] for a in axes), tuple(coords[a] for a in axes), pieces, piece_rows, tuple(inputs)
        )

    @property
    def replicas(self) -> int:
        """How many ranks take distinct rows (the product of the data-parallel axes' sizes)."""
        return math.prod(self.sizes)

    @property
    def replica(self) -> int:
        """This rank's index among them (row-major over ``axes``)."""
        r = 0
        for c, n in zip(self.coords, self.sizes):
            r = r * n + c
        return r

    @property
    def global_batch(self) -> int:
        return self.pieces * self.piece_rows

    @property
    def local_batch(self) -> int:
        """Rows of this rank's shard of the global batch."""
        self.require_divisible()
        return self.global_batch // self.replicas

    def require_divisible(self) -> None:
        if self.piece_rows % self.replicas:
            raise BatchError(
                f"the plan runs {self.pieces} piece(s) of {self.piece_rows} rows (global batch {self.global_batch}), "
                f"which do not split evenly over the {self.replicas} data-parallel ranks "
                f"({', '.join(f'{a}={n}' for a, n in zip(self.axes, self.sizes))}): compile with a global batch "
                f"that is a multiple of {self.pieces * self.replicas}, or pass the global batch (batch='global')"
            )

    def data_rows(self) -> list[int]:
        """The rows of the global batch this rank computes on, in the order of its local batch: its
        share of each piece in turn (the piece's rows split in ``replicas`` equal contiguous parts)."""
        q = self.local_batch // self.pieces
        return [k * self.piece_rows + self.replica * q + j for k in range(self.pieces) for j in range(q)]


def take_rows(batch: Any, rows: Sequence[int], which: Sequence[bool] | None = None) -> Any:
    """``batch`` (any pytree) with dim 0 of every tensor of at least one dim indexed by ``rows``
    (``which``: only of the flat leaves it marks ``True``)."""
    index = torch.tensor(list(rows), dtype=torch.long)
    flat, spec = pytree.tree_flatten(batch)
    marks = which if which is not None else [True] * len(flat)
    out = [
        x.index_select(0, index.to(x.device)) if mark and isinstance(x, torch.Tensor) and x.dim() > 0 else x
        for x, mark in zip(flat, marks)
    ]
    return pytree.tree_unflatten(out, spec)


def loss_scales(weights: Sequence[float], sub: int) -> list[list[float]]:
    """Per microbatch (``sub`` pieces each), the gradient each piece's loss back-propagates: its
    share of the batch's weight."""
    total = sum(weights) or math.nan  # a batch with nothing to average: a NaN loss, as one device gives
    return [[w / total for w in weights[i : i + sub]] for i in range(0, len(weights), sub)]


def step_loss(losses: Sequence[torch.Tensor], scales: Sequence[Sequence[float]] | None) -> torch.Tensor:
    """The step's loss from its microbatches': their mean, or with ``loss_scales`` each microbatch's
    loss (weighted over its pieces) times its share."""
    if scales is None:
        return torch.stack(list(losses)).mean()
    return sum(sum(s) * x for s, x in zip(scales, losses))


def token_count(labels: str = "labels", ignore_index: int = -100, shift: int = 0) -> LossWeight:
    """A ``loss_weight``: the number of targets of input ``labels`` the loss does not ignore (from
    position ``shift`` of the last dim on: Hugging Face's causal language models predict
    ``labels[..., 1:]``, ``shift=1``)."""

    def weight(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if labels not in inputs:
            raise BatchError(
                f"loss_weight counts the targets of the input {labels!r}, but the inputs are {sorted(inputs)}: "
                f"give its name (autopar.data.token_count(labels=...)) or pass that input"
            )
        x = inputs[labels]
        return (x[..., shift:] != ignore_index).sum()

    return weight


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
        fits = [m for m in range(1, batch + 1) if batch % m == 0]
        raise CaptureError(
            f"a batch of {batch} cannot be cut into {microbatches} equal microbatches: pass microbatches= one of "
            f"{fits} (the divisors of {batch}), or a batch that {microbatches} divides"
        )
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


def merge_outputs(parts: Sequence[Sequence[Any]], weights: Sequence[float] | None = None) -> list[Any]:
    """Each output position over the pieces' flat outputs: a tensor with a batch dim concatenated
    on dim 0, a scalar float averaged (weighted by ``weights`` when given), anything else the same in
    every piece (kept once)."""
    if len(parts) == 1:
        return list(parts[0])
    merged = []
    for i, values in enumerate(zip(*parts)):
        x = values[0]
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            merged.append(torch.cat(values, 0))
        elif isinstance(x, torch.Tensor) and x.is_floating_point() and weights is not None:
            w = torch.tensor(list(weights), dtype=x.dtype, device=x.device)
            merged.append((torch.stack(values) * w).sum() / w.sum())
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


__all__ = [
    "DataLayout",
    "LossWeight",
    "loss_scales",
    "merge_outputs",
    "split_batch",
    "step_loss",
    "sub_microbatch",
    "take_rows",
    "token_count",
]
