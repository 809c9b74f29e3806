"""Megatron's tensor-parallel layout read off the IR: which ops are column-parallel, row-parallel or split.

The one copy of the detection; the search's profile (``autopar/search/profile.py``) and the stage
balance's tensor-parallel cost (``solver/stage_cost.py``) both read it. Not assumed per model:

- a contraction with a weight operand (a parameter, or a view or cast of one) is **column**-parallel
  (output split over tp; the gradient of its activation input is all-reduced in the backward pass,
  Megatron's f) unless its activation comes from a split value, in which case it is **row**-parallel
  (its FLOPs divide, its output is a partial sum all-reduced in the forward pass, Megatron's g);
- an embedding lookup of the vocabulary table (given as ``vocab``) is **vocab**-parallel: its FLOPs
  divide and its output is all-reduced in the forward pass;
- any other op reading a split value is **split** (its FLOPs divide and its output stays split);
- everything else is replicated over tp (role ``""``).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.ir.core import VIEW_OPS, Op, Program

CONTRACTIONS = frozenset(
    {"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm", "aten.convolution", "aten.conv2d"}
)
COLUMN, ROW, VOCAB, SPLIT = "column", "row", "vocab", "split"


def weight_values(prog: Program) -> frozenset[str]:
    """Parameters and views or casts of them (a transposed weight is still a weight)."""
    out = {v.name for v in prog.inputs if v.kind == "param"}
    for op in prog.ops:
        refs = op.input_refs()
        if refs and refs[0].name in out and op.target in VIEW_OPS | {"aten.to.dtype", "aten._to_copy"}:
            out.update(op.results)
    return frozenset(out)


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


__all__ = ["COLUMN", "CONTRACTIONS", "ROW", "SPLIT", "VOCAB", "megatron_roles", "weight_values"]
