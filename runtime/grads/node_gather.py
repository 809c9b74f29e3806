"""ZeRO-3's unit gathers and reduce-scatters across nodes, hierarchically as MiCS runs them (MiCS Sec. 3.3).

A ZeRO group of p ranks (the ZeRO axes' product; member j, mixed radix over the axes, the first slowest: the order
``local_slice`` cuts the slices in) spanning p/k nodes of k of its ranks each is gathered in two steps instead of one
ring over all p:

1. **inter-node**: k parallel all-gathers, each among the group's ranks with the same local index on the p/k nodes
   (one rank per node: each rides its own rail), of the rank's slice: p/k slices, ``(p - k) / p`` of the unit over
   the network where the flat ring moves ``(p - 1) / p``;
2. **intra-node**: one all-gather of those p/k slices among the group's k ranks of the node (NVLink);
3. the rows arrive ordered (local index, node); the unit is laid out in member order (node, local index) by the
   copy that places each parameter anyway (``Zero3Params._finish``): a transposed view, no extra copy, the same
   bytes as the flat gather's (MiCS's "data rearrangement").

The unit's gradient is reduce-scattered in the mirrored order: its rows permuted to (local index, node), a
reduce-scatter among the node's k ranks (each keeps the p/k rows of its local index, summed over the node), then
one among the p/k ranks of its local index (its own row, summed over the group). The sum is the flat one's
regrouped (node by node, then across nodes): equal to it up to float rounding, not bit for bit.

**Only where the plan says so**: ``TrainingSetup.hierarchical_gather``, decided where the plan is made, from the
cluster (``ClusterSpec.hierarchical_pays``: the two steps price below the flat ring, as on MiCS's p3dn, not on a
DGX's fast rails) and priced so by the search and the ILP; without it the gathers are flat whatever the launcher
says. **Ranks per node** come from the launcher: ``RuntimeOptions.ranks_per_node`` (``TrainConfig.ranks_per_node``),
else torchrun's ``LOCAL_WORLD_SIZE`` (global ranks numbered node by node, as torchrun does); unset, every rank is
taken for one node and the gathers stay flat. A group is gathered so only when every one of the world's ZeRO groups
has the same k > 1 ranks in each of its p/k > 1 nodes, its members node by node in member order (the row-major
mesh's layout); else flat. The decision is made from the whole mesh's table of global ranks, the same on every rank,
and every rank creates every subgroup in the same order (``new_group``'s rule); a subgroup that is one of the ZeRO
axes' own groups (a two-axis ZeRO group whose outer axis crosses nodes and inner stays inside one) is that group, not
a new one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from autopar.errors import ConfigError
from autopar.runtime.comm.context import Comm


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two groups of a hierarchical ZeRO gather: ``inter`` (its local index's ranks, one per node,
    ``nodes`` of them) and ``intra`` (its node's ``per_node`` ranks of the group)."""

    inter: object
    intra: object
    nodes: int
    per_node: int

    def gathered_rows(self, gathered: torch.Tensor, width: int) -> torch.Tensor:
        """The intra-node gather's output (rows ordered local index, node) as (node, local index, width): member
        order, a view."""
        return gathered.view(self.per_node, self.nodes, width).transpose(0, 1)

    def scatter_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A (members, width) gradient in member order, permuted to (local index, node) for the intra-node
        reduce-scatter (contiguous, flat)."""
        return rows.view(self.nodes, self.per_node, -1).transpose(0, 1).reshape(-1)


def ranks_per_node(option: int | None) -> int | None:
    """The ranks each node runs: ``option`` (``RuntimeOptions.ranks_per_node``), else torchrun's
    ``LOCAL_WORLD_SIZE``; None when neither says (one node)."""
    value = option if option is not None else os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        source = "RuntimeOptions.ranks_per_node" if option is not None else "LOCAL_WORLD_SIZE"
        raise ConfigError(f"{source} is {value!r}: give the number of ranks each node runs (an integer >= 1)")
    return n


def node_groups(comm: Comm, zero_axes: tuple[str, ...], per_node_ranks: int | None, mesh=None) -> NodeGroups | None:
    """This rank's ``NodeGroups`` of the ZeRO group over ``zero_axes`` when it is gathered hierarchically (module
    doc), else None. ``mesh``: the DeviceMesh (its table of global ranks; None: row-major over ``comm``'s axes, the
    rank simulator's layout). A collective: every rank calls it, with the same arguments."""
    p = math.prod(comm.sizes[a] for a in zero_axes)
    if per_node_ranks is None or p <= 1:
        return None
    names = list(comm.sizes)
    table = _rank_table(comm, mesh)
    zdims = [names.index(a) for a in zero_axes]
    rest = [i for i in range(len(names)) if i not in zdims]
    groups = table.permute(rest + zdims).reshape(-1, p)  # one ZeRO group per row, members in slice order
    k = _per_node(groups, per_node_ranks)
    if k is None:
        return None
    nodes = p // k
    axis_groups = {}  # member list -> the ZeRO axis whose own group it is
    for a in zero_axes:
        d = names.index(a)
        for members in table.movedim(d, -1).reshape(-1, comm.sizes[a]).tolist():
            axis_groups[tuple(members)] = a
    me = comm.rank if mesh is None else int(mesh.get_rank())
    mine: dict[str, object] = {}
    for row in groups.view(-1, nodes, k):
        for kind, lists in (("inter", row.t().tolist()), ("intra", row.tolist())):
            for members in lists:
                a = axis_groups.get(tuple(members))
                g = comm.groups[a] if a is not None and me in members else None
                if a is None:
                    g = comm.peers.new_group(members)
                if me in members:
                    mine[kind] = g
    return NodeGroups(mine["inter"], mine["intra"], nodes, k)


def _rank_table(comm: Comm, mesh) -> torch.Tensor:
    """Global rank at each mesh coordinate (axes as ``comm``'s)."""
    sizes = list(comm.sizes.values())
    if mesh is None:
        return torch.arange(math.prod(sizes)).reshape(sizes)
    return torch.as_tensor(mesh.mesh).reshape(sizes).to(torch.long)


def _per_node(groups: torch.Tensor, per_node_ranks: int) -> int | None:
    """k when every ZeRO group (a row of global ranks) holds k ranks in each of its nodes, node by node in member
    order, with k > 1 and more than one node; else None (flat)."""
    p = groups.shape[1]
    node = groups // per_node_ranks
    k = int((node[0] == node[0, 0]).sum())
    if k <= 1 or k >= p or p % k:
        return None
    blocks = node.view(node.shape[0], p // k, k)
    same_in_block = bool((blocks == blocks[..., :1]).all())
    firsts = blocks[..., 0]
    distinct = all(len(set(r)) == len(r) for r in firsts.tolist())
    return k if same_in_block and distinct else None


__all__ = ["NodeGroups", "node_groups", "ranks_per_node"]
