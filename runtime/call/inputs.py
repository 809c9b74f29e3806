"""A call's inputs -> the tensors this rank's stages read for each piece, and each piece's loss weight.

Two conventions (``compile(batch=...)``):

- ``"global"``: every rank is given the whole batch, checks it, cuts it into the pieces (microbatches,
  or their halves) and slices each input as its placements say (``shards.local_inputs``).
- ``"local"``: a rank is given only its data-parallel shard (``DataLayout.data_rows``: its share of every
  piece, the rows a ``"global"`` call would have it compute on), cut into the pieces the same way. An
  input whose placement splits rows over the data-parallel axes as the layout does (``S(0)`` on each,
  outermost) is then only sliced over the other axes; any other placement (replicated over a
  data-parallel axis, say) is all-gathered over the data-parallel axes into the whole piece first, so
  every plan runs. Inputs this rank's stages do not read may be left out (a pipeline's middle stages
  need none).

``loss_weight``: each piece's weight, the divisor of its loss computed by the program's own ops from the
piece's inputs as placed (``loss_weight.ProgramWeight``), or the caller's function (``batch.token_count``)
of the inputs of the piece, summed over the data-parallel ranks when each holds a share of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError, BatchError, CaptureError
from autopar.ir.core import MeshSpec, Program, Shard, Value
from autopar.ir.layout import deals_rows
from autopar.passes.capture import flatten_inputs
from autopar.runtime.call.batch import DataLayout, LossWeight
from autopar.runtime.call.loss_weight import ProgramWeight
from autopar.runtime.call.validate import Bound, index_bounds, problem
from autopar.runtime.comm.agree import agree
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.shards import local_inputs, shard_tensor
from autopar.runtime.comm.watch import guarded
from autopar.runtime.execute.stage_runner import StageRunner


def leaf_labels(in_spec) -> list[str]:
    """The user's name of each leaf of the captured inputs: a keyword's name, ``args[i]`` for a
    positional argument, followed by the path inside it for nested containers."""
    template = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    labels = [""] * in_spec.num_leaves
    for path, i in pytree.tree_flatten_with_path(template)[0]:
        top = path[1]
        head = f"args[{top.idx}]" if path[0].idx == 0 else str(top.key)
        labels[i] = head + pytree.keystr(path[2:])
    return labels


def stage_reads(runners: Mapping[int, StageRunner]) -> set[str]:
    """The names of the inputs the parts of ``runners`` read (user inputs and received boundary values)."""
    parts = [p for r in runners.values() for p in (r.whole, *(x for v in r.variants.values() for x in v))]
    return {n for p in parts if p is not None for n in p.inputs}


class CallInputs:
    """Turns a call's inputs into this rank's pieces (``pieces``) for the program inputs ``values``.

    ``leaves``: the position of each value among the flattened call inputs (default: the tensors in
    order); ``layout``: who computes on which rows; ``local``: the call passes this rank's shard."""

    def __init__(
        self,
        in_spec,
        values: Sequence[Value],
        comm: Comm,
        mesh: MeshSpec,
        device: torch.device,
        layout: DataLayout,
        *,
        leaves: Sequence[int] | None = None,
        local: bool = False,
        loss_weight: LossWeight | ProgramWeight | None = None,
        constants: Sequence[tuple[int, object]] = (),
        bounds: Mapping[str, Bound] | None = None,
    ):
        self.constants = tuple(constants)
        self.bounds = dict(bounds or {})  # inputs that index a table or classes (runtime/call/validate.py)
        self.in_spec, self.values, self.comm, self.mesh, self.device = in_spec, list(values), comm, mesh, device
        self.layout, self.local, self.loss_weight = layout, local, loss_weight
        self.leaves = list(leaves) if leaves is not None else None
        labels = leaf_labels(in_spec)
        self.labels = [labels[j] for j in self.leaves] if self.leaves is not None else [v.name for v in self.values]
        self._dp = [a for a, n in zip(layout.axes, layout.sizes) if n > 1]
        self._direct = [self._rows_as_layout(v) for v in self.values]
        # inputs carrying the batch on dim 0 (every one with microbatches; a model run whole may take others)
        self._batched = [bool(v.type.shape) and v.type.shape[0] == layout.piece_rows for v in self.values]
        if local:
            if self.leaves is None:
                raise BatchError("local batches need the positions of the inputs among the call's arguments")
            others = [lab for lab, v, b in zip(self.labels, self.values, self._batched) if v.type.shape and not b]
            if others:
                raise BatchError(
                    f"local batches deal dim 0 of every tensor input to the data-parallel ranks, but the inputs "
                    f"{others} do not carry the batch ({layout.piece_rows} rows) on dim 0: compile with batch='global'"
                )
            layout.require_divisible()

    @classmethod
    def of(cls, in_spec, program: Program, comm: Comm, device: torch.device, pieces: int, **kw) -> CallInputs:
        """For the user inputs of ``program`` run as ``pieces`` pieces (the rows of one piece: the
        program's inputs' most common dim 0)."""
        values = [v for v in program.inputs if v.kind == "input"]
        rows = [v.type.shape[0] for v in values if v.type.shape]
        mesh = program.mesh
        piece_rows = max(set(rows), key=rows.count) if rows else 0
        layout = DataLayout.of(mesh.names, mesh.sizes, comm.coords, pieces, piece_rows)
        constants = program.attrs.get("constant_inputs", ())
        bounds = index_bounds(program)
        return cls(in_spec, values, comm, mesh, device, layout, constants=constants, bounds=bounds, **kw)

    def layout_reading(self, reads: set[str]) -> DataLayout:
        """The layout, with the user's names of the inputs in ``reads`` (in call order) as its ``inputs``."""
        return replace(self.layout, inputs=tuple(lab for v, lab in zip(self.values, self.labels) if v.name in reads))

    def _rows_as_layout(self, v: Value) -> bool:
        """Whether ``v``'s placements split its rows over the data-parallel axes as the layout does:
        ``S(0)`` on each, and no other axis splitting rows before one of them."""
        return deals_rows(v.type.placements, tuple(self.mesh.names.index(a) for a in self._dp))

    # -- the call's inputs ------------------------------------------------------------------------
    def _given(self, args: tuple, kwargs: dict) -> list[torch.Tensor | None]:
        """Each value's tensor in the call (``None``: left out; only with local batches)."""
        if not self.local:
            flat = flatten_inputs(self.in_spec, args, kwargs)
            self._check_constants(flat)
            if self.leaves is not None:
                return [flat[j] for j in self.leaves]
            return [x for x in flat if isinstance(x, torch.Tensor)]
        t_args, t_kwargs = pytree.tree_unflatten([None] * self.in_spec.num_leaves, self.in_spec)
        unknown = sorted(set(kwargs) - set(t_kwargs))
        if len(args) > len(t_args) or unknown:
            raise CaptureError(
                f"the model was compiled with {len(t_args)} positional and the keyword inputs {sorted(t_kwargs)}; "
                f"got {len(args)} positional" + (f" and unknown keywords {unknown}" if unknown else "")
            )
        full = (tuple(args) + tuple(t_args[len(args) :]), {k: kwargs.get(k, t_kwargs[k]) for k in t_kwargs})
        flat, spec = pytree.tree_flatten(full)
        if spec != self.in_spec:
            want, got = leaf_labels(self.in_spec), leaf_labels(spec)
            missing, extra = [x for x in want if x not in got], [x for x in got if x not in want]
            raise CaptureError(
                f"the inputs do not match the example inputs the model was compiled with (inputs {want})"
                + (f": missing {missing}" if missing else "")
                + (f"{';' if missing else ':'} not compiled for {extra}" if extra else "")
                + "; pass the same inputs, nested the same way, or compile again with these"
            )
        self._check_constants(flat)
        return [flat[j] for j in self.leaves]

    def _check_constants(self, flat: list) -> None:
        """A non-tensor input (a float or bool) must have the value the program was captured with."""
        for j, want in self.constants:
            if flat[j] != want:
                label = leaf_labels(self.in_spec)[j]
                raise CaptureError(
                    f"input {label!r} is {flat[j]!r} but the model was compiled with {want!r}: torch.export "
                    "bakes a non-tensor input's value into the program; compile again with this value, or "
                    "pass it as a tensor"
                )

    def _check_rows(self, given: list[torch.Tensor | None], reads: set[str]) -> None:
        lay = self.layout
        want = lay.local_batch if self.local else lay.global_batch
        for v, label, x, batched in zip(self.values, self.labels, given, self._batched):
            if x is not None and not isinstance(x, torch.Tensor):
                raise BatchError(f"input {label!r} must be a tensor (as in the example inputs), not {type(x).__name__}")
            if x is None:
                if v.name in reads:
                    what = "this rank's shard (autopar.data.local_batch)" if self.local else "the whole batch"
                    raise BatchError(f"input {label!r} is read by this rank's stages but was not passed: pass {what}")
                continue
            if not batched or x.dim() == 0 or x.shape[0] == want:
                continue
            if self.local:
                raise BatchError(
                    f"input {label!r} has {x.shape[0]} rows but this rank's shard of the global batch has {want} "
                    f"(the plan's global batch {lay.global_batch} over {lay.replicas} data-parallel ranks); pass "
                    "this rank's rows only (autopar.data.local_batch or autopar.data.BatchSampler), or compile "
                    "with batch='global' to pass the whole batch"
                )
            hint = (
                "; it is one data-parallel rank's shard: compile with batch='local' to pass shards"
                if x.shape[0] * lay.replicas == want and lay.replicas > 1
                else "; compile again for another batch size"
            )
            raise BatchError(
                f"input {label!r} has {x.shape[0]} rows but the plan's global batch has {want} "
                f"({lay.pieces} piece(s) of {lay.piece_rows}){hint}"
            )

    def _validate(self, given: list[torch.Tensor | None], reads: set[str]) -> None:
        """Rows, token ids and labels checked before any collective of the step. With local batches every
        rank holds other rows: the ranks agree (one all-reduce), so all raise the error any one found and
        none enters a collective the others do not."""
        found = None
        try:
            for label, x in zip(self.labels, given):
                if isinstance(x, torch.Tensor) and x.device.type == "meta":
                    raise BatchError(
                        f"input {label!r} is on the meta device: it has a shape but no values to train on; pass "
                        f"it on {self.device} (or any device holding its data: it is moved to {self.device})"
                    )
            self._check_rows(given, reads)
            for v, label, x in zip(self.values, self.labels, given):
                if v.name in self.bounds and isinstance(x, torch.Tensor):
                    found = found or problem(label, x, self.bounds[v.name])
        except AutoparError as e:
            found = e
        if self.local and dist.is_initialized() and dist.get_world_size() > 1:
            agree(found)
        elif found is not None:
            raise found

    # -- the pieces -------------------------------------------------------------------------------
    def pieces(
        self, args: tuple, kwargs: dict, reads: set[str], weigh: bool = False, what: str = "shape"
    ) -> tuple[list[dict[str, torch.Tensor]], list[float] | None]:
        """This rank's inputs of each piece (only the values in ``reads``), and with ``weigh`` and a
        ``loss_weight`` each piece's weight."""
        given = self._given(args, kwargs)
        program_weight = self.loss_weight if weigh and isinstance(self.loss_weight, ProgramWeight) else None
        if program_weight is not None:  # the divisor's inputs, placed as the stages get them
            reads = reads | set(program_weight.inputs)
        self._validate(given, reads)
        n = self.layout.pieces
        per_value = [x.chunk(n, 0) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * n for x in given]
        pieces: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for i, v in enumerate(self.values):
            if v.name not in reads:
                continue
            for k in range(n):
                pieces[k][v.name] = self._place(i, per_value[i][k], what)
        weights = None
        if program_weight is not None:
            weights = [program_weight(piece) for piece in pieces]
        elif weigh and self.loss_weight is not None:
            weights = [
                self._weight({lab: x[k] for lab, x in zip(self.labels, per_value) if x[k] is not None})
                for k in range(n)
            ]
        return pieces, weights

    def _place(self, i: int, x: torch.Tensor, what: str) -> torch.Tensor:
        """Value ``i``'s shard on this rank from its tensor in one piece (whole, or this rank's rows)."""
        v = self.values[i]
        if not self.local or not self._direct[i]:
            if self.local:
                x = self._gather_rows(x.to(self.device))
            return local_inputs([v], [x], self.comm, self.mesh.names, self.device, what)[0]
        shape = (x.shape[0] * self.layout.replicas, *x.shape[1:])
        if shape != v.type.shape:
            raise CaptureError(
                f"input {self.labels[i]} has {what} {list(x.shape)} on this rank (a piece of {list(shape)}) but the "
                f"model was compiled for {list(v.type.shape)}; compile again for the new shape"
            )
        local = x.to(self.device)
        for p, name in zip(v.type.placements, self.mesh.names):
            if isinstance(p, Shard) and name not in self._dp:
                local = shard_tensor(local, p.dim, p.chunks, self.comm.sizes[name], self.comm.coords[name])
        return local.contiguous()

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The whole piece from every data-parallel rank's rows (innermost axis first)."""
        wire = x.view(torch.uint8) if x.dtype == torch.bool else x.contiguous()
        for a in reversed(self._dp):
            parts = [torch.empty_like(wire) for _ in range(self.comm.sizes[a])]
            group = self.comm.groups[a]
            guarded(group, a, "all_gather (the batch's rows)", dist.all_gather, parts, wire, group=group)
            wire = torch.cat(parts, 0)
        return wire.view(torch.bool) if x.dtype == torch.bool else wire

    def _weight(self, inputs: dict[str, torch.Tensor]) -> float:
        w = self.loss_weight(inputs)
        if not self.local or not self._dp:
            return float(w)
        total = torch.as_tensor(w, dtype=torch.float64, device=self.device).reshape(()).clone()
        for a in self._dp:
            guarded(
                self.comm.groups[a], a, "all_reduce (loss weight)", dist.all_reduce, total, group=self.comm.groups[a]
            )
        return total.item()


__all__ = ["CallInputs", "leaf_labels", "stage_reads"]
