"""What autograd saves for backward: the values of a program each op keeps, found by running the op on fake tensors.

An op's derivative formula keeps some of its inputs, some of its outputs and, for composite ops, some
intermediates (``cross_entropy_loss`` keeps its ``log_softmax``, ``layer_norm`` its mean and rstd).
That is what a training step holds between forward and backward, not every op output. Each op is
called once per signature (target, argument shapes and dtypes, which inputs need a gradient) on fake
CPU tensors (``FakeTensorMode``: no memory, but CPU's kernel choice, e.g. flash attention) under
``torch.autograd.graph.saved_tensors_hooks``; every packed tensor is matched by storage to an input
or an output of the op, else counted as an intermediate of its own bytes.

A value that is a view of another (``VIEW_OPS``, the runtime's ``grad_all_reduce``; its ``local_shard``
copies the shard into a storage of its own) shares its root's storage: saving it keeps the root alive.
``SavedValues.roots`` is the set of storage roots some op saves; parameters among them are counted as
parameters, never as activations. What this ignores: the runtime's vocabulary-parallel cross-entropy
(priced as the dense op), tensors an op saves only on a device other than CPU (a fused GPU kernel's
workspace), and ops without a fake-tensor kernel, which fall back to saving every float output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.ir.core import DEVICE, VIEW_OPS, Program, Shard, TensorType, map_refs, resolve_target

ALIASING = frozenset({"grad_all_reduce"})  # the runtime's identity collectives return a view of their input


@dataclass(frozen=True)
class OpSaved:
    """What one op keeps for backward: positions in ``op.input_refs()`` and in ``op.results``, and the bytes of
    intermediates (at the op's global shapes)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    extra: tuple[tuple[tuple[int, ...], int], ...]  # each intermediate's (global shape, bytes)


NOTHING = OpSaved((), (), ())


def _fake(t: TensorType, grad: bool) -> torch.Tensor:
    x = torch.empty(t.shape, dtype=t.torch_dtype, device="cpu")
    return x.requires_grad_(grad and x.is_floating_point())


_CACHE: dict[tuple, OpSaved] = {}  # (target, input signature, arguments with values blanked) -> what it saves


def _saved(call) -> OpSaved:
    """The saved-tensor structure of the op ``call`` runs on fake inputs (it returns (inputs, outputs))."""
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ins, outs = call()
    key = {}
    for i, t in enumerate(ins):
        key.setdefault(id(t.untyped_storage()), ("in", i))
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor):
            key.setdefault(id(t.untyped_storage()), ("out", i))
    saved_in, saved_out, extra, seen = set(), set(), [], set()
    for t in packed:
        sid = id(t.untyped_storage())
        if sid in seen:
            continue
        seen.add(sid)
        where = key.get(sid)
        if where is None:
            extra.append((tuple(t.shape), t.untyped_storage().nbytes()))
        elif where[0] == "in":
            saved_in.add(where[1])
        else:
            saved_out.add(where[1])
    return OpSaved(tuple(sorted(saved_in)), tuple(sorted(saved_out)), tuple(extra))


def op_saved(op, types: dict[str, TensorType], grad: set[str]) -> OpSaved:
    """What ``op`` keeps for backward when the values in ``grad`` need a gradient (nothing when none of its
    inputs does). An op that cannot run on fake tensors keeps every float output (the old upper bound)."""
    refs = op.input_refs()
    if "." not in op.target or not any(r.name in grad for r in refs):  # a collective, or nothing to differentiate
        return NOTHING
    try:
        fn = resolve_target(op.target)
    except (KeyError, AttributeError):
        return OpSaved((), tuple(i for i, t in enumerate(op.types) if t.is_float), ())
    sig = tuple((types[r.name].shape, types[r.name].dtype, r.name in grad) for r in refs)

    def call():
        # one meta tensor per input position (a value read twice is two tensors: each position is matched)
        ins = [_fake(types[r.name], r.name in grad) for r in refs]
        it = iter(ins)
        args, kwargs = map_refs((op.args, op.kwargs), lambda r: next(it))
        args = _on_cpu(args)
        kwargs = {k: _on_cpu(v) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        return ins, outs

    key = (op.target, sig, repr(map_refs((op.args, op.kwargs), lambda r: "%")))
    if key not in _CACHE:
        if len(_CACHE) > 65536:
            _CACHE.clear()
        try:
            _CACHE[key] = _saved(call)
        except Exception:  # no fake kernel (data-dependent shapes, ...): every float output, as before
            _CACHE[key] = OpSaved((), tuple(i for i, t in enumerate(op.types) if t.is_float), ())
    return _CACHE[key]


def _on_cpu(x):
    if x is DEVICE:
        return "cpu"
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(y) for y in x)
    return x


@dataclass(frozen=True)
class SavedValues:
    """The program's saved activations: storage roots some op keeps (``roots``), each value's root
    (``root_of``), and every op's saved intermediates, (global shape, bytes) each (``extra``, by result)."""

    roots: frozenset[str]
    root_of: dict[str, str]
    extra: dict[str, tuple[tuple[tuple[int, ...], int], ...]]

    def activation(self, name: str) -> bool:
        """Whether ``name`` is the root of a saved storage (count it once, at its own placement)."""
        return name in self.roots


def root_map(prog: Program) -> dict[str, str]:
    """Each value's storage root: itself, or for a view (and the runtime's aliasing collectives) its input's
    root. A ``reshape`` of a broadcast (a view chain through ``expand``) is a view only where the strides
    allow it: merging a broadcast dimension copies (LLaMA's grouped-query ``repeat_kv``: expand, then
    reshape), found by replaying the chain on meta tensors. Other reshapes stay views: their roots' real
    strides are the kernels' (CPU attention returns its output transposed in memory), not contiguous."""
    root: dict[str, str] = {v.name: v.name for v in prog.inputs}
    types = prog.types()
    meta: dict[str, torch.Tensor] = {}  # values on a view chain through an expand: a meta tensor with their strides

    def layout(name: str) -> torch.Tensor:
        if name not in meta:
            t = types[name]
            meta[name] = torch.empty(t.shape, dtype=t.torch_dtype, device="meta")
        return meta[name]

    for op in prog.ops:
        refs = op.input_refs()
        alias = bool(refs) and (op.target in ALIASING or op.target in VIEW_OPS)
        if alias and op.target in VIEW_OPS and (op.target == "aten.expand" or refs[0].name in meta):
            copied = not _replay_view(op, layout, meta)
            alias = not (copied and op.target == "aten.reshape")
        for r in op.results:
            root[r] = root[refs[0].name] if alias else r
    return root


def _replay_view(op, layout, meta: dict[str, torch.Tensor]) -> bool:
    """Run the view op on its input's meta layout, keeping the results' layouts; whether it is a view
    (False: a reshape that had to copy). An op that cannot replay is taken as a view, as before."""
    try:
        args, kwargs = map_refs((op.args, op.kwargs), lambda r: layout(r.name))
        out = resolve_target(op.target)(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, KeyError, AttributeError):
        return True
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for r, t in zip(op.results, outs):
        meta[r] = t
    return all(t._is_view() for t in outs)


def saved_values(prog: Program) -> SavedValues:
    """What the program's training step keeps for backward (see the module docstring)."""
    types, grad, root = prog.types(), prog.requires_grad(), root_map(prog)
    roots: set[str] = set()
    extra: dict[str, tuple] = {}
    for op in prog.ops:
        s = op_saved(op, types, grad)
        refs = op.input_refs()
        roots.update(root[refs[i].name] for i in s.inputs)
        roots.update(root[op.results[i]] for i in s.outputs)
        if s.extra:
            extra[op.result] = s.extra
    return SavedValues(frozenset(roots), root, extra)


def activation_bytes(prog: Program, local: bool = True) -> float:
    """Bytes of activations one rank keeps for backward: saved roots that are neither parameters, buffers nor
    the user's inputs (a pipeline stage's received values are activations), plus saved intermediates (split
    as their op's largest operand); at the local placements when ``local``, else whole."""
    sv = saved_values(prog)
    types = prog.types()
    held = {v.name for v in prog.inputs if v.kind != "input" or "recv" not in v.attrs}  # received ones count
    total = 0.0
    for name in sv.roots - held:
        t = types[name]
        total += t.local_nbytes(prog.mesh) if local else t.nbytes
    for op in prog.ops:
        if op.result in sv.extra:
            total += extra_bytes(op, sv.extra[op.result], types, prog.mesh.sizes if local else None)
    return total


def aligned_operand(shape: tuple[int, ...], operands: list[TensorType]) -> tuple[int, int]:
    """The operand (index into ``operands``: an op's inputs, then its outputs) a saved intermediate of
    ``shape`` lines up with best, and how many leading dims they share: the most leading dims of equal
    size, then an equal shape, then the largest operand."""

    def score(i: int) -> tuple[int, bool, int]:
        o = operands[i].shape
        lead = next((d for d in range(min(len(o), len(shape))) if o[d] != shape[d]), min(len(o), len(shape)))
        return lead, o == shape, operands[i].nbytes

    best = max(range(len(operands)), key=score)
    return best, score(best)[0]


def extra_bytes(op, extra, types: dict[str, TensorType], sizes: tuple[int, ...] | None, placements=None) -> float:
    """Bytes on one rank of the intermediates ``extra`` (``(global shape, bytes)`` each) that ``op`` saves; whole
    when ``sizes`` is None. An intermediate is split as the operand (input or output; ``placements``
    overrides their own, one per operand, inputs first) it lines up with best: the most leading dims of
    equal size (``layer_norm``'s mean ``[b, s, 1]`` follows its input ``[b, s, h]``, attention's float mask
    ``[b, 1, s, s]`` the boolean one it was made from); only a split dim it shares is split."""
    if sizes is None:
        return float(sum(b for _, b in extra))
    operands = [types[r.name] for r in op.input_refs()] + list(op.types)
    places = placements if placements is not None else [t.placements for t in operands]
    total = 0.0
    for shape, nbytes in extra:
        best, lead = aligned_operand(shape, operands)
        p = places[best]
        ways = 1
        for q, n in zip(p or (), sizes):
            if isinstance(q, Shard) and q.dim < lead:
                ways *= n
        total += nbytes / ways
    return total


__all__ = [
    "NOTHING",
    "OpSaved",
    "SavedValues",
    "activation_bytes",
    "aligned_operand",
    "extra_bytes",
    "op_saved",
    "root_map",
    "saved_values",
]
