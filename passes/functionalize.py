"""Functionalize a captured graph: in-place ops and writes through views become pure SSA values.

torch.export's training IR keeps PyTorch's mutation: ``x[:, 1:] = y`` is ``copy_(slice(x), y)``
and later code reads ``x``, which sees the write only because the slice shares x's storage. autopar's
IR is SSA (a value is computed once and never changes), and after sharding a view and its base are
different tensors (a redistribution between them copies), so a write through a view would be lost.
This pass rewrites the graph as PyTorch's functionalization does, without decomposing any op:

- an in-place op ``op_(x, ...)`` becomes its out-of-place form ``op(x, ...)``, giving x a new value;
- when x is a view of a base (found from storage sharing in the traced values), the new value is
  scattered back up the chain of views (``slice_scatter``, ``select_scatter``, an inverse reshape or
  permutation, ...) to the storage's root, which gets a new value as well;
- every later read of the root or of any view of it uses the new value (views are recomputed from
  the new root on first read).

A graph without in-place ops is returned unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.errors import CaptureError

aten = torch.ops.aten

# Views whose values are a reshape of their base (row-major order): written back by reshaping.
_RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_as.default,
    aten.reshape_as.default,
}
# Views equal to their base (when they share its storage): the new value is the base's new value.
_IDENTITIES = {
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten.type_as.default,
}


def functionalize(
    gm: fx.GraphModule, in_place: frozenset[str] = frozenset(), refused: Mapping[str, str] | None = None
) -> fx.GraphModule:
    """``gm`` with its in-place ops and writes through views replaced by out-of-place ops, except a
    write to a placeholder named in ``in_place`` itself (a buffer: the runtime runs that op in place
    on the rank's buffer, so the update is kept across steps, as the model's own). A write to a
    placeholder named in ``refused`` (a parameter; the value: its name in the model) is a CaptureError:
    its update would not last."""
    if not any(_mutated_arg(n) is not None for n in gm.graph.nodes):
        return gm
    return fx.GraphModule(gm, _Functionalizer(gm.graph, in_place, refused or {}).run(), class_name=type(gm).__name__)


def _mutated_arg(node: fx.Node) -> int | None:
    """Index in the schema of the argument ``node`` writes to, None for a pure op."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    for i, a in enumerate(node.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            return i
    return None


def _is_view(node: fx.Node) -> bool:
    """An op whose result is declared to alias its first argument (it may still copy, e.g. reshape)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _storage(node: fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _is_identity(node: fx.Node) -> bool:
    """A view equal to its base: an aliasing conversion, or an in-place op's result (x itself)."""
    return node.target in _IDENTITIES or _mutated_arg(node) is not None


def _argument(node: fx.Node, index: int) -> Any:
    schema = node.target._schema.arguments[index]
    return node.args[index] if index < len(node.args) else node.kwargs.get(schema.name, schema.default_value)


def _out_of_place(node: fx.Node) -> torch._ops.OpOverload:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor``; a CaptureError when there is no such op."""
    name = node.target._schema.name.split("::")[-1]
    overload = node.target._overloadname
    packet = getattr(aten, name.rstrip("_"), None) if name.endswith("_") else None
    op = getattr(packet, overload, None) if packet is not None else None
    if op is None:
        raise CaptureError(
            f"{node.target} (at {node.name}) writes to its input and autopar knows no out-of-place form "
            "of it; write the computation without the in-place op (e.g. x = x.op(...) instead of x.op_(...))"
        )
    return op


class _Functionalizer:
    """Copies a graph node by node, keeping each old node's current value (a new node)."""

    def __init__(self, old: fx.Graph, in_place: frozenset[str], refused: Mapping[str, str]):
        self.old, self.in_place, self.refused = old, in_place, refused
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}  # old node -> new node holding its current value
        self.base: dict[fx.Node, fx.Node] = {}  # old view node -> the old node it is a view of
        self.version: dict[StorageWeakRef, int] = {}  # storage -> number of writes so far
        self.stamp: dict[fx.Node, int] = {}  # old node -> storage version its env value reflects

    def run(self) -> fx.Graph:
        for node in self.old.nodes:
            if node.op == "output":
                self.graph.output(fx.map_arg(node.args[0], self.read))
            elif _mutated_arg(node) is not None:
                self._write(node)
            else:
                self._define(node, self.graph.node_copy(node, self.read))
                src = node.args[0] if node.args else None
                if node.target is operator.getitem and isinstance(src, fx.Node) and _is_view(src):
                    src = src.args[0]  # a piece of split/unbind/chunk: a view of the op's input
                elif not _is_view(node):
                    continue
                if isinstance(src, fx.Node) and _storage(node) is not None and _storage(node) == _storage(src):
                    self.base[node] = src
        return self.graph

    def _define(self, node: fx.Node, new: fx.Node) -> None:
        self.env[node] = new
        key = _storage(node)
        if key is not None:
            self.stamp[node] = self.version.get(key, 0)

    def read(self, node: fx.Node) -> fx.Node:
        """The current value of an old node: a view read after a write to its storage is recomputed."""
        key = _storage(node)
        if node in self.base and key is not None and self.stamp.get(node) != self.version.get(key, 0):
            base = self.read(self.base[node])
            if _is_identity(node):
                new = base
            elif node.target is operator.getitem:  # re-split the new base, take the same piece
                split = node.args[0]
                rest = fx.map_arg((split.args[1:], dict(split.kwargs)), self.read)
                pieces = self._call(split.target, (base, *rest[0]), rest[1], node)
                new = self._call(operator.getitem, (pieces, node.args[1]), {}, node)
            else:
                rest = fx.map_arg((node.args[1:], dict(node.kwargs)), self.read)
                new = self._call(node.target, (base, *rest[0]), rest[1], node)
            self._define(node, new)
        return self.env[node]

    def _write(self, node: fx.Node) -> None:
        """``op_(x, ...)``: x's new value is ``op(x, ...)``, scattered up to the root of x's storage."""
        target = _argument(node, _mutated_arg(node))
        chain = [target]  # x, its base, the base's base, ... up to the storage's root
        while chain[-1] in self.base:
            chain.append(self.base[chain[-1]])
        root = chain[-1]
        if root.op == "placeholder" and root.name in self.refused:
            raise CaptureError(
                f"{node.target} (at {node.name}) updates the parameter {self.refused[root.name]} in place in "
                "forward (as nn.Embedding(max_norm=...) does); autopar does not keep a parameter's in-place update "
                "across steps: apply it outside the forward (e.g. after optimizer.step(), under torch.no_grad())"
            )
        if root.op == "placeholder" and root.name in self.in_place:
            self._write_in_place(node, chain)
            return
        args = fx.map_arg(node.args, self.read)
        kwargs = fx.map_arg(dict(node.kwargs), self.read)
        value = self._call(_out_of_place(node), args, kwargs, node)
        if value.meta["val"].dtype != target.meta["val"].dtype:  # in-place ops keep the input's dtype
            value = self._call(aten.to.dtype, (value, target.meta["val"].dtype), {}, node)
        before = [self.read(v) for v in chain]  # values before this write
        key = _storage(target)
        self.version[key] = self.version.get(key, 0) + 1
        written = value
        for i, view in enumerate(chain[:-1]):
            self._define(view, written)
            written = self._scatter(view, before[i + 1], written, node)
        self._define(chain[-1], written)
        self.base[node] = target  # the op's result is x itself
        self._define(node, value)

    def _write_in_place(self, node: fx.Node, chain: list[fx.Node]) -> None:
        """``op_(x, ...)`` on a buffer kept in place (x the buffer, or an in-place op's result on it): the
        op stays, and later reads of the buffer read its result. A write through a view of the buffer
        (a slice, say) is refused: the view may be a copy on a rank, and the update would be lost."""
        views = [v for v in chain[:-1] if not _is_identity(v)]
        if views:
            raise CaptureError(
                f"{node.target} (at {node.name}) writes to buffer {chain[-1].name} through the view {views[0].name} "
                f"({views[0].target}); autopar keeps a buffer's in-place updates only when they write the whole "
                "buffer: compute the new value and write it whole (buf.copy_(new)), or keep it outside the model"
            )
        key = _storage(chain[-1])
        self.version[key] = self.version.get(key, 0) + 1
        new = self.graph.node_copy(node, self.read)
        for v in chain:
            self._define(v, new)
        self.base[node] = chain[0]
        self._define(node, new)

    def _scatter(self, view: fx.Node, base: fx.Node, src: fx.Node, at: fx.Node) -> fx.Node:
        """The base's value after its view ``view`` was given the value ``src``."""
        t, rest = view.target, list(view.args[1:])
        if _is_identity(view):
            return src
        if t in _RESHAPES:
            return self._call(aten.reshape.default, (src, list(view.args[0].meta["val"].shape)), {}, at)
        if t == aten.slice.Tensor:
            return self._call(aten.slice_scatter.default, (base, src, *rest), dict(view.kwargs), at)
        if t == aten.select.int:
            return self._call(aten.select_scatter.default, (base, src, *rest), dict(view.kwargs), at)
        if t == aten.diagonal.default:
            return self._call(aten.diagonal_scatter.default, (base, src, *rest), dict(view.kwargs), at)
        if t == aten.as_strided.default:
            return self._call(aten.as_strided_scatter.default, (base, src, *rest), dict(view.kwargs), at)
        if t in (aten.transpose.int, aten.t.default):
            return self._call(t, (src, *rest), {}, at)
        if t == aten.permute.default:
            dims = [d % len(rest[0]) for d in rest[0]]
            return self._call(aten.permute.default, (src, [dims.index(i) for i in range(len(dims))]), {}, at)
        raise CaptureError(
            f"{at.target} (at {at.name}) writes through a view made by {t} ({view.name}); autopar cannot "
            "write that view back into its base: write the result to a new tensor instead"
        )

    def _call(self, target: Callable, args: tuple, kwargs: dict, like: fx.Node) -> fx.Node:
        """A new node computing ``target(*args, **kwargs)``; its traced value is computed on the fake
        values of its arguments, its source location is ``like``'s."""
        new = self.graph.call_function(target, tuple(args), kwargs)
        vals = fx.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
        fake = torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
        with fake:
            new.meta["val"] = target(*vals[0], **vals[1])
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if k in like.meta:
                new.meta[k] = like.meta[k]
        return new
