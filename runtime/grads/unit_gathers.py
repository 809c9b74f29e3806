"""Where ZeRO-3 gathers and frees each unit in a generated GraphModule, and a counter of gathered bytes alive.

``place_gathers`` rewrites a rank's generated module (its forward program, a pipeline stage, a
recomputation part): the ``get_attr`` nodes of the managed parameters go, and for each unit (the root
or a repeated block, ``solver/sharding/blocks.py``) the module reads, in the order it first reads them:

- ``gather(u, next)`` just before the first node reading a parameter of unit ``u``: it returns the
  unit's whole parameters (``getitem`` nodes hand each one to its readers) and issues the all-gather of
  ``next``, the next unit this module reads, asynchronously, so that it travels while ``u`` computes;
- ``release(gathered, copies)`` just after the last node reading one of them, or a view of one (a
  transpose, a reshape): from there nothing of the forward refers to the unit's storage (autograd
  saves it as tokens, ``runtime/grads/zero3.py``), so the storage is freed when the last local goes (fx's
  generated code drops every value after its last use).
- mixed precision: a parameter read in the compute dtype is read through ``cast_to`` (codegen emits the
  casts at the top of the graph); the unit's casts move to just after its gather, the gather goes before
  the first reader of a copy, and the release after the casts (or a later reader of the fp32 parameters):
  the unit's fp32 storage is freed as soon as its copies are made, and ``copies`` ((parameter index, copy)
  pairs) tells the runtime which tensors are the unit's copies, so that autograd saves them as tokens too
  and each copy is freed after its last reader in the forward (FSDP2's ``reshard_after_forward``).

Why a pass over the generated graph rather than module hooks: the generated module is flat (one
graph per stage, no submodule per block to hook), but every node knows its parameter readers, so the
gather and free points are exact and the same in every way the module runs (plain calls, the
sub-pipelined interpreter of ``runtime/execute/subpipeline.py``, recomputation parts), with no hook to keep
in sync. docs/runtime.md says more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.runtime.build.precision import cast_to


def place_gathers(
    gm: fx.GraphModule,
    unit_of: dict[str, int],
    gather: Callable[[int, int], tuple[torch.Tensor, ...]],
    release: Callable[[tuple], None],
    members: Callable[[int], list[str]],
) -> None:
    """Rewrite ``gm`` in place: ``unit_of`` maps each managed parameter (by its attribute path) to its
    unit; ``gather(u, next)`` / ``release(gathered)`` are called where the module starts and stops
    using unit ``u``; ``gather`` returns the whole parameters of ``members(u)``, in that order."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    reads: dict[int, dict[str, fx.Node]] = {}
    for n in nodes:
        if n.op == "get_attr" and n.target in unit_of:
            reads.setdefault(unit_of[n.target], {})[n.target] = n
    spans: dict[int, tuple[fx.Node, fx.Node | None]] = {}
    casts: dict[int, list[tuple[str, fx.Node]]] = {}  # unit -> (parameter, its compute-dtype cast)
    for u, attrs in reads.items():
        casts[u] = [(name, c) for name, a in attrs.items() for c in a.users if c.target is cast_to]
        cast_nodes = {c for _, c in casts[u]}
        plain = [m for a in attrs.values() for m in _alias_users(a) if m not in cast_nodes]
        users = plain + [m for c in cast_nodes for m in _alias_users(c)]
        if not users:
            for a in attrs.values():
                graph.erase_node(a)
            continue
        spans[u] = (min(users, key=pos.__getitem__), max(plain, key=pos.__getitem__) if plain else None)
    order = sorted(spans, key=lambda u: pos[spans[u][0]])
    for k, u in enumerate(order):
        first, last = spans[u]
        nxt = order[k + 1] if k + 1 < len(order) else -1
        with graph.inserting_before(first):
            g = graph.call_function(gather, (u, nxt))
            index = {name: j for j, name in enumerate(members(u))}
            got = {name: graph.call_function(_item, (g, j)) for name, j in index.items()}
        for name, a in reads[u].items():
            a.replace_all_uses_with(got[name])
            graph.erase_node(a)
        for _, c in casts[u]:  # each unit's copies made where it starts computing, not where codegen cast it
            first.prepend(c)
        copies = tuple((index[name], c) for name, c in casts[u])
        with graph.inserting_after(last if last is not None else casts[u][-1][1]):
            graph.call_function(release, (g, copies))
    gm.recompile()


def _alias_users(node: fx.Node) -> list[fx.Node]:
    """Every node reading ``node`` or, through views, its storage."""
    out, todo = [], [node]
    while todo:
        for user in todo.pop().users:
            out.append(user)
            if _is_view(user.target):
                todo.append(user)
    return out


def _is_view(target) -> bool:
    op = target.default if isinstance(target, torch._ops.OpOverloadPacket) else target
    if not isinstance(op, torch._ops.OpOverload):  # an item of a tuple: of the gather, or of a split's views
        return getattr(target, "__name__", "") in ("_item", "_getitem", "getitem")
    return bool(op._schema.returns) and op._schema.returns[0].alias_info is not None


def _item(xs, i):
    return xs[i]


class LiveBytes:
    """Bytes of the gathered storages still alive (each counted until its storage is freed) and their
    most at any moment; sampled whenever one is added, which is when the total can rise."""

    def __init__(self) -> None:
        self._refs: list[tuple[StorageWeakRef, int, int]] = []  # (storage, its bytes, its address)
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self._refs.append((StorageWeakRef(s), s.nbytes(), s.data_ptr()))
        self.peak = max(self.peak, self.alive())

    def drop(self, t: torch.Tensor) -> None:
        """``t``'s storage is about to be freed by hand (resized to nothing)."""
        ptr = t.untyped_storage().data_ptr()
        self._refs = [x for x in self._refs if x[2] != ptr or x[0].expired()]

    def alive(self) -> int:
        self._refs = [x for x in self._refs if not x[0].expired()]
        return sum(x[1] for x in self._refs)

    def reset_peak(self) -> None:
        self.peak = self.alive()


__all__ = ["LiveBytes", "place_gathers"]
