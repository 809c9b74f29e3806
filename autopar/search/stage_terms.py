"""Per-stage terms of a whole-plan candidate: the pipeline cut, each stage's compute and communication seconds.

With micro-batch b and the cluster's alpha-beta links (``StageTerms``, the base of ``price.Analytic``):

- stages: the units [pre, layer 0..L-1, post] cut into S = pp * v (or 2 pp W) contiguous stages
  (``stage_layout.py``: balanced FLOPs, per rank for a V of one wave, or Megatron's L / S layers each);
- compute seconds per microbatch: forward = the unit's ops priced by the one compute model
  (``solver/cluster/compute.py``: each op's class and shape at micro-batch b, divided over tp where Megatron's
  layout splits it, ``Profile`` units' ``works``), as the sharding ILP and the stage balancer price them; backward
  twice that (``compute.backward_seconds``; unfused attention's softmax and dropout move the scores 5 times
  backward, 4 forward), recomputation one forward of the recomputed layers (with its tensor-parallel all-reduces);
  of the backward, the weight gradients (a zero-bubble schedule's W) are the weight matmuls' FLOPs
  once more, 2 x sequence x matrix parameters per sample (capped at the unit's FLOPs: a lookup), and
  all of the first stage's (it has no input gradient to compute: its input is data);
- communication (``comm_time.py``): tensor-parallel all-reduces (with Megatron's sequence parallelism,
  ``Candidate.sp``, each a reduce-scatter and an all-gather: ``tp_seconds``) and pipeline transfers; ZeRO-3's
  weight gathers and gradient scatters are priced into every stage's forward, backward and recomputation;
  with expert parallelism (``Candidate.ep``) each expert op's all-to-alls and the busiest expert rank's extra
  work (``expert_seconds``), and each rank holds 1/ep of the expert tables;
- per stage also: the activations a microbatch keeps (with unfused attention its s x s scores too; with sequence
  parallelism every one of them split over tp, the norms', residuals' and dropouts' along the sequence), what full
  recomputation saves of them, the largest layer's activations, the parameters, and when microbatch 0 reaches
  the stage and the last gradient leaves it (for the step-time bound).

What is estimated rather than exact: the device table's efficiency curves (their sources are in the
tables), and a weight gradient's efficiency is its forward matmul's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict
from fractions import Fraction
from typing import Any

from autopar.errors import SearchError
from autopar.schedule.generators import stage_aware_ratios
from autopar.schedule.placement import stage_ranks
from autopar.search.comm_time import CommTime
from autopar.search.profile import Profile, UnitCost
from autopar.search.space import ALPHA_GRID, ZERO_BUBBLE, Candidate
from autopar.search.stage_layout import Layout, balanced_layout, even_layout, kept_v_layout
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.experts import DEFAULT_IMBALANCE, busiest_rows


class StageTerms:
    """Per-stage terms of the candidates for one profile, cluster, global batch and training setup."""

    def __init__(
        self,
        profile: Profile,
        cluster: ClusterSpec,
        global_batch: int,
        precision: str = "bf16",
        optimizer: str = "adam",
        efficiency: float | None = None,
        scatter_gather: bool = True,
        attention: str = "fused",
        router_imbalance: float = DEFAULT_IMBALANCE,
        compiled: bool = False,
        capacity_factor: float | None = None,
    ):
        self.p, self.cluster, self.B = profile, cluster, global_batch
        # the busiest expert rank's rows over the mean, capped at the capacity factor's times the mean where there
        # is one (solver/sharding/experts.py:busiest_rows; the grouped_mm kernel's capacity, priced for every kernel)
        self.router_imbalance, self.capacity_factor = router_imbalance, capacity_factor
        # the plan runs under torch.compile (torch_compile=True): each unit's ops priced as the compiled run fuses
        # them (``UnitCost.compiled_works``, compute.compiled_shares), as the sharding ILP and the stage balancer do
        self.compiled = compiled
        self.precision, self.optimizer, self.efficiency = precision, optimizer, efficiency
        self.scatter_gather = scatter_gather
        self.dtype = precision
        self.device = compute.device_of(cluster, efficiency)
        # how attention runs (solver/cluster/compute.py): "fused" (FlashAttention, PyTorch's sdpa on a GPU) or
        # "unfused" (the scores materialized: Megatron-LM of 2021)
        if attention not in ("fused", "unfused"):
            raise SearchError(f"attention must be 'fused' or 'unfused', not {attention!r}")
        self.attention = attention
        self._unit_secs: dict[tuple, tuple[float, float]] = {}
        self._secs_pre: dict[tuple[int, int], dict[str, list[float]]] = {}
        self.act_scale = 1.0 if precision == "fp32" else 2.0 / profile.itemsize
        self.weight_b, self.grad_b, self.state_b = TrainingSetup(optimizer, precision).bytes_per_param
        self.copy_b = TrainingSetup(optimizer, precision).copy_bytes
        self.comm = CommTime(cluster, self.weight_b, self.grad_b, scatter_gather)
        # ZeRO-0's bucketed all-reduce overlaps the last backward where collectives run beside compute (NCCL),
        # ZeRO-1's reduce-scatter waits for the optimizer step: ZeRO-1 dominates ZeRO-0 only where neither overlaps
        # and its reduce-scatter is one (not gloo's all-reduce)
        self.zero0_dominated = cluster.runs_as("reduce_scatter") == "reduce_scatter" and not cluster.overlaps_compute
        units = profile.units
        self.n = len(units)
        rows = _augment(units, profile.seq)  # a parameter read by several units (a tied embedding) counts in each
        # unfused attention keeps its m x n scores for the backward (compute.unfused_saved_bytes per element; fused
        # attention keeps none): per unit, those bytes per sample, split over tp (the heads are)
        keep = compute.unfused_saved_bytes(precision) if attention == "unfused" else 0.0
        self._scores = [keep * sum(w[3] * w[4] for w in u.works if w[0] == "attention") for u in units]
        for r, sc, u in zip(rows, self._scores, units):
            r["scores"] = sc
            r["lscores"] = sc if u.kind == "layer" else 0.0
        self._rows = rows
        self._pre = {k: _prefix([r[k] for r in rows]) for k in _SUMMED}
        self._is_layer = [u.kind == "layer" for u in units]
        self._max_layer_act: dict[tuple, float] = {}
        self._sp_pre: dict[tuple[float, int, bool], dict[str, list[float]]] = {}
        self._bases: dict[tuple, Any] = {}
        self._fractions: dict[tuple, tuple[float, ...]] = {}

    # -- compute (solver/cluster/compute.py) -------------------------------------------------------------
    def flop_seconds(self, flops: float) -> float:
        """Forward seconds of ``flops`` of matmul work of unknown shape (the saturated efficiency)."""
        return compute.flop_seconds(flops, self.device, self.dtype)

    def _works(self, u: UnitCost) -> tuple:
        if self.compiled and u.compiled_works:
            return u.compiled_works
        if u.works:
            return u.works
        # a unit without its ops (a hand-made profile): its FLOPs as matmul work of unknown shape
        return (
            ("matmul", u.flops_tp, 0.0, 0.0, 0, 0, 0, True),
            ("matmul", u.flops - u.flops_tp, 0.0, 0.0, 0, 0, 0, False),
        )

    def unit_seconds(self, u: UnitCost, b: int, tp: int) -> tuple[float, float, float]:
        """(forward seconds, the tp-split matmuls' weight-gradient seconds, backward seconds) of unit ``u`` at
        micro-batch ``b`` and tensor-parallel degree ``tp``: each of its works at b samples, divided over tp where
        Megatron's layout splits it, priced by ``compute.seconds`` (forward), ``compute.weight_grad_seconds`` and
        ``compute.backward_seconds``."""
        works = self._works(u)
        key = (works, b, tp)
        found = self._unit_secs.get(key)
        if found is None:
            total = tp_mm = bwd = 0.0
            scale = compute.ITEMSIZE.get(self.dtype, 4) / 4 * b  # the profile's bytes are at 4 per float
            for kind, fl, nb, m, n, k, ops, split, *rest in works:  # rest: share of its kernel, rate classes
                kind = "attention_unfused" if kind == "attention" and self.attention == "unfused" else kind
                rows = max(1, round(m * b)) if m else 0
                w = compute.Work(kind, fl * b, nb * scale, rows, n, k, self.dtype, ops, *rest)
                w = w.split(tp if split else 1)
                t = compute.seconds(w, self.device)
                total += t
                bwd += compute.backward_seconds(w, self.device)
                if split and kind == "matmul":
                    tp_mm += compute.weight_grad_seconds(w, self.device)
            found = self._unit_secs[key] = (total, tp_mm, bwd)
        return found

    def _sec(self, key: str, a: int, e: int, b: int, tp: int) -> float:
        """Sum over units ``a..e`` of ``unit_seconds`` at (b, tp): ``fwd`` (all), ``lfwd`` (layers only), ``bwd``
        (the backward), ``wgrad`` (the weight gradients), from prefix sums per (b, tp)."""
        pre = self._secs_pre.get((b, tp))
        if pre is None:
            rows = [self.unit_seconds(u, b, tp) for u in self.p.units]
            pre = self._secs_pre[(b, tp)] = {
                "fwd": _prefix([r[0] for r in rows]),
                "lfwd": _prefix([r[0] if lay else 0.0 for r, lay in zip(rows, self._is_layer)]),
                "bwd": _prefix([r[2] for r in rows]),
                "wgrad": _prefix(
                    [r[1] * (w["wflops"] / w["flops_tp"] if w["flops_tp"] else 0.0) for r, w in zip(rows, self._rows)]
                ),
            }
        p = pre[key]
        return p[e] - p[a]

    # -- layouts (stage_layout.py) ----------------------------------------------------------------
    @functools.cache  # noqa: B019 - one Analytic per search
    def balanced_layout(self, stages: int) -> Layout | None:
        return balanced_layout([u.flops for u in self.p.units], stages)

    @functools.cache  # noqa: B019
    def even_layout(self, stages: int) -> Layout | None:
        return even_layout(self._is_layer, stages)

    @functools.cache  # noqa: B019
    def balanced_v_layout(self, pp: int) -> Layout | None:
        return kept_v_layout([u.flops for u in self.p.units], pp)

    def layout(self, c: Candidate) -> tuple[tuple[int, int], ...] | None:
        """Megatron's even layout, or the balanced one: per rank for a V (a rank's two chunks together)."""
        if c.layout == "even":
            return self.even_layout(c.num_stages)
        if c.waves == 1 and c.pp > 1:
            return self.balanced_v_layout(c.pp)
        return self.balanced_layout(c.num_stages)

    # -- pieces -----------------------------------------------------------------------------------
    def _sum(self, key: str, a: int, b: int) -> float:
        pre = self._pre[key]
        return pre[b] - pre[a]

    def max_layer_act(self, a: int, b: int, tp: int, cp: int = 1, form: str = "all-gather", sp: bool = False) -> float:
        """The largest layer's saved bytes per sample among units ``a..b`` on a rank (``rank_act``)."""
        key = (a, b, tp, cp, form, sp)
        if key not in self._max_layer_act:
            sa = self.act_scale
            self._max_layer_act[key] = max(
                (
                    self.rank_act(u, tp, cp, form, sp) + sc / tp / cp / sa
                    for u, sc, x in zip(self.p.units[a:b], self._scores[a:b], self._is_layer[a:b])
                    if x
                ),
                default=0.0,
            )
        return self._max_layer_act[key]

    @staticmethod
    def rank_act(u: UnitCost, tp: int, cp: int = 1, form: str = "all-gather", sp: bool = False) -> float:
        """Bytes per sample unit ``u`` saves on one rank: 1/tp of what Megatron splits (with sequence parallelism,
        ``sp``, 1/tp of all of it: what tensor parallelism alone replicates is split along the sequence), and with
        context parallelism 1/cp of it; in the all-gather form but the keys and values its attention reads, which
        each cp rank keeps whole (ring attention keeps its own blocks, Ulysses its heads of the whole sequence:
        1/cp)."""
        act = (u.act_tp + u.act_rep) / tp if sp else u.act(tp)
        if form in ("ring", "ulysses"):
            return act / cp
        return act / cp + u.kv(tp) * (1 - 1 / cp)

    def cp_seconds(self, a: int, e: int, b: int, c: Candidate, layers_only: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of units ``a..e``'s context-parallel communication per microbatch of ``b``
        samples, in the candidate's form (``Candidate.cp_form``; ``layers_only``: the layers', what a recomputation
        runs again). Per attention, K and V the bytes of the keys and values it reads on a rank (``UnitCost.kv``,
        1/cp of them), Q its queries', n = cp:

        - all-gather: K and V all-gathered forward (from the smallest tensor of their chain,
          ``UnitCost.kv_gather_*``), their partial gradients reduce-scattered backward (the gather's adjoint,
          ``passes/collectives.reduce_scatter_gathered_grads``); not overlapped;
        - ring: ``n - 1`` steps forward each sending the rank's K + V block to the next rank, each beside one
          block of attention (the rank's attention forward / n): exposed ``max(0, send - block)`` per step where
          the backend overlaps (NCCL), the whole send on gloo; backward ``n - 1`` such steps beside twice the block,
          and ``n - 1`` hops of the blocks' gradient accumulators (in at least fp32), each but the last beside the next
          step's backward block (exposed as the steps are); the causal load
          balancing's exchange of half the queries and half the output forward, their gradients backward
          (``CostModel.ring_price``, the ILP's price of the same; the search assumes causal attention);
        - ulysses: the queries, keys and values all-to-all'd from the sequence to the heads and the output back,
          forward (Q + K + V + Q bytes, the output as large as the queries), and the same backward."""
        if c.cp <= 1:
            return 0.0, 0.0
        n = c.cp
        intra, k = self.comm.intra(c.tp * n), self.comm.per_node(n, c.tp)
        sa = self.act_scale * b
        fwd = bwd = 0.0
        for u, lay in zip(self.p.units[a:e], self._is_layer[a:e]):
            if not u.kv_count or (layers_only and not lay):
                continue
            if c.cp_form == "ring":
                f, g = self._ring_seconds(u, b, c)
            elif c.cp_form == "ulysses":
                calls = max(u.attentions, 1)
                moved = [u.q(c.tp) / calls] * (2 * calls) + [u.kv(c.tp) / u.kv_count] * u.kv_count  # per sample
                f = g = sum(self.cluster.collective_seconds("all_to_all", x * sa / n, n, intra, k) for x in moved if x)
            else:
                one = (u.kv_gather_tp / c.tp + u.kv_gather_rep) * sa / u.kv_count
                f = u.kv_count * self.comm.gather(one, n, intra, k)
                g = u.kv_count * self.comm.scatter(one, n, intra, k)
            fwd, bwd = fwd + f, bwd + g
        return fwd, bwd

    def _ring_seconds(self, u: UnitCost, b: int, c: Candidate) -> tuple[float, float]:
        """(forward, backward) seconds of unit ``u``'s ring attention per microbatch of ``b`` samples
        (``cp_seconds``), its calls alike (the unit's queries, keys, values and FLOPs split evenly among them)."""
        n, calls = c.cp, max(u.attentions, 1)
        sa = self.act_scale * b
        intra = self.comm.intra(c.tp * n)

        def send(nbytes: float) -> float:
            return self.cluster.collective_seconds("send", nbytes, 1, intra) if nbytes > 0 else 0.0

        kv = u.kv(c.tp) * sa / n / calls  # one call's K + V block on a rank
        item = self.act_scale * self.p.itemsize  # bytes per element at the training precision
        acc = kv * max(item, 4) / item  # the gradient accumulators, in at least fp32
        block = self.flop_seconds(u.attn_flops * b / n / c.tp / calls) / n  # one step's forward block on a rank
        overlap = self.cluster.overlaps_compute
        exposed = (lambda t, w: max(0.0, t - w)) if overlap else (lambda t, w: t)
        step = send(kv)
        fwd = (n - 1) * exposed(step, block)
        bwd = (n - 1) * exposed(step, 2 * block) + (n - 2) * exposed(send(acc), 2 * block) + send(acc)
        leaving = max(sum(1 for p in (2 * r, 2 * r + 1) if (p if p < n else 2 * n - 1 - p) != r) for r in range(n)) / 2
        q = u.q(c.tp) * sa / n / calls * leaving
        fwd += 2 * send(q)  # half the queries there, half the output back (the output as large as the queries)
        bwd += 2 * send(q)
        return calls * fwd, calls * bwd

    def tp_seconds(self, a: int, e: int, b: float, tp: int, sp: bool = False, split: bool = False) -> tuple[float, ...]:
        """(forward, backward, recomputation) seconds of units ``a..e``'s tensor-parallel collectives per microbatch
        of ``b`` samples on a rank (b / cp with context parallelism); ``split``: a zero-bubble schedule's split
        backward, which computes the weight gradients later (nothing runs beside the backward's collectives).

        Without sequence parallelism, Megatron's all-reduces: each g (a row-parallel or vocabulary-parallel output)
        in the forward and the recomputation, each f (a column-parallel input's gradient) in the backward, less what
        runs beside its readers' weight gradients (``hidden_ar_bwd``).

        With it (``sp``: Korthikanti et al. 2022, section 4.2.2), each g is a reduce-scatter onto the rank's part of
        the sequence in the forward and an all-gather of its gradient in the backward, each f an all-gather of the
        sequence in the forward and a reduce-scatter of its gradient in the backward (``_sp_unit``): a ring moves the
        same bytes (an all-reduce is a reduce-scatter and an all-gather; ``tests/test_search_sp.py``). The backward
        also gathers each f's input again (only its sequence shard is saved) for the weight gradients; as Megatron
        runs it (``LinearWithGradAccumulationAndAsyncCommunication``), that all-gather runs beside the input
        gradient's matmul and the reduce-scatter beside the weight gradients, where the backend overlaps (NCCL; not
        with a split backward)."""
        if not sp or tp <= 1:
            sa = self.act_scale * b
            fwd = self._tp_allreduce("ar_fwd", a, e, sa, tp)
            bwd = self._tp_allreduce("ar_bwd", a, e, sa, tp) - (0.0 if split else self.hidden_ar_bwd(a, e, b, tp))
            return fwd, bwd, self._tp_allreduce("lar_fwd", a, e, sa, tp)
        key = (b, tp, split)
        pre = self._sp_pre.get(key)
        if pre is None:
            rows = [self._sp_unit(u.ar_bwd_groups, u.ar_fwd_bytes, u.ar_fwd_count, b, tp, split) for u in self.p.units]
            pre = self._sp_pre[key] = {
                "fwd": _prefix([r[0] for r in rows]),
                "bwd": _prefix([r[1] for r in rows]),
                "lfwd": _prefix([r[0] if lay else 0.0 for r, lay in zip(rows, self._is_layer)]),
            }
        return tuple(pre[k][e] - pre[k][a] for k in ("fwd", "bwd", "lfwd"))

    @functools.cache  # noqa: B019 - one Analytic per search; repeated layers share their collectives
    def _sp_unit(
        self, groups: tuple[tuple[float, float], ...], g_bytes: float, g_count: int, b: float, tp: int, split: bool
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one unit's sequence-parallel collectives (``tp_seconds``): its f's
        (``groups``: per f, its bytes and its readers' forward FLOPs per sample) and its ``g_count`` g's of
        ``g_bytes`` together (per sample), at ``b`` samples."""
        sa, intra, k = self.act_scale * b, self.comm.intra(tp), self.comm.per_node(tp, 1)
        g_each = g_bytes / g_count * sa if g_count else 0.0
        fwd = g_count * self.comm.scatter(g_each, tp, intra, k)
        bwd = g_count * self.comm.gather(g_each, tp, intra, k)
        beside = self.cluster.overlaps_compute and not split
        for nb, fl in groups:
            gather, scatter = self.comm.gather(nb * sa, tp, intra, k), self.comm.scatter(nb * sa, tp, intra, k)
            fwd += gather
            matmul = self.flop_seconds(b * fl / tp) if beside else 0.0  # the input gradient's, the weights' alike
            bwd += max(0.0, gather - matmul) + max(0.0, scatter - matmul)
        return fwd, bwd

    def _tp_allreduce(self, key: str, a: int, e: int, scale: float, tp: int) -> float:
        nbytes, count = self._sum(key + "_bytes", a, e) * scale, int(self._sum(key + "_count", a, e))
        return self.comm.allreduce(nbytes, count, tp, self.comm.intra(tp), self.comm.per_node(tp, 1))

    def hidden_ar_bwd(self, a: int, e: int, b: int, tp: int) -> float:
        """Seconds of units ``a..e``'s backward tensor-parallel all-reduces (Megatron's f) that run while the
        weight gradients of the matmuls reading each f are computed (``runtime/comm/column_linear.py``): per f, the
        smaller of its all-reduce and those weight gradients, at micro-batch ``b``; none where the backend's
        collectives do not run beside compute (gloo: ``ClusterSpec.overlaps_compute``)."""
        return sum(self._unit_hidden(self.p.units[i].ar_bwd_groups, b, tp) for i in range(a, e))

    @functools.cache  # noqa: B019 - one Analytic per search; repeated layers share their groups
    def _unit_hidden(self, groups: tuple[tuple[float, float], ...], b: int, tp: int) -> float:
        if tp <= 1 or not self.cluster.overlaps_compute:
            return 0.0
        sa, intra, k = self.act_scale * b, self.comm.intra(tp), self.comm.per_node(tp, 1)
        return sum(
            min(self.comm.allreduce(nb * sa, 1, tp, intra, k), self.flop_seconds(b * fl / tp)) for nb, fl in groups
        )

    def stage_ranks(self, c: Candidate) -> tuple[int, ...]:
        return tuple(stage_ranks(c.pp, c.chunks, c.waves))

    def recompute_fractions(self, c: Candidate) -> tuple[float, ...]:
        """Fraction of each stage's layers recomputed (per rank for SCP: 1 - alpha_i)."""
        return self.fractions(c.num_stages, c.recompute, c.alpha1)

    def fractions(self, S: int, recompute: str, alpha1: int) -> tuple[float, ...]:
        """``recompute_fractions`` of ``S`` stages under ``recompute`` (stage-aware: alpha_1 = ``alpha1`` / 20)."""
        if recompute == "none":
            return (0.0,) * S
        if recompute == "full":
            return (1.0,) * S
        key = (S, alpha1)
        if key not in self._fractions:
            alpha = Fraction(alpha1, ALPHA_GRID)
            self._fractions[key] = tuple(float(1 - a) for a in stage_aware_ratios(S, alpha))
        return self._fractions[key]

    def _base(self, c: Candidate, z3: int):
        """What does not depend on recomputation: stage times (``tr`` = recomputing all of a stage's
        layers), boundary transfers, activations and the bytes full recomputation saves, per stage;
        with ZeRO-3 over ``z3`` ranks, those without it plus its gathers (``_zero3``)."""
        key = (c.pp, c.dp, c.cp, c.tp, c.micro_batch, c.schedule, c.chunks, c.waves, c.layout, z3, c.ep, c.cp_form,
               c.sp)  # fmt: skip
        if key in self._bases:
            return self._bases[key]
        if z3:
            plain = self._base(c, 0)
            self._bases[key] = None if plain is None else self._zero3(c, z3, plain)
            return self._bases[key]
        stages = self.layout(c)
        if stages is None:
            self._bases[key] = None
            return None
        b, tp, cp = c.micro_batch, c.tp, c.cp
        ranks = self.stage_ranks(c)
        # with context parallelism a rank computes b / cp samples' worth of every op (each sequence split over cp)
        bt = b / cp
        sa = self.act_scale * bt  # activation bytes per sample -> per microbatch and rank at training precision
        tf, tb, tr, tw, acts, saving, layer_act, params_of, wkept = [], [], [], [], [], [], [], [], []
        experts_of = []
        S = self._sum
        for a, e in stages:
            fwd, bwd, rfwd = self.stage_compute(a, e, b, tp, cp, c.ep, c.schedule in ZERO_BUBBLE, c.sp)
            params, experts = self.stage_params(a, e, tp, c.ep)
            experts_of.append(experts)
            cp_f, cp_b = self.cp_seconds(a, e, b, c)
            tf.append(fwd + cp_f)
            tb.append(bwd + cp_b)
            tr.append(rfwd + self.cp_seconds(a, e, b, c, True)[0])
            tw.append(self._sec("wgrad", a, e, bt, tp))
            kept, saves = self.stage_acts(a, e, b, tp, cp, c.cp_form, c.sp)
            acts.append(kept)
            saving.append(saves)
            rep = 1 / tp if c.sp else 1.0  # sequence parallelism: what tp replicates is split along the sequence
            wkept.append((S("wgrad_tp", a, e) / tp + S("wgrad_rep", a, e) * rep) * sa)
            layer_act.append(self.max_layer_act(a, e, tp, cp, c.cp_form or "all-gather", c.sp) * self.act_scale * b)
            params_of.append(params)
        tw[0] = tb[0]  # the first stage's input is data: its whole backward is weight gradients
        tc = tuple(
            self.comm.p2p(c, ranks[s], ranks[s + 1], self.p.units[stages[s + 1][0]].input_bytes * sa)
            for s in range(len(stages) - 1)
        )
        mine: list[list[int]] = [[] for _ in range(c.pp)]
        for s, r in enumerate(ranks):
            mine[r].append(s)
        head, tail = _head_tail(tf, tb, tc)
        base = (
            stages,
            ranks,
            tuple(tf),
            tuple(tb),
            tuple(tr),
            tc,
            tuple(tw),
            acts,
            saving,
            layer_act,
            params_of,
            [0.0] * len(stages),  # bytes of weights gathered while the stage runs (ZeRO-3)
            mine,
            head,
            tail,
            tuple(wkept),
            experts_of,
        )
        self._bases[key] = base
        return base

    def stage_compute(
        self, a: int, e: int, b: int, tp: int, cp: int, ep: int, split: bool, sp: bool = False
    ) -> tuple[float, float, float]:
        """(forward, backward, recomputation) seconds of units ``a..e`` per microbatch of ``b`` samples on a rank,
        without the context-parallel collectives, pipeline transfers and ZeRO-3 gathers: their compute (b / cp
        samples' worth with context parallelism), tensor-parallel collectives (``tp_seconds``: Megatron's all-reduces,
        f's backward less what runs beside its readers' weight gradients unless the backward is ``split``: zero
        bubble; with sequence parallelism, ``sp``, reduce-scatters and all-gathers) and, with expert parallelism
        (cp = 1 beside it), the all-to-alls and the busiest rank's extra expert work (twice that backward).
        Recomputation touches the layers only (embeddings and head keep their activations)."""
        bt = b / cp
        moe = self.expert_seconds(a, e, b, ep, tp)
        tp_f, tp_b, tp_r = self.tp_seconds(a, e, bt, tp, sp, split)
        fwd = self._sec("fwd", a, e, bt, tp) + moe + tp_f
        bwd = self._sec("bwd", a, e, bt, tp) + 2 * moe + tp_b
        rfwd = self._sec("lfwd", a, e, bt, tp) + moe + tp_r
        return fwd, bwd, rfwd

    def stage_params(self, a: int, e: int, tp: int, ep: int) -> tuple[float, float]:
        """(parameter elements units ``a..e`` hold on a rank, of which expert tables'): 1/tp of what Megatron splits,
        the expert tables 1/ep more."""
        S = self._sum
        experts = S("params_ep", a, e) / tp / ep
        return S("params_tp", a, e) / tp + S("params_rep", a, e) - S("params_ep", a, e) / tp + experts, experts

    def stage_acts(
        self, a: int, e: int, b: int, tp: int, cp: int, form: str = "", sp: bool = False
    ) -> tuple[float, float]:
        """(bytes a microbatch of ``b`` samples keeps on a rank for units ``a..e`` without recomputation, bytes full
        recomputation saves of them): 1/tp of what Megatron splits, and with sequence parallelism (``sp``) 1/tp of
        what it replicates too (the norms', residuals' and dropouts', and each layer's input that full recomputation
        keeps: Korthikanti et al.'s s b h (34 / t + 5 a s / (h t)) per layer in place of s b h (10 + 24 / t +
        5 a s / (h t))); with context parallelism 1/cp, but in the all-gather form (``form``, ``Candidate.cp_form``)
        the keys and values whole; with unfused attention its scores (a cp rank's 1/cp of the queries)."""
        S, bt = self._sum, b / cp
        sa = self.act_scale * bt
        rep = 1 / tp if sp else 1.0
        # ... of the keys and values each cp rank keeps whole (the all-gather form)
        kv_whole = self.act_scale * b * (1 - 1 / cp) if form not in ("ring", "ulysses") else 0.0
        kept = (
            (S("act_tp", a, e) / tp + S("act_rep", a, e) * rep) * sa
            + (S("kv_tp", a, e) / tp + S("kv_rep", a, e)) * kv_whole
            + S("scores", a, e) / tp * bt
        )
        lacts = (S("lact_tp", a, e) / tp + S("lact_rep", a, e) * rep) * sa + S("lscores", a, e) / tp * bt
        lacts += (S("lkv_tp", a, e) / tp + S("lkv_rep", a, e)) * kv_whole
        return kept, lacts - S("linput_bytes", a, e) * sa * rep

    def expert_seconds(self, a: int, e: int, b: int, ep: int, tp: int) -> float:
        """Forward seconds a microbatch of ``b`` samples adds to units ``a..e`` under expert parallelism over ``ep``
        ranks (0 without): each expert op's all-to-alls (its rows sent to their experts' ranks at K and back at
        N, ``UnitCost.routed``) at the busiest rank's rows, ``busiest_rows`` under the router's imbalance and the
        capacity factor, of which (ep-1)/ep cross the links (rows in token order, a dispatcher's; the runtime's
        globally sorted blocks cross less, ``solver/sharding/experts.py``), over the ep group (ranks tp apart); and
        the busiest rank's
        expert FLOPs beyond the mean. The backward runs the inverse all-to-alls and twice the FLOPs: the caller's
        2 x forward."""
        if ep <= 1:
            return 0.0
        intra, k = self.comm.intra(tp * ep), self.comm.per_node(ep, tp)
        sa = self.act_scale * b
        total = 0.0
        for u in self.p.units[a:e]:
            for rows, width, calls in u.routed:
                local = rows * b
                busiest = busiest_rows(round(local * ep), ep, self.router_imbalance, self.capacity_factor)
                nbytes = busiest * width * sa / tp / calls  # each call's rows, at the widths tp leaves a rank
                total += calls * self.cluster.collective_seconds("all_to_all", nbytes, ep, intra, k)
            if u.expert_flops and u.routed:
                rows = u.routed[0][0] * b
                load = busiest_rows(round(rows * ep), ep, self.router_imbalance, self.capacity_factor) / rows
                total += (load - 1) * self.flop_seconds(u.expert_flops * b / tp)
        return total

    def _zero3(self, c: Candidate, z3: int, base: tuple) -> tuple:
        """``base`` under ZeRO-3 over ``z3`` ranks, as ``runtime/grads/zero3.py`` runs it: one all-gather per unit
        (hierarchical across nodes where it pays: ``CommTime.unit_gather``; the stage's embedding/head units, each
        layer) in every
        forward and backward, and per layer in every
        recomputation, one reduce-scatter per unit in every backward (with MiCS an all-reduce of the shard across
        the groups); a split backward (zero-bubble) gathers again in its W, which does the scatters. Where the
        backend runs collectives beside compute (NCCL: ``ClusterSpec.overlaps_compute``) the gather of the next
        unit is issued before a unit computes (the runtime's prefetch) and the reduce-scatters run asynchronously,
        so a pass exposes only what its collectives take beyond the compute they run beside (``_prefetched``);
        on gloo every collective waits for the compute.

        Memory: no whole copy of the weights. While a stage runs it holds whole its non-layer units and two
        layers (the one computing, the next arriving). In mixed precision a unit is cast when it starts computing
        and its fp32 weights freed (``runtime/grads/unit_gathers.py``): the forward holds the non-layer units'
        copies (a tied head's, the final norm's are read last), the layer computing in fp32 and its copy, the
        next in fp32; the backward starts with the non-layer units in fp32 and their copies beside a layer
        arriving (``solver/sharding/memory.py:zero3_gathered``, the most of the two). A stashed microbatch keeps
        none of the copies: autograd saves them as tokens, cast again from the unit gathered again in the
        backward (``runtime/grads/zero3.py``).
        DualPipeV's unsplit backwards are charged the second gather too (an upper bound)."""
        stages, ranks, tf, tb, tr, tc, tw, acts, saving, layer_act, params, _, mine, _, _, wkept, experts = base
        intra_g, k = self.comm.intra(c.tp * c.cp * z3), self.comm.per_node(z3, c.tp * c.cp)
        split = c.schedule in ZERO_BUBBLE
        overlap = self.cluster.overlaps_compute
        bt = c.micro_batch / c.cp
        gathered, acts, saving = [], list(acts), list(saving)
        tf, tb, tr, tw = list(tf), list(tb), list(tr), list(tw)
        for s, (a, e) in enumerate(stages):
            us = self.p.units[a:e]
            lay = [u.kind == "layer" for u in us]
            elems = [u.params_tp / c.tp + u.params_rep for u in us]
            g = [self.comm.unit_gather(p * self.weight_b, z3, intra_g, k) for p in elems]
            r = [
                self.comm.unit_gather(p * self.grad_b, z3, intra_g, k) + self.comm.mics_hop(p * self.grad_b, c)
                for p in elems
            ]
            secs = [self.unit_seconds(u, bt, c.tp) for u in us]
            fwd, bwd = [x[0] for x in secs], [x[2] for x in secs]
            back = [gi + ri + (gi if split else 0.0) for gi, ri in zip(g, r)]
            lg = [gi for gi, x in zip(g, lay) if x]
            lf = [f for f, x in zip(fwd, lay) if x]
            if overlap:  # the backward and the recomputation run the units last to first
                ef, eb, er = _prefetched(g, fwd), _prefetched(back[::-1], bwd[::-1]), _prefetched(lg[::-1], lf[::-1])
            else:
                ef, eb, er = sum(g), sum(back), sum(lg)
            tf[s] += ef
            tb[s] += eb
            tr[s] += er
            if split:
                tw[s] += sum(gi + ri for gi, ri in zip(g, r))
            layers = sorted((p for x, p in zip(lay, elems) if x), reverse=True)
            held = sum(p for x, p in zip(lay, elems) if not x) + sum(layers[:2])
            if self.copy_b:  # the forward frees a unit's fp32 weights once cast; the backward starts at the head
                top, nonlayer = sum(layers[:1]), sum(p for x, p in zip(lay, elems) if not x)
                w, cb = self.weight_b, self.copy_b
                held_b = max(nonlayer * cb + top * (w + cb) + sum(layers[1:2]) * w, nonlayer * (w + cb) + top * w)
            else:
                held_b = held * self.weight_b
            gathered.append(held_b)
        head_tail = _head_tail(tf, tb, tc)
        return (stages, ranks, tuple(tf), tuple(tb), tuple(tr), tc, tuple(tw), acts, saving, layer_act, params,
                gathered, mine, *head_tail, wkept, experts)  # fmt: skip


def _prefetched(comm: Sequence[float], compute: Sequence[float]) -> float:
    """Seconds a pass over units exposes of their collectives when each unit's collective (its gather, issued
    before the previous unit computes) runs beside the previous unit's compute: the first in full, then each
    beyond the compute it overlaps. ``comm`` and ``compute`` in the order the pass runs the units."""
    if not comm:
        return 0.0
    total = comm[0] + sum(max(cp, cm) for cp, cm in zip(compute, comm[1:])) + compute[-1]
    return max(0.0, total - sum(compute))


_SUMMED = (
    "params_ep",
    "flops",
    "flops_tp",
    "params_tp",
    "params_rep",
    "act_tp",
    "act_rep",
    "ar_fwd_bytes",
    "ar_fwd_count",
    "ar_bwd_bytes",
    "ar_bwd_count",
    "lflops",
    "lflops_tp",
    "lact_tp",
    "lact_rep",
    "linput_bytes",
    "lar_fwd_bytes",
    "lar_fwd_count",
    "wflops",
    "wgrad_tp",
    "wgrad_rep",
    "kv_tp",
    "kv_rep",
    "lkv_tp",
    "lkv_rep",
    "scores",
    "lscores",
)


def _head_tail(tf: Sequence[float], tb: Sequence[float], tc: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per stage: when microbatch 0's forward reaches it, and how long the last gradient takes from it to stage 0."""
    head, tail = [0.0], [0.0]
    for s in range(len(tf) - 1):
        head.append(head[-1] + tf[s] + tc[s])
        tail.append(tail[-1] + tb[s] + tc[s])
    return head, tail


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _augment(units: tuple[UnitCost, ...], seq: int) -> list[dict[str, float]]:
    out = []
    for u in units:
        d = asdict(u)
        d["wflops"] = min(2 * seq * u.params_tp, u.flops_tp)  # weight gradients: the weight matmuls once more
        lay = u.kind == "layer"
        d["lflops"] = u.flops if lay else 0.0
        d["lflops_tp"] = u.flops_tp if lay else 0.0
        d["lact_tp"] = u.act_tp if lay else 0.0
        d["lact_rep"] = u.act_rep if lay else 0.0
        d["linput_bytes"] = u.input_bytes if lay else 0.0
        d["lar_fwd_bytes"] = u.ar_fwd_bytes if lay else 0.0
        d["lar_fwd_count"] = u.ar_fwd_count if lay else 0
        d["lkv_tp"] = u.kv_tp if lay else 0.0
        d["lkv_rep"] = u.kv_rep if lay else 0.0
        out.append(d)
    return out


__all__ = ["StageTerms"]
