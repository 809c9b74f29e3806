"""ZeRO-3's gather units of a program: one per repeated block (a numbered child of a module list), plus a root.

The repeated blocks are read from the module paths torch.export records on every op (``op.path``): a
path ``<stack>.<i>.<rest>`` lies in block ``i`` of the module list ``<stack>`` (``layer_key``, the
same key the ILP folds identical layers by), and every stack with at least two numbered children is a
list of repeated blocks (``transformer.h``, ``model.layers``, T5's ``encoder.block`` and
``decoder.block``: no model-specific name). A parameter all of whose readers lie in one block belongs
to that block's unit; every other parameter (embeddings, a tied head, the final norm, a parameter read
inside two blocks or outside any) to the root unit. Ops without a module path (inserted by a pass) do
not decide. This is FSDP2's ``fully_shard`` per block, then the root, found from the program.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from autopar.ir.core import Program

ROOT = "root"
LAYER_PATH = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")


def layer_key(path: str) -> tuple[str, int] | None:
    """``(stack, i)`` of a module path in the ``i``-th numbered child of module list ``stack``, else ``None``."""
    m = LAYER_PATH.match(path or "")
    return (m["stack"], int(m["index"])) if m else None


def param_units(program: Program, names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``(label, parameter names)`` of every non-empty unit of ``names``: the root first (label
    ``"root"``), then the blocks in the order the program first reads them (label ``stack.i``)."""
    names = list(names)
    wanted = set(names)
    keys = [layer_key(op.path) for op in program.ops]
    indices: dict[str, set[int]] = {}
    for k in keys:
        if k is not None:
            indices.setdefault(k[0], set()).add(k[1])
    repeated = {s for s, i in indices.items() if len(i) >= 2}
    readers: dict[str, set] = {n: set() for n in names}
    first: dict[str, int] = {}
    for pos, (op, k) in enumerate(zip(program.ops, keys)):
        for r in op.input_refs():
            if r.name not in wanted:
                continue
            first.setdefault(r.name, pos)
            if op.path:  # an op a pass inserted (no module path) does not decide
                readers[r.name].add(k if k is not None and k[0] in repeated else None)
    units: dict[str, list[str]] = {ROOT: []}
    order: dict[str, int] = {ROOT: -1}
    for n in names:
        found = readers[n]
        key = next(iter(found)) if len(found) == 1 else None
        label = ROOT if key is None else f"{key[0]}.{key[1]}"
        units.setdefault(label, []).append(n)
        order[label] = min(order.get(label, first.get(n, 0)), first.get(n, 0))
    return [(label, units[label]) for label in sorted(units, key=lambda x: order[x]) if units[label]]


__all__ = ["ROOT", "layer_key", "param_units"]
