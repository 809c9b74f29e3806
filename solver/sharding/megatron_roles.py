"""Megatron's tensor-parallel layout read off the IR: which ops are column-parallel, row-parallel or split.

The one copy of the detection; the search's profile (``autopar/search/profile.py``), the stage
balance's tensor-parallel cost (``solver/stages/cost.py``) and the ``megatron`` baseline all read it.
Not assumed per model:

- a contraction with a weight operand (a parameter, or a view or cast of one) is **column**-parallel
  (output split over tp; the gradient of its activation input is all-reduced in the backward pass,
  Megatron's f) unless its activation comes from a split value, in which case it is **row**-parallel
  (its FLOPs divide, its output is a partial sum all-reduced in the forward pass, Megatron's g);
- an embedding lookup of the vocabulary table (given as ``vocab``) is **vocab**-parallel: its FLOPs
  divide and its output is all-reduced in the forward pass;
- any other op reading a split value is **split** (its FLOPs divide and its output stays split);
- everything else is replicated over tp (role ``""``).

``megatron_layout`` turns the roles into the storage of every parameter (the ``megatron`` baseline's
constraints, ``solver/sharding/baselines.py``): the weight of a column-parallel contraction split on its output
features, of a row-parallel one on its input features, whichever way the operand is transposed; the
bias added to a column-parallel output split with it; a column output cut into n equal pieces along its
features (a fused QKV, a fused gate/up) split per piece (``chunks`` n); embedding tables by vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.ir.core import COLLECTIVES, VIEW_OPS, Op, Program

CONTRACTIONS = frozenset(
    {"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm", "aten.convolution", "aten.conv2d"}
)
COLUMN, ROW, VOCAB, SPLIT = "column", "row", "vocab", "split"


def param_origins(prog: Program, collectives: bool = False) -> dict[str, str]:
    """The parameter that each parameter, view or cast of one in ``prog`` is (a view or cast is read as it);
    ``collectives``: a collective's result on one too (an all-gathered weight is the weight, whole)."""
    origin = {v.name: v.name for v in prog.inputs if v.kind == "param"}
    through = VIEW_OPS | {"aten.to.dtype", "aten._to_copy"} | (COLLECTIVES - {"send", "recv"} if collectives else set())
    for op in prog.ops:
        refs = op.input_refs()
        if refs and refs[0].name in origin and op.target in through:
            origin.update(dict.fromkeys(op.results, origin[refs[0].name]))
    return origin


def weight_values(prog: Program) -> frozenset[str]:
    """Parameters and views or casts of them (a transposed weight is still a weight)."""
    return frozenset(param_origins(prog))


def megatron_roles(ops: Sequence[Op], weights: frozenset[str], vocab: str | None = None) -> list[str]:
    """The role of every op of ``ops`` (in order) under Megatron's layout (see the module docstring)."""
    split: set[str] = set()  # values split over tp (downstream of a column-parallel contraction)
    roles = []
    for op in ops:
        refs = [r.name for r in op.input_refs()]
        acts = [n for n in refs if n not in weights]
        role = ""
        if op.target in CONTRACTIONS and acts and len(acts) < len(refs):
            role = ROW if any(n in split for n in acts) else COLUMN
        elif op.target == "aten.embedding" and vocab is not None and refs and refs[0] == vocab:
            role = VOCAB
        elif any(n in split for n in acts):
            role = SPLIT
        if role in (COLUMN, SPLIT):
            split.update(op.results)
        roles.append(role)
    return roles


_CASTS = frozenset({"aten.to.dtype", "aten._to_copy"})
_RESHAPES = frozenset({"aten.view", "aten._unsafe_view", "aten.reshape"})
_PIECES = frozenset({"aten.split.Tensor", "aten.split_with_sizes", "aten.chunk", "aten.unbind.int"})
# where a contraction reads its weight and its bias, and which weight dims are (output, input) features
# when the operand is not transposed: nn.Linear keeps W as [out, in], HF's Conv1D (mm, addmm) as [in, out]
_OPERANDS = {
    "aten.linear": (1, 2, (0, 1)),
    "aten.mm": (1, None, (1, 0)),
    "aten.matmul": (1, None, (1, 0)),
    "aten.addmm": (2, 0, (1, 0)),
    "aten.convolution": (1, 2, (0, 1)),
    "aten.conv2d": (1, 2, (0, 1)),
}


def _param_sources(prog: Program) -> dict[str, tuple[str, bool]]:
    """Value -> (the parameter it is a view or cast of, whether a 2-D transpose lies between them)."""
    source = {v.name: (v.name, False) for v in prog.inputs if v.kind == "param"}
    for op in prog.ops:
        refs = op.input_refs()
        if refs and refs[0].name in source and op.target in (VIEW_OPS - _PIECES) | _CASTS:
            name, flipped = source[refs[0].name]
            flip = op.target in ("aten.t", "aten.transpose.int", "aten.permute") and len(op.types[0].shape) == 2
            for r in op.results:
                source[r] = (name, flipped != flip)
    return source


def _arg(op: Op, i: int | None) -> str | None:
    if i is None or i >= len(op.args) or not hasattr(op.args[i], "name"):
        return None
    return op.args[i].name


def _features(op: Op, lead: int, block: int | None) -> tuple[int, int | None] | None:
    """Where the leading factor of a column-parallel output's feature block is after the view ``op``:
    (its dim, the size of the whole block while it is the trailing dims), or None when it is lost."""
    shape = op.types[0].shape
    if op.target in _RESHAPES:
        if block is None:
            return None
        for p in range(len(shape)):
            rest = 1
            for d in shape[p:]:
                rest *= d
            if rest == block:
                return p, block
        return None
    if op.target in ("aten.permute", "aten.transpose.int", "aten.t"):
        n = len(shape)
        if op.target == "aten.permute":
            order = [d % n for d in op.args[1]]
        else:
            i, j = (op.args[1] % n, op.args[2] % n) if op.target == "aten.transpose.int" else (0, 1)
            order = list(range(n))
            order[i], order[j] = order[j], order[i]
        return order.index(lead), None
    return lead, block  # a bias add, a cast or a view that keeps the dims


def _pieces(op: Op, lead: int) -> int:
    """How many equal pieces ``op`` (a split, chunk or unbind) cuts dim ``lead`` into (1: another dim, or unequal)."""
    unbind = op.target == "aten.unbind.int"
    ndim = len(op.types[0].shape) + unbind
    dim = op.args[1 if unbind else 2] if len(op.args) > (1 if unbind else 2) else op.kwargs.get("dim", 0)
    if dim % ndim != lead or len({t.shape for t in op.types}) != 1:
        return 1
    return len(op.types)


def megatron_layout(prog: Program) -> dict[str, tuple[str, int, int]]:
    """Parameter name -> (role, tensor dim to shard, chunks) under Megatron's layout (see the module
    docstring): ``("vocab", 0, 1)`` for an embedding table, ``("column", d, n)`` for the weight (and bias)
    of a column-parallel contraction whose output is cut into n equal pieces, ``("row", d, 1)`` for the
    weight of a row-parallel one. Parameters not named stay replicated."""
    params = {v.name for v in prog.inputs if v.kind == "param"}
    source = _param_sources(prog)
    types = prog.types()
    roles = megatron_roles(prog.ops, weight_values(prog))
    layout: dict[str, tuple[str, int, int]] = {}
    owners: dict[int, list[str]] = {}  # column-parallel contraction (op index) -> its weight and biases
    chunks: dict[int, int] = {}
    features: dict[str, tuple[int, int, int | None]] = {}  # value -> (contraction, lead dim, block size)
    for i, (op, role) in enumerate(zip(prog.ops, roles)):
        refs = [r.name for r in op.input_refs()]
        if op.target == "aten.embedding" and refs and refs[0] in params:
            layout[refs[0]] = ("vocab", 0, 1)  # vocab-parallel embedding (and the tied output layer)
            continue
        if role in (COLUMN, ROW) and op.target in _OPERANDS:
            w_at, b_at, (out_dim, in_dim) = _OPERANDS[op.target]
            w, bias = _arg(op, w_at), _arg(op, b_at)
            if w not in source or len(types[source[w][0]].shape) < 2 or source[w][0] in layout:
                continue
            name, flipped = source[w]
            if flipped:
                out_dim, in_dim = in_dim, out_dim
            layout[name] = (role, out_dim if role == COLUMN else in_dim, 1)
            if role == COLUMN:
                owners[i] = [name]
                if bias in params:
                    owners[i].append(bias)
                shape = op.types[0].shape
                features[op.result] = (i, len(shape) - 1, shape[-1])
            continue
        if not refs or refs[0] not in features:
            continue
        k, lead, block = features[refs[0]]
        if op.target in _PIECES:
            chunks[k] = max(chunks.get(k, 1), _pieces(op, lead))
        elif op.target in VIEW_OPS | _CASTS | {"aten.add.Tensor"}:
            where = _features(op, lead, block)
            if where is not None:
                features.update(dict.fromkeys(op.results, (k, *where)))
            if op.target == "aten.add.Tensor":  # the bias of the column-parallel output
                owners[k] += [r for r in refs[1:] if r in params and len(types[r].shape) == 1]
    for k, names in owners.items():
        for name in names:
            role, dim, _ = layout.get(name, (COLUMN, 0, 1))
            layout[name] = (role, dim, chunks.get(k, 1))
    return layout


__all__ = [
    "COLUMN",
    "CONTRACTIONS",
    "ROW",
    "SPLIT",
    "VOCAB",
    "megatron_layout",
    "megatron_roles",
    "param_origins",
    "weight_values",
]
