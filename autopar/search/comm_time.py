"""Seconds of the collectives a candidate runs: tensor-parallel all-reduces, pipeline transfers, data-parallel sync.

With the cluster's alpha-beta links (intra-node when a group of consecutive ranks stays inside one node;
a group spanning nodes as NCCL runs it, one channel per rank of the group in a node, each leaving the node
once on its own rail: ``ClusterSpec.alpha_beta(per_node=...)``, ``CommTime.per_node``):

- tensor parallel: ring all-reduces over tp (intra-node when tp divides the devices per node, else
  hierarchical rings with min(tp, devices per node) rails); a backward one (Megatron's f) is charged only
  where it outlasts the weight gradients of the matmuls reading it, which the runtime computes while it is in flight
  (``StageTerms.hidden_ar_bwd``, ``runtime/comm/column_linear.py``; not under a zero-bubble schedule, whose
  split backward computes them later, nor on gloo, whose reduction waits for the compute);
- pipeline transfers: the boundary tensor, 1/tp of it over the link with Megatron's scatter/gather
  plus an all-gather over tp (with sequence parallelism each tp rank's part of the sequence, no all-gather);
  intra-node when consecutive stages share a node;
- data parallel, after each rank's last backward (ZeRO-0's buckets overlap that backward on NCCL, as the
  runtime and DDP run them: ``Analytic._overlapped``; Megatron 2021's local DDP did not): ZeRO-0/1 one
  all-reduce (= reduce-scatter + all-gather) of the rank's gradients, ZeRO-0's per bucket of ``BUCKET_BYTES``
  (one latency each, ``solver/sharding/buckets.py``; on gloo, whose reduce-scatter is an all-reduce, ZeRO-1 pays the
  all-reduce and the all-gather); ZeRO-2 one reduce-scatter per
  microbatch (the gradient shard accumulates) plus an all-gather of the weights; ZeRO-3 all-gathers
  the weights in every forward, backward and recomputation and reduce-scatters every backward (priced
  per stage by ``price.py``); MiCS does the same inside groups of g ranks plus a cross-group
  all-reduce of 1/g of the gradients (2-hop synchronization): once per step, after the last backward,
  with ZeRO-1/2; in every backward with ZeRO-3, whose gradient shards are made there (``runtime/grads/zero3.py``).
  ZeRO-3's unit gathers and reduce-scatters over a group spanning nodes run hierarchically, MiCS's way, where the
  cluster says the two steps pay (``unit_gather``: ``ClusterSpec.hierarchical_pays``, the rule the plan's
  ``TrainingSetup.hierarchical_gather`` is decided by; ``runtime/grads/node_gather.py``), else as one flat ring.
"""

from __future__ import annotations

import math

from autopar.search.space import Candidate
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import BUCKET_BYTES


class CommTime:
    """Collective seconds on one cluster, for model states of ``weight_b`` / ``grad_b`` bytes per element."""

    def __init__(self, cluster: ClusterSpec, weight_b: float, grad_b: float, scatter_gather: bool = True):
        self.cluster, self.weight_b, self.grad_b = cluster, weight_b, grad_b
        self.scatter_gather = scatter_gather
        self.dpn = cluster.devices_per_node

    def intra(self, devices: int) -> bool:
        """Whether a group of ``devices`` consecutive ranks (aligned to its size) stays inside one node."""
        return 0 < devices <= self.dpn and self.dpn % devices == 0

    def per_node(self, n: int, stride: int) -> int:
        """Ranks of a group of ``n`` ranks ``stride`` apart (Megatron's layout: tp 1, dp tp) inside one node."""
        if stride >= self.dpn:
            return 1
        return max(1, min(n, self.dpn // stride))

    def allreduce(self, nbytes: float, count: int, n: int, intra: bool, per_node: int = 1) -> float:
        """Seconds of ``count`` ring all-reduces totalling ``nbytes`` over ``n`` ranks (``per_node`` of them in
        each node when the group spans nodes)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        lat, bw = self.cluster.alpha_beta(intra, per_node)
        return 2 * (n - 1) / n * nbytes / bw + count * 2 * (n - 1) * lat

    def gather(self, nbytes: float, n: int, intra: bool, per_node: int = 1) -> float:
        """Seconds of one all-gather of ``nbytes`` (the whole tensor) over n ranks."""
        return self.cluster.collective_seconds("all_gather", nbytes, n, intra, per_node) if n > 1 else 0.0

    def unit_gather(self, nbytes: float, n: int, intra: bool, per_node: int = 1) -> float:
        """Seconds of one ZeRO-3 unit all-gather (or its gradient's reduce-scatter) of ``nbytes`` over n ranks: across
        nodes hierarchically where that pays (``ClusterSpec.hierarchical_pays``), as the plan materialized from the
        candidate runs it (``materialize.shard_options``, ``TrainingSetup.hierarchical_gather``), else the flat ring."""
        if n <= 1:
            return 0.0
        hier = not intra and self.cluster.hierarchical_pays(n, per_node)
        return self.cluster.collective_seconds("all_gather", nbytes, n, intra, per_node, hierarchical=hier)

    def scatter(self, nbytes: float, n: int, intra: bool, per_node: int = 1) -> float:
        """Seconds of one reduce-scatter of ``nbytes`` over n ranks (an all-reduce on gloo: ``ClusterSpec.runs_as``)."""
        return self.cluster.collective_seconds("reduce_scatter", nbytes, n, intra, per_node) if n > 1 else 0.0

    def p2p(self, c: Candidate, r0: int, r1: int, nbytes: float) -> float:
        """One boundary transfer between pipeline ranks r0 and r1 (0 when they are the same rank)."""
        if r0 == r1 or nbytes <= 0:
            return 0.0
        stride = c.dp * c.cp * c.tp  # ranks of consecutive pipeline stages differ by dp * cp * tp
        intra = (r0 * stride) // self.dpn == (r1 * stride) // self.dpn and stride < self.dpn
        if c.sp and c.tp > 1:  # sequence parallelism: each tp rank holds and sends its part of the sequence
            return self.cluster.collective_seconds("send", nbytes / c.tp, 1, intra)
        if self.scatter_gather and c.tp > 1:
            send = self.cluster.collective_seconds("send", nbytes / c.tp, 1, intra)
            return send + self.gather(nbytes, c.tp, self.intra(c.tp), self.per_node(c.tp, 1))
        return self.cluster.collective_seconds("send", nbytes, 1, intra)

    def dp_sync(self, c: Candidate, params: float) -> float:
        """Seconds of one rank's data-parallel gradient synchronization per step (see the module docstring),
        with context parallelism also the all-reduce of the gradients over cp (``cp_sync``)."""
        return self._dp_sync(c, params) + self.cp_sync(c, params)

    def cp_sync(self, c: Candidate, params: float) -> float:
        """The all-reduce over the cp ranks of a rank's gradients (every cp rank computes with every weight of its
        stage on its part of the sequence), in buckets as the runtime's ``grad_sync`` over a second axis runs it
        (``runtime/grads/sync.py``); cp ranks are ``tp`` apart."""
        if c.cp <= 1:
            return 0.0
        grads = params * self.grad_b
        buckets = math.ceil(grads / BUCKET_BYTES)
        return self.allreduce(grads, buckets, c.cp, self.intra(c.tp * c.cp), self.per_node(c.cp, c.tp))

    def _dp_sync(self, c: Candidate, params: float) -> float:
        if c.dp <= 1:
            return 0.0
        g = c.shard_group
        grads, weights = params * self.grad_b, params * self.weight_b
        inner = c.tp * c.cp  # dp ranks are tp * cp apart
        intra_g, k_g = self.intra(inner * g), self.per_node(g, inner)
        intra_all, k = self.intra(inner * c.dp), self.per_node(c.dp, inner)
        if g == c.dp:
            if c.zero == 0 or (c.zero == 1 and self.cluster.runs_as("reduce_scatter") == "reduce_scatter"):
                buckets = math.ceil(grads / BUCKET_BYTES) if c.zero == 0 else 1  # ZeRO-1: reduce-scatter + all-gather
                return self.allreduce(grads, buckets, c.dp, intra_all, k)
            if c.zero <= 2:  # (ZeRO-1 on gloo: an all-reduce for the reduce-scatter, then the all-gather)
                scatters = 1 if c.zero == 1 else c.microbatches
                return scatters * self.scatter(grads, c.dp, intra_all, k) + self.gather(weights, c.dp, intra_all, k)
            return 0.0  # ZeRO-3: every backward scatters its gradients (priced in tb)
        # MiCS: reduce-scatter inside the group, all-reduce of the shard across groups, all-gather in the group
        across = self.mics_hop(grads, c)
        if c.zero <= 1:
            return self.scatter(grads, g, intra_g, k_g) + across + self.gather(weights, g, intra_g, k_g)
        if c.zero == 2:
            return (
                c.microbatches * self.scatter(grads, g, intra_g, k_g) + across + self.gather(weights, g, intra_g, k_g)
            )
        return 0.0  # ZeRO-3: every backward scatters its gradients and all-reduces the shard (priced in tb)

    def mics_hop(self, grad_bytes: float, c: Candidate) -> float:
        """MiCS's second hop: the all-reduce of the 1/g shard of ``grad_bytes`` of gradients across the
        dp / g partition groups (0 without MiCS)."""
        g = c.shard_group
        if g >= c.dp:
            return 0.0
        inner = c.tp * c.cp
        return self.allreduce(
            grad_bytes / g, 1, c.dp // g, self.intra(inner * c.dp), self.per_node(c.dp // g, inner * g)
        )


__all__ = ["CommTime"]
