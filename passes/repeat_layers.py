"""Plan a deep model from a capture of two layers of each kind: the lowered program repeats them to full depth.

torch.export traces every layer of a model, so capturing DeepSeek-V3's 61 layers (or GPT-3's 96) costs 61 times
one layer, and so does lowering them, though the layers of a run of alike ones are the same program with other
parameters. For planning only (``autopar plan``, the search's profiles and plans; never for training, which
runs the graph it captures itself) ``capture_for_planning`` (``autopar/planner.py``) captures the model with
each run of alike layers of its main layer stack cut to the run's first two (``planning_cut``), and ``lower``
(``passes/lower.py``) repeats the second of them (``expand_layers``) up to the run's length. The program it
gives is the one a full capture lowers to, op for op and name for name (the same IR text and fingerprint,
``tests/test_repeat_layers.py``); the passes after it, the ILP (which folds repeated layers again,
``solver/sharding/solve.py``) and the plan file see no difference.

The main stack is the ``nn.ModuleList`` holding the most parameters (``model.layers``, ``transformer.h``). Two of
its layers are alike (of one kind) when they are the same modules with the same attributes and parameter and
buffer shapes: their classes, every attribute of every submodule other than its index in the stack (an
attribute equal to the layer's own index in every layer, ``layer_idx``), and the entries at their indices of
the model's per-layer config lists (``layer_types``: sliding or global attention). DeepSeek-V3's dense first
layers and its mixture-of-experts ones are two kinds, and so are a model's sliding and global layers. A run of
n >= 3 alike consecutive layers is captured as its first two; shorter runs in full. For the capture the stack
holds the kept layers, their index attributes and the per-layer config lists are those of their places in
it, and all is put back after.

What the capture shows is checked before it is used (``LayersDiffer`` otherwise, and ``capture_for_planning``
captures the whole model instead): each layer's ops are contiguous in program order; the second layer of each
run is the first's program op by op (targets, types, constants, module paths), reading its own parameters where
the first reads its own, the first layer's values where the first reads its predecessor's, and otherwise only
values computed before the stack (the mask, the rotary tables) or shared inputs; the first layer's values are
read by the two alone, and each layer's parameters by its own ops. A layer whose computation depends on its
index (GPT-2's ``scale_attn_by_inverse_layer_idx``), a loss over every layer's router logits (Mixtral's
``output_router_logits``), per-layer outputs (``output_hidden_states``) or a value carried past a layer all
fail these, and are captured in full. What no check sees is a forward that branches on its index to something
neither its attributes nor the config lists show (``if self.layer_idx == 40``): such a model plans as if its
layers were alike.
"""

from __future__ import annotations

import contextlib
import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import CaptureError
from autopar.ir.core import Op, Program, Ref, Value, map_refs
from autopar.passes.capture import LayerRepeat

__all__ = ["LayersDiffer", "expand_layers", "layer_kinds", "main_stack", "planning_cut", "reduction"]

MIN_RUN = 3  # a run of alike layers this long is captured as its first two


class LayersDiffer(CaptureError):
    """A capture of some layers that does not show what the others compute (``capture_for_planning`` then
    captures the whole model, ``autopar/planner.py``)."""


# -- which layers are alike ---------------------------------------------------------------------------------
def main_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The module list holding the most parameters, with at least ``MIN_RUN`` distinct layers; None without one."""
    best, size = None, 0
    for name, m in model.named_modules():
        if not (name and isinstance(m, nn.ModuleList) and len(m) >= MIN_RUN):
            continue
        n = sum(p.numel() for p in m.parameters())
        if n > size:
            best, size = (name, m), n
    if best is None or len({id(x) for x in best[1]}) < len(best[1]):
        return None  # one layer object listed twice (ALBERT's shared layer): not a stack of its own layers
    return best


def _describe(v: Any) -> Any:
    """A comparable description of an attribute's value: itself when plain, else its kind."""
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
        return (type(v).__name__, repr(v))
    if isinstance(v, torch.device):
        return ("device", v.type)
    if isinstance(v, enum.Enum):
        return ("enum", repr(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_describe(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(_describe(x)) for x in v)))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), repr(_describe(x))) for k, x in v.items())))
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype), v.requires_grad)
    if callable(v):
        return ("callable", getattr(v, "__module__", None), getattr(v, "__qualname__", type(v).__qualname__))
    return ("object", type(v).__module__, type(v).__qualname__)


def _attributes(layer: nn.Module) -> dict[tuple[str, str], Any]:
    """Every submodule's class and plain attributes (hooks included), by (submodule path, attribute)."""
    out: dict[tuple[str, str], Any] = {}
    for path, m in layer.named_modules(remove_duplicate=False):
        out[(path, "<class>")] = (type(m).__module__, type(m).__qualname__)
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                out[(path, k)] = v
        for k, p in m._parameters.items():
            described = None if p is None else ("param", tuple(p.shape), str(p.dtype), p.requires_grad)
            out[(path, f"<param {k}>")] = described
        for k, b in m._buffers.items():
            persistent = k not in m._non_persistent_buffers_set
            out[(path, f"<buffer {k}>")] = None if b is None else ("buffer", tuple(b.shape), str(b.dtype), persistent)
    return out


def _configs(model: nn.Module) -> list[Any]:
    """The config objects the model's modules hold (``module.config``), each once."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and not isinstance(c, (nn.Module, torch.Tensor)) and hasattr(c, "__dict__"):
            seen.setdefault(id(c), c)
    return list(seen.values())


def _per_layer_lists(model: nn.Module, n: int) -> list[tuple[Any, str]]:
    """(config, attribute) of each config list with one entry per layer of an n-layer stack."""
    return [
        (c, k)
        for c in _configs(model)
        for k, v in vars(c).items()
        if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == n
    ]


@dataclass(frozen=True)
class _Kinds:
    kinds: list[tuple]  # one hashable kind per layer
    index_attrs: list[tuple[str, str]]  # (submodule path, attribute) equal to the layer's index in every layer
    lists: list[tuple[Any, str]]  # the per-layer config lists


def layer_kinds(model: nn.Module, stack: nn.ModuleList) -> _Kinds:
    """Each layer's kind (the module docstring), and what holds a layer's index."""
    layers = list(stack)
    attrs = [_attributes(x) for x in layers]
    keys = set(attrs[0]).intersection(*attrs[1:])
    index = [
        k
        for k in keys
        if all(type(a[k]) is int and a[k] == i for i, a in enumerate(attrs))  # noqa: E721 (not bool)
    ]
    lists = _per_layer_lists(model, len(layers))
    kinds = []
    for i, a in enumerate(attrs):
        described = tuple(sorted((repr(k), repr(_describe(v))) for k, v in a.items() if k not in index))
        entries = tuple(repr(_describe(getattr(c, k)[i])) for c, k in lists)
        kinds.append((described, entries))
    return _Kinds(kinds, sorted(index), lists)


def reduction(kinds: list[tuple]) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]] | None:
    """(kept, copies) of a ``LayerRepeat`` for layers of these kinds: each run of ``MIN_RUN`` or more alike
    layers kept as its first two, the second followed by the rest; None when no run is that long."""
    kept: list[int] = []
    copies: list[tuple[int, int]] = []
    i = 0
    while i < len(kinds):
        j = i
        while j < len(kinds) and kinds[j] == kinds[i]:
            j += 1
        if j - i >= MIN_RUN:
            kept += [i, i + 1]
            copies.append((len(kept) - 1, j - i - 2))
        else:
            kept += range(i, j)
        i = j
    return (tuple(kept), tuple(copies)) if copies else None


@contextlib.contextmanager
def _stack_of(model: nn.Module, stack: nn.ModuleList, kept: tuple[int, ...], found: _Kinds) -> Iterator[None]:
    """``stack`` holding only its ``kept`` layers, each with the index attributes and per-layer config entries
    of its place; everything put back after."""
    layers = list(stack)
    modules = stack._modules
    lists = [(c, k, getattr(c, k)) for c, k in found.lists]
    stack._modules = OrderedDict((str(p), layers[i]) for p, i in enumerate(kept))
    try:
        for p, i in enumerate(kept):
            for path, attr in found.index_attrs:
                setattr(layers[i].get_submodule(path), attr, p)
        for c, k, v in lists:
            setattr(c, k, type(v)(v[i] for i in kept))
        yield
    finally:
        stack._modules = modules
        for i, layer in enumerate(layers):
            for path, attr in found.index_attrs:
                setattr(layer.get_submodule(path), attr, i)
        for c, k, v in lists:
            setattr(c, k, v)


def planning_cut(model: nn.Module) -> tuple[LayerRepeat, contextlib.AbstractContextManager] | None:
    """The ``LayerRepeat`` of ``model``'s main stack cut to two layers a run, and a context in which the model
    holds those alone (``autopar.planner.capture_for_planning`` captures it there); None when no run is cut."""
    found = main_stack(model)
    if found is None:
        return None
    name, stack = found
    kinds = layer_kinds(model, stack)
    reduced = reduction(kinds.kinds)
    if reduced is None:
        return None
    kept, copies = reduced
    return LayerRepeat(name, kept, copies), _stack_of(model, stack, kept, kinds)


# -- the program at full depth -----------------------------------------------------------------------------
def _position(name: str, stack: str) -> int | None:
    """The stack position of a module path or parameter name inside ``stack`` (``model.layers.3.mlp``: 3)."""
    if not name.startswith(stack + "."):
        return None
    head = name[len(stack) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _renamed(name: str, stack: str, index: int) -> str:
    """``name`` (inside ``stack``) moved to layer ``index``."""
    rest = name[len(stack) + 1 :].split(".", 1)
    return f"{stack}.{index}" + (f".{rest[1]}" if len(rest) > 1 else "")


def _same(x: Any, y: Any, ref) -> bool:
    """Whether two argument nests are equal, their Refs paired by ``ref(a, b)``."""
    if isinstance(x, Ref) or isinstance(y, Ref):
        return isinstance(x, Ref) and isinstance(y, Ref) and ref(x.name, y.name)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b, ref) for a, b in zip(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k], ref) for k in x)
    if type(x) is not type(y):
        return False
    return x == y or (x != x and y != y)  # NaN constants alike


class _Layers:
    """The captured program's layers: each position's ops (by index) and which layer made or owns each name."""

    def __init__(self, prog: Program, rep: LayerRepeat):
        self.stack = rep.stack
        self.blocks: dict[int, list[int]] = {}
        for k, op in enumerate(prog.ops):
            p = _position(op.path, rep.stack)
            if p is not None:
                self.blocks.setdefault(p, []).append(k)
        if sorted(self.blocks) != list(range(len(rep.kept))):
            raise LayersDiffer(f"the captured {rep.stack} has ops at positions {sorted(self.blocks)}")
        last = -1
        for p in range(len(rep.kept)):
            ks = self.blocks[p]
            if ks != list(range(ks[0], ks[-1] + 1)) or ks[0] <= last:
                raise LayersDiffer(f"the ops of {rep.stack}.{p} are not one contiguous run after the layer before")
            last = ks[-1]
        self.made: dict[str, int] = {}  # op result -> position of the layer computing it
        for p, ks in self.blocks.items():
            for k in ks:
                self.made.update((r, p) for r in prog.ops[k].results)
        self.owned = {v.name: _position(v.name, rep.stack) for v in prog.inputs}  # a layer's own inputs
        self.constant = {v.name for v in prog.inputs if v.attrs.get("constant")}


def _head(op: Op, stack: str) -> tuple:
    """What an op of a layer is apart from its arguments: target, types, path inside the layer, attributes."""
    return op.target, op.types, len(op.results), op.path[len(stack) + 1 :].split(".", 1)[1:], op.attrs


def _check_alike(prog: Program, layers: _Layers, a: int, b: int) -> dict[str, str]:
    """Layer ``b`` as layer ``a``'s program (the module docstring); returns each of a's results -> b's."""
    ops, stack = prog.ops, layers.stack
    A, B = layers.blocks[a], layers.blocks[b]
    if len(A) != len(B):
        raise LayersDiffer(f"{stack}.{b} has {len(B)} ops where {stack}.{a} has {len(A)}")
    phi: dict[str, str] = {}

    def ref(ra: str, rb: str) -> bool:
        if ra in phi:
            return phi[ra] == rb
        if layers.owned.get(ra) == a:  # a's own parameter: b's of the same name
            return layers.owned.get(rb) == b and _renamed(ra, stack, b) == rb
        if layers.made.get(rb) == a:  # b reads a's value where a reads its predecessor's
            return layers.made.get(ra) != a and layers.owned.get(ra) is None
        # a value from before the stack, or a shared input: the same for both
        return ra == rb and ra not in layers.made and layers.owned.get(ra) is None and ra not in layers.constant

    for ia, ib in zip(A, B):
        oa, ob = ops[ia], ops[ib]
        if _head(oa, stack) != _head(ob, stack) or not _same((oa.args, oa.kwargs), (ob.args, ob.kwargs), ref):
            raise LayersDiffer(f"{stack}.{b} computes {ob.target} where {stack}.{a} computes {oa.target} otherwise")
        phi.update(zip(oa.results, ob.results))
    return phi


def _check_reads(prog: Program, layers: _Layers, firsts: set[int]) -> None:
    """The first layer of each repeated run read only by itself and the next; each layer's inputs by its ops."""
    for op in prog.ops:
        here = layers.made.get(op.result) if op.results else None
        for r in op.input_refs():
            src = layers.made.get(r.name)
            if src in firsts and here not in (src, src + 1):
                raise LayersDiffer(f"{op.target} reads %{r.name} of {layers.stack}.{src}, a layer it repeats")
            own = layers.owned.get(r.name)
            if own is not None and here != own:
                raise LayersDiffer(f"{op.target} outside {layers.stack}.{own} reads its input {r.name}")
    for r in map_refs(list(prog.outputs), lambda x: x):
        if isinstance(r, Ref) and layers.made.get(r.name) in firsts:
            raise LayersDiffer(f"the program returns %{r.name} of {layers.stack}.{layers.made[r.name]}")


def expand_layers(prog: Program, rep: LayerRepeat) -> Program:
    """The program of the whole stack from one captured with ``rep``'s layers: each repeated layer's ops (and
    inputs) copied ``count`` times after it, each copy reading the one before where the layer reads its
    predecessor; the layers and their inputs renamed to the model's indices, the results numbered in order."""
    layers = _Layers(prog, rep)
    stack = rep.stack
    maps = {b: _check_alike(prog, layers, b - 1, b) for b, _ in rep.copies}
    _check_reads(prog, layers, {b - 1 for b, _ in rep.copies})
    count = dict(rep.copies)

    def own_name(name: str) -> str:  # an input of a captured layer under its index in the model
        p = layers.owned.get(name)
        return name if p is None else _renamed(name, stack, rep.kept[p])

    redirect: dict[str, str] = {}  # a repeated layer's result -> its last copy's

    def outside(r: Ref) -> Ref:  # a read of a value a copy does not stand for
        return Ref(own_name(redirect.get(r.name, r.name)))

    new_ops: list[Op] = []
    for k, op in enumerate(prog.ops):
        args, kwargs = map_refs((op.args, op.kwargs), outside)
        p = layers.made.get(op.result) if op.results else None
        path = op.path if p is None else _renamed(op.path, stack, rep.kept[p])
        new_ops.append(op.with_(args=args, kwargs=kwargs, path=path))
        if p in count and k == layers.blocks[p][-1]:
            copies, last = _copies(prog, layers, p, rep.kept[p], count[p], maps[p], outside)
            new_ops += copies
            redirect.update(last)
    outputs = tuple(map_refs(list(prog.outputs), lambda r: Ref(own_name(redirect.get(r.name, r.name)))))
    inputs = _expanded_inputs(prog.inputs, layers, rep)
    return _numbered(prog.with_(inputs=inputs, ops=tuple(new_ops), outputs=outputs))


def _copies(
    prog: Program, layers: _Layers, p: int, index: int, n: int, phi: dict[str, str], outside
) -> tuple[list[Op], dict[str, str]]:
    """The ops of ``n`` copies of the layer at position ``p`` (the model's layer ``index``), and its results ->
    the last copy's. A copy reads its own results and parameters (of layers ``index + c``), the copy before's
    value where the layer reads the one before's (``phi``: that layer's results -> this one's), and otherwise
    what the layer reads (``outside``)."""
    stack, block = layers.stack, [prog.ops[k] for k in layers.blocks[p]]
    ops: list[Op] = []
    prev: dict[str, str] = {}  # the layer before the copy (p itself, then each copy): p's names -> its
    for c in range(index + 1, index + n + 1):
        theta = {r: f"{c}~{r}" for op in block for r in op.results}

        def copied(r: Ref, theta: dict[str, str] = theta, prev: dict[str, str] = prev, c: int = c) -> Ref:
            if r.name in theta:
                return Ref(theta[r.name])
            if layers.owned.get(r.name) == p:
                return Ref(_renamed(r.name, stack, c))
            if layers.made.get(r.name) == p - 1:  # the layer before's value: the copy before's
                return Ref(prev.get(phi[r.name], phi[r.name]))
            return outside(r)

        for op in block:
            args, kwargs = map_refs((op.args, op.kwargs), copied)
            results = tuple(theta[r] for r in op.results)
            ops.append(op.with_(results=results, args=args, kwargs=kwargs, path=_renamed(op.path, stack, c)))
        prev = theta
    return ops, prev


def _expanded_inputs(inputs: tuple[Value, ...], layers: _Layers, rep: LayerRepeat) -> tuple[Value, ...]:
    """The inputs renamed to the model's layers, each repeated layer's copied after its last one of each kind
    (parameters after its parameters, buffers after its buffers), as torch.export lists a whole model's."""
    count = dict(rep.copies)
    last: dict[tuple[int, str], int] = {}
    for i, v in enumerate(inputs):
        p = layers.owned[v.name]
        if p in count:
            last[(p, v.kind)] = i
    out: list[Value] = []
    for i, v in enumerate(inputs):
        p = layers.owned[v.name]
        out.append(v if p is None else Value(_renamed(v.name, rep.stack, rep.kept[p]), v.kind, v.type, v.attrs))
        if p is None or last.get((p, v.kind)) != i:
            continue
        mine = [w for w in inputs if layers.owned[w.name] == p and w.kind == v.kind]
        for c in range(1, count[p] + 1):
            out += [Value(_renamed(w.name, rep.stack, rep.kept[p] + c), w.kind, w.type, w.attrs) for w in mine]
    return tuple(out)


def _numbered(prog: Program) -> Program:
    """Op results numbered 0, 1, ... in program order, as ``lower`` numbers them."""
    names: dict[str, str] = {}
    for op in prog.ops:
        for r in op.results:
            names[r] = str(len(names))

    def rename(r: Ref) -> Ref:
        return Ref(names.get(r.name, r.name))

    ops = tuple(
        op.with_(
            results=tuple(names[r] for r in op.results),
            args=map_refs(op.args, rename),
            kwargs=map_refs(op.kwargs, rename),
        )
        for op in prog.ops
    )
    return prog.with_(ops=ops, outputs=tuple(map_refs(list(prog.outputs), rename)))
