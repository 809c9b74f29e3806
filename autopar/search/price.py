"""Price one whole-plan candidate without solving anything: per-stage times, per-rank memory, a step-time bound.

Per candidate (``Analytic.evaluate``), with micro-batch b and the cluster's alpha-beta links:

- stages: the units [pre, layer 0..L-1, post] cut into S = pp * v (or 2 pp W) contiguous stages
  (``stage_layout.py``: balanced FLOPs, per rank for a V of one wave, or Megatron's L / S layers each);
- compute seconds per microbatch: forward = FLOPs / (peak * ``solver.cost.EFFICIENCY``), backward
  twice that, recomputation one forward of the recomputed layers (with its tensor-parallel all-reduces);
  of the backward, the weight gradients (a zero-bubble schedule's W) are the weight matmuls' FLOPs
  once more, 2 x sequence x matrix parameters per sample (capped at the unit's FLOPs: a lookup), and
  all of the first stage's (it has no input gradient to compute: its input is data);
- communication (``comm_time.py``): tensor-parallel all-reduces, pipeline transfers and the
  data-parallel gradient synchronization after each rank's last backward under ZeRO / MiCS; ZeRO-3's
  weight gathers and gradient scatters are priced into every stage's forward, backward and recomputation;
- memory per rank: model states (``TrainingSetup.bytes_per_param``, divided as ZeRO/MiCS say) plus
  the stashed activations of the microbatches in flight (closed forms per schedule,
  ``solver/pipeline_shape.inflight_per_rank``; for zero-bubble schedules, read off their action lists:
  a microbatch counts until its W, and from its B on it also holds the output gradients of its weight
  ops, ``UnitCost.wgrad_*``, priced at the worst point of each rank's list)
  plus what a stage holds only while it runs: one recomputed layer's activations while it is
  rematerialized and, with ZeRO-3, the whole weights the runtime holds while the stage runs: its
  embedding/head units and two layers (``runtime/zero3.py`` gathers one unit at a time, with prefetch);
- lower bound on the step time (``Evaluation.lower_bound``), valid for every schedule here: rank r
  cannot start before microbatch 0 reached its first stage, must do all its compute, and after its
  last backward the gradient still has to travel down to stage 0 (or the rank reduces its
  gradients; not with a split backward, whose W may run while it travels). It equals the papers'
  closed forms for uniform stages.

What is estimated rather than exact: efficiency is a constant fraction of peak (no dependence on
matrix sizes or micro-batch size), elementwise kernels are priced as FLOPs, the optimizer step and
the tied-embedding all-reduce between the first and last stage are not priced, and in-flight counts
for interleaved, wave and V schedules are upper bounds (every stashed microbatch counted at the
largest chunk's size).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autopar.runtime.actions import stash_points
from autopar.runtime.schedules import stage_aware_ratios, zero_bubble_orders
from autopar.search.comm_time import CommTime
from autopar.search.evaluation import Evaluation
from autopar.search.profile import Profile, UnitCost
from autopar.search.space import ZERO_BUBBLE, Candidate
from autopar.search.stage_layout import Layout, balanced_layout, balanced_v_layout, even_layout
from autopar.solver.cluster import ClusterSpec
from autopar.solver.cost import EFFICIENCY, TrainingSetup
from autopar.solver.pipeline_shape import stage_ranks


@dataclass(frozen=True)
class _Part:
    """What a candidate's price shares with its ZeRO / MiCS variants: per stage and per pipeline rank."""

    stages: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]
    x: tuple[float, ...]
    tf: tuple[float, ...]
    tb: tuple[float, ...]
    tr: tuple[float, ...]
    tc: tuple[float, ...]
    tw: tuple[float, ...]
    act_kept: tuple[float, ...]
    trans: tuple[float, ...]
    rank_params: tuple[float, ...]  # parameter elements held per device
    rank_kept: tuple[float, ...]  # bytes kept per stashed microbatch (the rank's largest stage)
    rank_trans: tuple[float, ...]  # bytes held while a stage runs: a recomputed layer, ZeRO-3's gathered weights
    rank_wkept: tuple[float, ...]  # bytes a split B keeps until its W (the rank's largest stage)
    rank_busy: tuple[float, ...]  # compute seconds per microbatch
    rank_head: tuple[float, ...]  # earliest start: microbatch 0's forward reaching the rank's first stage
    rank_tail: tuple[float, ...]  # the last gradient's way from the rank's first stage down to stage 0


class Analytic:
    """Prices candidates for one profile, cluster, global batch and training setup."""

    def __init__(
        self,
        profile: Profile,
        cluster: ClusterSpec,
        global_batch: int,
        precision: str = "bf16",
        optimizer: str = "adam",
        efficiency: float = EFFICIENCY,
        scatter_gather: bool = True,
    ):
        self.p, self.cluster, self.B = profile, cluster, global_batch
        self.precision, self.optimizer, self.efficiency = precision, optimizer, efficiency
        self.scatter_gather = scatter_gather
        dtype = "fp32" if precision == "fp32" else precision
        self.flop_rate = cluster.peak(dtype) * efficiency
        self.act_scale = 1.0 if precision == "fp32" else 2.0 / profile.itemsize
        self.weight_b, self.grad_b, self.state_b = TrainingSetup(optimizer, precision).bytes_per_param
        self.copy_b = TrainingSetup(optimizer, precision).copy_bytes
        self.comm = CommTime(cluster, self.weight_b, self.grad_b, scatter_gather)
        self.zero0_dominated = cluster.runs_as("reduce_scatter") == "reduce_scatter"
        units = profile.units
        self.n = len(units)
        rows = _augment(units, profile.seq)  # a parameter read by several units (a tied embedding) counts in each
        self._pre = {k: _prefix([r[k] for r in rows]) for k in _SUMMED}
        self._is_layer = [u.kind == "layer" for u in units]
        self._max_layer_act: dict[tuple[int, int, int], float] = {}
        self._parts: dict[tuple, _Part | None] = {}
        self._sync: dict[tuple, tuple[float, float]] = {}
        self._bases: dict[tuple, Any] = {}
        self._fractions: dict[tuple, tuple[float, ...]] = {}

    # -- layouts (stage_layout.py) ----------------------------------------------------------------
    @functools.cache  # noqa: B019 - one Analytic per search
    def balanced_layout(self, stages: int) -> Layout | None:
        return balanced_layout([u.flops for u in self.p.units], stages)

    @functools.cache  # noqa: B019
    def even_layout(self, stages: int) -> Layout | None:
        return even_layout(self._is_layer, stages)

    @functools.cache  # noqa: B019
    def balanced_v_layout(self, pp: int) -> Layout | None:
        return balanced_v_layout([u.flops for u in self.p.units], pp)

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

    def max_layer_act(self, a: int, b: int, tp: int) -> float:
        key = (a, b, tp)
        if key not in self._max_layer_act:
            self._max_layer_act[key] = max(
                (u.act(tp) for u, x in zip(self.p.units[a:b], self._is_layer[a:b]) if x), default=0.0
            )
        return self._max_layer_act[key]

    def _tp_allreduce(self, key: str, a: int, e: int, scale: float, tp: int) -> float:
        nbytes, count = self._sum(key + "_bytes", a, e) * scale, int(self._sum(key + "_count", a, e))
        return self.comm.allreduce(nbytes, count, tp, self.comm.intra(tp))

    def stage_ranks(self, c: Candidate) -> tuple[int, ...]:
        return tuple(stage_ranks(c.pp, c.chunks, c.waves))

    def recompute_fractions(self, c: Candidate) -> tuple[float, ...]:
        """Fraction of each stage's layers recomputed (per rank for SCP: 1 - alpha_i)."""
        S = c.num_stages
        if c.recompute == "none":
            return (0.0,) * S
        if c.recompute == "full":
            return (1.0,) * S
        key = (S, c.alpha1)
        if key not in self._fractions:
            self._fractions[key] = tuple(float(1 - a) for a in stage_aware_ratios(S, c.alpha))
        return self._fractions[key]

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self, c: Candidate) -> Evaluation | None:
        """Price ``c``; None when its layout does not exist (more stages than units, uneven split)."""
        part = self._stage_part(c)
        if part is None:
            return None
        counts = c.inflight_counts()
        per_param = self.bytes_per_param(c)
        s0, s1 = self._sync_coefficients(c)
        weights = [p * per_param for p in part.rank_params]
        if c.schedule in ZERO_BUBBLE and c.pp > 1:  # stashes and W-kept gradients at the rank's peak
            points = _stash_points(c.schedule, c.pp, c.microbatches)
            held = [
                max(live * kept + wait * wk for live, wait in pts)
                for pts, kept, wk in zip(points, part.rank_kept, part.rank_wkept)
            ]
        else:
            held = [k * kept for k, kept in zip(counts, part.rank_kept)]
        mem = tuple(w + h + tr for w, h, tr in zip(weights, held, part.rank_trans))
        reduce = tuple(s0 + s1 * p if p > 0 and s1 else 0.0 for p in part.rank_params)
        if c.pp == 1:
            lb = c.microbatches * part.rank_busy[0] + reduce[0]
        else:
            tails = [0.0] * c.pp if c.schedule in ZERO_BUBBLE else part.rank_tail
            ends = zip(part.rank_head, part.rank_busy, tails, reduce)
            lb = max(h + c.microbatches * busy + max(t, r) for h, busy, t, r in ends)
        return Evaluation(
            candidate=c,
            stages=part.stages,
            stage_rank=part.ranks,
            tf=part.tf,
            tb=part.tb,
            tr=part.tr,
            tc=part.tc,
            tw=part.tw,
            recompute_fraction=part.x,
            reduce=reduce,
            rank_memory=mem,
            weight_memory=tuple(weights),
            lower_bound=lb,
            info={"act_kept": part.act_kept, "transient": part.trans, "inflight": counts},
        )

    def _sync_coefficients(self, c: Candidate) -> tuple[float, float]:
        """``dp_sync(c, params) = a + b * params`` for params > 0 (every collective is affine in bytes)."""
        key = (c.dp, c.tp, c.shard_group, c.zero, c.microbatches)
        if key not in self._sync:
            one, two = self.comm.dp_sync(c, 1e6), self.comm.dp_sync(c, 2e6)
            slope = (two - one) / 1e6
            self._sync[key] = (one - slope * 1e6, slope)
        return self._sync[key]

    def bytes_per_param(self, c: Candidate) -> float:
        """Model-state bytes per parameter element on a rank under the candidate's ZeRO / MiCS."""
        return self._state_bytes(c.zero, c.shard_group if c.dp > 1 else 1)

    def _state_bytes(self, zero: int, group: int) -> float:
        """Model-state bytes per parameter element with ZeRO stage ``zero`` sharding over ``group`` ranks."""
        w, g, o = self.weight_b, self.grad_b, self.state_b
        o += 4.0 if zero in (1, 2) else 0.0  # the ZeRO-1/2 optimizer's fp32 flat slice (runtime/zero.py)
        shards = w / (group if zero >= 3 else 1) + g / (group if zero >= 2 else 1) + o / (group if zero >= 1 else 1)
        return shards + self.copy_b  # mixed precision's per-use compute copy, unsharded

    def _stage_part(self, c: Candidate) -> _Part | None:
        """Per-stage times, kept activations and parameters: everything but ZeRO's per-rank effects
        (shared by the ZeRO / MiCS variants of a configuration; ZeRO-3 gathers are per stage)."""
        z3 = c.shard_group if c.zero >= 3 and c.dp > 1 else 0
        key = (c.pp, c.dp, c.tp, c.micro_batch, c.schedule, c.chunks, c.waves, c.layout, c.recompute, c.alpha1, z3)
        if key in self._parts:
            return self._parts[key]
        base = self._base(c, z3)
        if base is None:
            self._parts[key] = None
            return None
        x = self.recompute_fractions(c)
        stages, ranks, tf, tb, tr, tc, tw, acts, saving, layer_act, params, gathered, mine, head, tail, wkept = base
        kept = [a - xs * sv for a, xs, sv in zip(acts, x, saving)]
        trans = [(la if xs else 0.0) + g for la, xs, g in zip(layer_act, x, gathered)]
        part = _Part(
            stages=stages,
            ranks=ranks,
            x=x,
            tf=tf,
            tb=tb,
            tr=tr,
            tc=tc,
            tw=tw,
            act_kept=tuple(kept),
            trans=tuple(trans),
            rank_params=tuple(sum(params[s] for s in ss) for ss in mine),
            rank_kept=tuple(max(kept[s] for s in ss) for ss in mine),
            rank_trans=tuple(max(trans[s] for s in ss) for ss in mine),
            rank_wkept=tuple(max(wkept[s] for s in ss) for ss in mine),
            rank_busy=tuple(sum(tf[s] + tb[s] + x[s] * tr[s] for s in ss) for ss in mine),
            rank_head=tuple(head[ss[0]] for ss in mine),
            rank_tail=tuple(tail[ss[0]] for ss in mine),
        )
        self._parts[key] = part
        return part

    def _base(self, c: Candidate, z3: int):
        """What does not depend on recomputation: stage times (``tr`` = recomputing all of a stage's
        layers), boundary transfers, activations and the bytes full recomputation saves, per stage;
        with ZeRO-3 over ``z3`` ranks, those without it plus its gathers (``_zero3``)."""
        key = (c.pp, c.dp, c.tp, c.micro_batch, c.schedule, c.chunks, c.waves, c.layout, z3)
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
        b, tp = c.micro_batch, c.tp
        ranks = self.stage_ranks(c)
        sa = self.act_scale * b  # activation bytes per sample -> per microbatch at training precision
        rate = self.flop_rate
        tf, tb, tr, tw, acts, saving, layer_act, params_of, wkept = [], [], [], [], [], [], [], [], []
        S = self._sum
        for a, e in stages:
            f_tp, f_all = S("flops_tp", a, e), S("flops", a, e)
            fwd = b * (f_tp / tp + f_all - f_tp) / rate
            # recomputation touches the stage's layers only (embeddings and head keep their activations)
            lf_tp, lf_all = S("lflops_tp", a, e), S("lflops", a, e)
            rfwd = b * (lf_tp / tp + lf_all - lf_tp) / rate
            params = S("params_tp", a, e) / tp + S("params_rep", a, e)
            tf.append(fwd + self._tp_allreduce("ar_fwd", a, e, sa, tp))
            tb.append(2 * fwd + self._tp_allreduce("ar_bwd", a, e, sa, tp))
            tr.append(rfwd + self._tp_allreduce("lar_fwd", a, e, sa, tp))
            tw.append(b * S("wflops", a, e) / tp / rate)
            acts.append((S("act_tp", a, e) / tp + S("act_rep", a, e)) * sa)
            wkept.append((S("wgrad_tp", a, e) / tp + S("wgrad_rep", a, e)) * sa)
            lacts = (S("lact_tp", a, e) / tp + S("lact_rep", a, e)) * sa
            saving.append(lacts - S("linput_bytes", a, e) * sa)
            layer_act.append(self.max_layer_act(a, e, tp) * sa)
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
        )
        self._bases[key] = base
        return base

    def _zero3(self, c: Candidate, z3: int, base: tuple) -> tuple:
        """``base`` under ZeRO-3 over ``z3`` ranks, as ``runtime/zero3.py`` runs it: one all-gather per unit
        (the stage's embedding/head units, each layer) in every forward, backward and recomputation,
        one reduce-scatter per unit in every backward (with MiCS an all-reduce of the shard across the
        groups); a split backward (zero-bubble) gathers again in its W, which does the scatters. While a
        stage runs it holds whole its non-layer units and two layers (the one computing, the next arriving).
        DualPipeV's unsplit backwards are charged the second gather too (an upper bound)."""
        stages, ranks, tf, tb, tr, tc, tw, acts, saving, layer_act, params, _, mine, _, _, wkept = base
        intra_g = self.comm.intra(c.tp * z3)
        split = c.schedule in ZERO_BUBBLE
        gather, scatter, gathered = [], [], []
        for a, e in stages:
            units = [(u.kind == "layer", u.params_tp / c.tp + u.params_rep) for u in self.p.units[a:e]]
            gather.append(sum(self.comm.gather(p * self.weight_b, z3, intra_g) for _, p in units))
            scatter.append(
                sum(
                    self.comm.gather(p * self.grad_b, z3, intra_g) + self.comm.mics_hop(p * self.grad_b, c)
                    for _, p in units
                )
            )
            layers = sorted((p for lay, p in units if lay), reverse=True)
            gathered.append((sum(p for lay, p in units if not lay) + sum(layers[:2])) * self.weight_b)
        tf = tuple(t + g for t, g in zip(tf, gather))
        tb = tuple(t + g + r + (g if split else 0.0) for t, g, r in zip(tb, gather, scatter))
        tr = tuple(t + g for t, g in zip(tr, gather))
        if split:
            tw = tuple(t + g + r for t, g, r in zip(tw, gather, scatter))
        head_tail = _head_tail(tf, tb, tc)
        return (stages, ranks, tf, tb, tr, tc, tw, acts, saving, layer_act, params, gathered, mine, *head_tail, wkept)

    def family_bounds(self, pp: int, dp: int, tp: int, b: int, m: int, max_shard: int) -> tuple[float, float]:
        """(step-time lower bound, memory lower bound) of every candidate with this mesh and micro-batch.

        Time: the busiest rank does at least the mean compute and tensor-parallel all-reduces of a
        microbatch without recomputation, m times. Memory: the busiest rank holds at least the mean
        model states under the strongest sharding allowed (ZeRO stage ``max_shard`` over dp)."""
        n = self.n
        sa = self.act_scale * b
        f_tp, f_all = self._sum("flops_tp", 0, n), self._sum("flops", 0, n)
        work = 3 * b * (f_tp / tp + f_all - f_tp) / self.flop_rate
        work += self._tp_allreduce("ar_fwd", 0, n, sa, tp) + self._tp_allreduce("ar_bwd", 0, n, sa, tp)
        params = (self._sum("params_tp", 0, n) / tp + self._sum("params_rep", 0, n)) / pp
        return m * work / pp, params * self._state_bytes(max_shard, dp if dp > 1 else 1)

    # -- FLOP counts for throughput --------------------------------------------------------------------
    def eq3_flops(self) -> float:
        """Megatron's Eq. 3 generalised: per step, 4 x the layers' forward matmul/attention FLOPs (forward,
        backward = 2 forwards, recomputation) + 3 x the rest's (the logit layer is not recomputed).
        Equal to 96 B s l h^2 (1 + s/6h + V/16lh) for a GPT model (tested)."""
        layers = sum(u.mm_flops for u in self.p.units if u.kind == "layer")
        return (4 * layers + 3 * (self.p.mm_flops - layers)) * self.B

    def model_flops(self) -> float:
        """3 x forward matmul/attention FLOPs of the global batch: Eq. 3 without the recomputation pass."""
        return 3 * self.p.mm_flops * self.B


def _stash_points(schedule: str, pp: int, microbatches: int) -> list[list[tuple[int, int]]]:
    """Per rank, the (stashed, awaiting W) counts that can be its memory peak (``actions.stash_points``),
    read off the schedule's own compute orders. From 2 pp microbatches on the orders only repeat their
    steady state, so 4 pp stand for any more (``tests/test_zero_bubble.py`` checks it)."""
    return _points_of(schedule, pp, min(microbatches, 4 * pp))


@functools.cache
def _points_of(schedule: str, pp: int, microbatches: int) -> list[list[tuple[int, int]]]:
    return [stash_points(order) for order in zero_bubble_orders(schedule, pp, microbatches)]


_SUMMED = (
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
        out.append(d)
    return out


__all__ = ["Analytic"]
