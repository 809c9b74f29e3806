"""Price one whole-plan candidate without solving anything: per-stage times, per-rank memory, a step-time bound.

Per candidate (``Analytic.evaluate``), on the per-stage times, activations and parameters of
``stage_terms.py`` (the stage cut, compute and communication per microbatch, ZeRO-3's gathers), with
the data-parallel gradient synchronization after each rank's last backward under ZeRO / MiCS
(``comm_time.py``):

- memory per rank: model states (``TrainingSetup.bytes_per_param``, divided as ZeRO/MiCS say) plus
  the stashed activations of the microbatches in flight (closed forms per schedule,
  ``schedule/generators.inflight_per_rank``; for zero-bubble schedules, read off their action lists:
  a microbatch counts until its W, and from its B on it also holds the output gradients of its weight
  ops, ``UnitCost.wgrad_*``, priced at the worst point of each rank's list)
  plus what a stage holds only while it runs: one recomputed layer's activations while it is
  rematerialized and, with ZeRO-3, the whole weights the runtime holds while the stage runs: its
  embedding/head units and two layers and the compute copies of one layer and of those units
  (``runtime/grads/zero3.py`` gathers one unit at a time, with prefetch; ZeRO-3 keeps no whole copy of the
  weights, ``StageTerms._zero3``);
- lower bound on the step time (``Evaluation.lower_bound``), valid for every schedule here: rank r
  cannot start before microbatch 0 reached its first stage, must do all its compute, and after its
  last backward the gradient still has to travel down to stage 0 (or the rank reduces its
  gradients; not with a split backward, whose W may run while it travels). It equals the papers'
  closed forms for uniform stages.

- the optimizer step of each rank after its gradient sync (``optimizer_seconds``: its states streamed at the
  device's bandwidth, divided as ZeRO shards them).

What is estimated rather than exact (besides ``stage_terms.py``'s): the tied-embedding all-reduce between the first
and last stage is not priced, and in-flight counts for wave and V schedules are upper bounds (every stashed
microbatch counted at the largest chunk's size); with interleaving, each chunk counts at most as many microbatches as
it stashes at once (``_stage_peaks``, read off the schedule's action lists): the rank's smaller chunks at their own
size but for those, an upper bound still (``_held``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.schedule.actions import stage_peaks, stash_points
from autopar.schedule.generators import interleaved_orders, zero_bubble_orders
from autopar.search.evaluation import Evaluation
from autopar.search.kept import kept
from autopar.search.space import ZERO_BUBBLE, Candidate, Chain
from autopar.search.stage_terms import StageTerms, _head_tail
from autopar.solver.cluster import compute
from autopar.solver.sharding.cost import BUCKET_BYTES


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
    rank_experts: tuple[float, ...] = ()  # of rank_params, the expert tables' elements (expert parallelism)


@dataclass(frozen=True)
class _Skeleton:
    """What every candidate of a chain (one schedule, stage layout, mesh and micro-batch) takes at least, whatever
    its ZeRO stage and recomputation: per stage and per pipeline rank, compute and tensor-parallel all-reduces only
    (no context-parallel collectives, pipeline transfers or ZeRO-3 gathers, which only add time)."""

    stages: tuple[int, ...]  # per rank: its stages
    tr: tuple[float, ...]  # per stage: recomputing all of its layers once
    acts: tuple[float, ...]  # per stage: bytes a microbatch keeps without recomputation
    saving: tuple[float, ...]  # per stage: of them, what full recomputation saves
    head: tuple[float, ...]  # per rank: microbatch 0's forward reaching its first stage
    tail: tuple[float, ...]  # per rank: the last gradient's way from its first stage down to stage 0
    busy: tuple[float, ...]  # per rank: forward and backward seconds of a microbatch, no recomputation
    first_bwd: tuple[float, ...]  # per rank: its first stage's backward (what ZeRO-0's buckets may hide beside)
    params: tuple[float, ...]  # per rank: parameter elements held


class Analytic(StageTerms):
    """Prices candidates for one profile, cluster, global batch and training setup (``StageTerms``' arguments)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._parts: dict[tuple, _Part | None] = {}
        self._sync: dict[tuple, tuple[float, float]] = {}
        self._skeletons: dict[tuple, _Skeleton | None] = {}
        self._rates: dict[tuple, tuple[str, float]] = {}

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
            held = _held(c, counts, part.act_kept, part.ranks)
        mem = tuple(w + h + tr for w, h, tr in zip(weights, held, part.rank_trans))
        reduce = tuple(s0 + s1 * p if p > 0 and s1 else 0.0 for p in part.rank_params)
        overlaps = self.cluster.overlaps_compute
        if c.cp > 1:  # the cp all-reduce of the gradients: in buckets during the backward (overlapped on NCCL)
            cp_sync = tuple(self.comm.cp_sync(c, p) for p in part.rank_params)
            if c.zero == 0 and c.dp > 1:
                reduce = tuple(r + x for r, x in zip(reduce, cp_sync))  # one bucketed sync over both axes
            else:
                reduce = tuple(
                    r + x for r, x in zip(reduce, self._overlapped(c, part, cp_sync, "cp") if overlaps else cp_sync)
                )
        if c.ep > 1:  # the dense parameters' gradients are all-reduced over ep too (the experts' are not)
            reduce = tuple(r + self._ep_sync(c, p - x) for r, p, x in zip(reduce, part.rank_params, part.rank_experts))
        elif c.zero == 0 and c.dp > 1 and overlaps:
            reduce = self._overlapped(c, part, reduce)
        opt = tuple(self.optimizer_seconds(p, c.zero, c.shard_group if c.dp > 1 else 1) for p in part.rank_params)
        if c.pp == 1:
            lb = c.microbatches * part.rank_busy[0] + reduce[0] + opt[0]
        else:
            tails = [0.0] * c.pp if c.schedule in ZERO_BUBBLE else part.rank_tail
            ends = zip(part.rank_head, part.rank_busy, tails, reduce, opt)
            lb = max(h + c.microbatches * busy + max(t, r + o) for h, busy, t, r, o in ends)
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
            optimizer=opt,
            rank_memory=mem,
            weight_memory=tuple(weights),
            lower_bound=lb,
            info={"act_kept": part.act_kept, "transient": part.trans, "inflight": counts},
        )

    def _overlapped(self, c: Candidate, part: _Part, reduce: tuple[float, ...], axis: str = "dp") -> tuple[float, ...]:
        """ZeRO-0's bucketed all-reduce as the runtime runs it on NCCL (``runtime/grads/sync.py``, DDP's way): each
        bucket starts once the rank's last backward finished its gradients, beside the rest of that backward, so
        what is exposed is the larger of the last bucket's all-reduce and the sync less that last backward (the
        backward of the rank's first stage, which runs last; the other stages' buckets start earlier). ``axis``:
        the last bucket's group, dp (tp * cp apart) or cp (tp apart)."""
        first = {}
        for s, r in enumerate(part.ranks):
            first.setdefault(r, s)
        if axis == "cp":
            n, intra, k = c.cp, self.comm.intra(c.tp * c.cp), self.comm.per_node(c.cp, c.tp)
        else:
            n, intra, k = c.dp, self.comm.intra(c.tp * c.cp * c.dp), self.comm.per_node(c.dp, c.tp * c.cp)
        out = []
        for r, (full, params) in enumerate(zip(reduce, part.rank_params)):
            last = self.comm.allreduce(min(BUCKET_BYTES, params * self.grad_b), 1, n, intra, k)
            out.append(min(full, max(last, full - part.tb[first[r]])))
        return tuple(out)

    def _ep_sync(self, c: Candidate, params: float) -> float:
        """Seconds of the all-reduce over ep of ``params`` gradient elements (bucketed, after the backward, not
        overlapped): the dense parameters, replicated over the expert axis, whose rows it splits."""
        grads = params * self.grad_b
        if grads <= 0:
            return 0.0
        buckets = math.ceil(grads / BUCKET_BYTES)
        return self.comm.allreduce(grads, buckets, c.ep, self.comm.intra(c.tp * c.ep), self.comm.per_node(c.ep, c.tp))

    def _sync_coefficients(self, c: Candidate) -> tuple[float, float]:
        """``dp_sync(c, params) = a + b * params`` for params > 0 (every collective is affine in bytes); with
        expert parallelism the sync over the dp / ep axis (``_ep_sync`` adds ep's)."""
        if c.ep > 1:
            c = dataclasses.replace(c, dp=c.dp // c.ep, ep=1, mics_group=0)
        key = (c.dp, c.cp, c.tp, c.shard_group, c.zero, c.microbatches)
        if key not in self._sync:
            # through one and two full buckets of gradients: ZeRO-0's per-bucket latency stays in the slope (it
            # was lost below one bucket, where both points have one), and the line meets the step at whole buckets;
            # the data-parallel part only (the cp all-reduce is added per rank in evaluate)
            unit = BUCKET_BYTES / self.grad_b
            one, two = self.comm._dp_sync(c, unit), self.comm._dp_sync(c, 2 * unit)
            slope = (two - one) / unit
            self._sync[key] = (one - slope * unit, slope)
        return self._sync[key]

    def optimizer_seconds(self, params: float, zero: int, group: int) -> float:
        """Seconds of the optimizer step of a rank holding ``params`` parameter elements: it streams, per element it
        updates, the fp32 parameter (read and written), its gradient (read) and the optimizer states (Adam's two
        moments, read and written) at the device's streaming bandwidth (``compute.seconds`` of an elementwise op,
        as torch's fused/foreach Adam runs); under ZeRO-1/2/3 a rank updates its 1/``group`` of them (the fp32 flat
        slice of ``runtime/grads/zero.py``). The copy of the gathered slice back into the parameters is not priced."""
        if params <= 0:
            return 0.0
        per = 2 * self.weight_b + self.grad_b + 2 * self.state_b
        nbytes = params * per / (group if zero >= 1 else 1)
        return compute.seconds(compute.Work("elementwise", 0.0, nbytes, dtype="fp32"), self.device)

    def bytes_per_param(self, c: Candidate) -> float:
        """Model-state bytes per parameter element on a rank under the candidate's ZeRO / MiCS."""
        return self._state_bytes(c.zero, c.shard_group if c.dp > 1 else 1)

    def _state_bytes(self, zero: int, group: int) -> float:
        """Model-state bytes per parameter element with ZeRO stage ``zero`` sharding over ``group`` ranks."""
        w, g, o = self.weight_b, self.grad_b, self.state_b
        o += 4.0 if zero in (1, 2) else 0.0  # the ZeRO-1/2 optimizer's fp32 flat slice (runtime/grads/zero.py)
        shards = w / (group if zero >= 3 else 1) + g / (group if zero >= 2 else 1) + o / (group if zero >= 1 else 1)
        # mixed precision's per-use compute copy, priced once per element and unsharded; under ZeRO-3 it is cast from
        # the gathered units and held with them only (``StageTerms._zero3``), not here
        return shards + (0.0 if zero >= 3 else self.copy_b)

    def _stage_part(self, c: Candidate) -> _Part | None:
        """Per-stage times, kept activations and parameters: everything but ZeRO's per-rank effects
        (shared by the ZeRO / MiCS variants of a configuration; ZeRO-3 gathers are per stage)."""
        z3 = c.shard_group if c.zero >= 3 and c.dp > 1 else 0
        key = (c.pp, c.dp, c.cp, c.tp, c.micro_batch, c.schedule, c.chunks, c.waves, c.layout, c.recompute, c.alpha1,
               z3)  # fmt: skip
        key += (c.ep, c.cp_form, c.sp)
        if key in self._parts:
            return self._parts[key]
        base = self._base(c, z3)
        if base is None:
            self._parts[key] = None
            return None
        x = self.recompute_fractions(c)
        stages, ranks, tf, tb, tr, tc, tw, acts, saving, layer_act, params, gathered, mine, head, tail, wkept, ex = base
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
            rank_experts=tuple(sum(ex[s] for s in ss) for ss in mine),
        )
        self._parts[key] = part
        return part

    def family_bounds(
        self,
        pp: int,
        dp: int,
        tp: int,
        b: int,
        m: int,
        max_shard: int,
        sync_options: tuple = (),
        cp: int = 1,
        ep: int = 1,
        sp: bool = False,
    ) -> tuple[float, float]:
        """(step-time lower bound, memory lower bound) of every candidate with this mesh and micro-batch.

        Time: every rank r takes at least ``m busy_r + reduce_r`` (``evaluate``'s bound), so the busiest at
        least their mean: the mean compute and tensor-parallel all-reduces of a microbatch without
        recomputation, m times, plus the least data-parallel synchronization any of ``sync_options``
        ((ZeRO stage, MiCS group) pairs the family's chains take, ``space.sync_options``) costs a rank holding
        the mean parameters: its gradient sync after the last backward (bandwidth term: the reduce is
        affine in the parameters), or under ZeRO-3 its gathers and scatters in every microbatch.
        Memory: the busiest rank holds at least the mean model states under the strongest sharding
        allowed (ZeRO stage ``max_shard`` over dp). With ``cp`` ranks splitting each sequence, a rank computes
        b / cp samples' worth (the cp all-gathers and the cp gradient sync left out: a lower bound still).
        With expert parallelism over ``ep`` ranks: the expert tables divided by ep, the sync and ZeRO over dp / ep
        (the all-to-alls and the ep all-reduce, at least 0, left out). ``sp``: with sequence parallelism, its
        collectives in place of the all-reduces (``tp_seconds``)."""
        n = self.n
        bt = b / cp
        work = self._sec("fwd", 0, n, bt, tp) + self._sec("bwd", 0, n, bt, tp)
        tp_f, tp_b, _ = self.tp_seconds(0, n, bt, tp, sp)  # f's at most hidden beside the weight gradients
        work += tp_f + tp_b
        experts = self._sum("params_ep", 0, n) / tp
        params = (self._sum("params_tp", 0, n) / tp + self._sum("params_rep", 0, n) - experts + experts / ep) / pp
        group = dp // ep
        sync = min(
            (self._sync_floor(pp, group, tp, m, z, g, params, work / pp, cp) for z, g in sync_options), default=0.0
        )
        sync += self.optimizer_seconds(params, max_shard, dp) if params else 0.0  # the least: the widest sharding
        return m * work / pp + sync, params * self._state_bytes(max_shard, group if group > 1 else 1)

    def family_floor(
        self, family_chains: list[Chain], budget: float, max_shard: int, sync_options: tuple = (), memory: bool = True
    ) -> tuple[float, float]:
        """(step-time lower bound, memory lower bound) of a family's candidates that fit ``budget``, from its
        chains (``space.chains``), tighter than ``family_bounds``: the least over its schedules and stage layouts of

            max over pipeline ranks r of  head_r + m (busy_r + recompute_r) + max(tail_r, sync_r + optimizer_r)

        (``evaluate``'s bound, the pipeline's bubble in head and tail; no tail for a split backward), with busy_r
        the rank's compute and tensor-parallel all-reduces (``_skeleton``), sync_r the least data-parallel sync of
        ``sync_options`` for its parameters (``_sync_floor``; ZeRO-0's buckets hidden beside at most its first
        stage's backward, ZeRO-3's prefetched gathers beside at most all its compute), optimizer_r its step under
        the widest sharding, and recompute_r what the least recomputation level whose memory lower bound fits
        ``budget`` recomputes: the rank's model states under ZeRO
        stage ``max_shard`` over the whole dp group plus its in-flight microbatches' kept activations
        (``inflight_counts``; a zero-bubble schedule's most stashed at once, counted until the W). Levels cost
        more time in order (memory need not fall along them: ``search._Walk``), so the first that fits is the
        fastest that does. Memory: the least of the chains' memory bounds over all their levels (inf time when
        none fits). ``memory=False``: the same without the memory, every chain at its least recomputation (no
        in-flight counts needed: a zero-bubble schedule's are read off its orders, the dearer part), memory 0: a
        looser bound the search tries first (``search.tighten``)."""
        seen, free = set(), []
        for k, ch in enumerate(family_chains):
            c = ch.base
            shape = (c.schedule, c.chunks, c.waves, c.layout, c.cp_form)
            if shape in seen:  # MiCS groups of one shape: sync_options covers all of them
                continue
            seen.add(shape)
            free.append((self._chain_floor(ch, None, max_shard, sync_options), k, ch))
        if not memory:
            return min((t for (t, _), *_ in free), default=math.inf), min((m for (_, m), *_ in free), default=math.inf)
        # with the memory, chains by their bound without it: the memory only raises a chain's time, so once the least
        # so far is at most a chain's bound without the memory, neither it nor any later one can lower it (nor is the
        # memory bound needed: a chain fits, the family is not over budget; 0 stands for theirs)
        best_t = best_m = math.inf
        for (t0, _), _, ch in sorted(free, key=lambda e: e[:2]):
            if t0 == math.inf:  # no stage layout: no candidate
                continue
            if best_t <= t0:
                best_m = 0.0
                break
            t, m = self._chain_floor(ch, budget, max_shard, sync_options)
            best_t, best_m = min(best_t, t), min(best_m, m)
        return best_t, best_m

    def chain_floors(
        self, family_chains: list[Chain], budget: float, max_shard: int, sync_options: tuple = ()
    ) -> list[tuple[float, ...]]:
        """Per chain of a family, in order, per ZeRO stage of it (``Chain.zeros``): ``family_floor``'s time bound of
        that stage's candidates alone (inf where none fits ``budget``, or the layout does not exist), with the
        stage's own model-state bytes, optimizer step and sync (ZeRO-1's where ZeRO-0 is not among the options: it
        syncs no less); at most the step of each of its candidates that fits, the floor the search walks it under
        before pricing any of it (``search._Walk``)."""
        memo: dict[tuple, float] = {}
        out = []
        for ch in family_chains:
            c, row = ch.base, []
            for z in ch.zeros:
                key = (c.schedule, c.chunks, c.waves, c.layout, c.cp_form, c.mics_group, z)
                if key not in memo:
                    opts = [o for o in sync_options if o == (z, c.mics_group)]
                    opts = opts or [o for o in sync_options if z == 0 and o == (1, c.mics_group)] or sync_options
                    memo[key] = self._chain_floor(ch, budget, max_shard, tuple(opts), zero=z)[0]
                row.append(memo[key])
            out.append(tuple(row))
        return out

    def _chain_floor(
        self, ch: Chain, budget: float | None, max_shard: int, sync_options: tuple, zero: int | None = None
    ) -> tuple[float, float]:
        """``family_floor`` of one chain; ``budget=None``: at its least recomputation, memory left out (0).
        ``zero``: of that ZeRO stage's candidates only, its model states and optimizer step as ``evaluate`` prices
        them (else the widest sharding's, ``max_shard`` over the whole dp group)."""
        c = ch.base
        sk = self._skeleton(c)
        if sk is None:
            return math.inf, math.inf
        group = c.dp // c.ep
        if zero is None:
            per_param, opt_zero, opt_group = self._state_bytes(max_shard, group if group > 1 else 1), max_shard, c.dp
        else:
            cz = dataclasses.replace(c, zero=zero)
            per_param, opt_zero, opt_group = self.bytes_per_param(cz), zero, cz.shard_group if c.dp > 1 else 1
        if budget is None:
            x, least = self.fractions(len(sk.tr), *ch.levels[0]), 0.0
        else:
            x, least = self._forced(ch, sk, budget, per_param)
            if x is None:
                return math.inf, least
        m, zb = c.microbatches, c.schedule in ZERO_BUBBLE and c.pp > 1
        rates = [self._sync_rate(c.pp, group, c.tp, m, z, g, c.cp) for z, g in sync_options] if group > 1 else []
        t = 0.0
        for r, ss in enumerate(sk.stages):
            p, busy = sk.params[r], sk.busy[r] + sum(x[s] * sk.tr[s] for s in ss)
            sync = min((_exposed(h, k * p, sk.first_bwd[r], m * busy) for h, k in rates), default=0.0)
            sync += self.optimizer_seconds(p, opt_zero, opt_group) if p else 0.0
            t = max(t, sk.head[r] + m * busy + max(0.0 if zb else sk.tail[r], sync))
        return t, least

    def _forced(self, ch: Chain, sk: _Skeleton, budget: float, per_param: float) -> tuple[tuple | None, float]:
        """(the recomputation fractions of the chain's least level whose memory lower bound fits ``budget``, None
        where none does; the least memory lower bound over its levels), model states at ``per_param`` bytes."""
        c = ch.base
        if c.schedule in ZERO_BUBBLE and c.pp > 1:
            counts = [max(live for live, _ in pts) for pts in _stash_points(c.schedule, c.pp, c.microbatches)]
        else:
            counts = c.inflight_counts()
        weights = [p * per_param for p in sk.params]
        ranks = self.stage_ranks(c)
        x, least = None, math.inf
        for rc, a1 in ch.levels:
            xs = self.fractions(len(sk.tr), rc, a1)
            kept = [a - f * sv for a, f, sv in zip(sk.acts, xs, sk.saving)]
            mem = max(w + h for w, h in zip(weights, _held(c, counts, kept, ranks)))
            least = min(least, mem)
            if x is None and mem <= budget:
                x = xs
        return x, least

    def _skeleton(self, c: Candidate) -> _Skeleton | None:
        """The chain's ``_Skeleton`` (None when its layout does not exist), shared by the chains of every family with
        its pipeline shape, tp, cp, ep and micro-batch (dp and m do not enter)."""
        split = c.schedule in ZERO_BUBBLE
        key = (c.pp, c.tp, c.cp, c.cp_form, c.ep, c.micro_batch, split, c.chunks, c.waves, c.layout, c.sp)
        if key in self._skeletons:
            return self._skeletons[key]
        stages = self.layout(c)
        if stages is None:
            self._skeletons[key] = None
            return None
        b, tp, cp = c.micro_batch, c.tp, c.cp
        fwd, bwd, tr, acts, saving, params = [], [], [], [], [], []
        for a, e in stages:
            f, bw, r = self.stage_compute(a, e, b, tp, cp, c.ep, split, c.sp)
            fwd.append(f)
            bwd.append(bw)
            tr.append(r)
            kept, saves = self.stage_acts(a, e, b, tp, cp, c.cp_form, c.sp)
            acts.append(kept)
            saving.append(saves)
            params.append(self.stage_params(a, e, tp, c.ep)[0])
        head, tail = _head_tail(fwd, bwd, [0.0] * len(stages))
        mine: list[list[int]] = [[] for _ in range(c.pp)]
        for s, r in enumerate(self.stage_ranks(c)):
            mine[r].append(s)
        sk = _Skeleton(
            stages=tuple(tuple(ss) for ss in mine),
            tr=tuple(tr),
            acts=tuple(acts),
            saving=tuple(saving),
            head=tuple(head[ss[0]] for ss in mine),
            tail=tuple(tail[ss[0]] for ss in mine),
            busy=tuple(sum(fwd[s] + bwd[s] for s in ss) for ss in mine),
            first_bwd=tuple(bwd[ss[0]] for ss in mine),
            params=tuple(sum(params[s] for s in ss) for ss in mine),
        )
        self._skeletons[key] = sk
        return sk

    def _sync_floor(
        self, pp: int, dp: int, tp: int, m: int, zero: int, group: int, params: float, busy: float, cp: int = 1
    ) -> float:
        """The least data-parallel synchronization of a rank holding ``params`` parameter elements under ZeRO
        ``zero`` (MiCS group ``group``, 0: the whole dp group): the bandwidth terms only (latencies left out).
        ZeRO-0's overlapped sync (``_overlapped``) hides at most one microbatch's backward, at most ``busy``:
        m busy + max(0, sync - busy) is what a rank takes at least."""
        if dp <= 1:
            return 0.0
        beside, rate = self._sync_rate(pp, dp, tp, m, zero, group, cp)
        return _exposed(beside, rate * params, busy, m * busy)

    def _sync_rate(self, pp: int, dp: int, tp: int, m: int, zero: int, group: int, cp: int) -> tuple[str, float]:
        """``_sync_floor``'s (what it runs beside: "backward", ZeRO-0's buckets beside one backward; "compute",
        ZeRO-3's gathers beside all of it; "", nothing; and its seconds per parameter element), cached."""
        key = (pp, dp, tp, m, zero, group, cp)
        found = self._rates.get(key)
        if found is not None:
            return found
        c = Candidate(pp, dp, tp, 1, m, "none", zero=zero, mics_group=group, cp=cp)
        if zero < 3:
            found = ("backward" if zero == 0 and self.cluster.overlaps_compute else "", self._sync_coefficients(c)[1])
        else:
            z3 = c.shard_group
            intra, k = self.comm.intra(tp * cp * z3), self.comm.per_node(z3, tp * cp)

            def slope(f) -> float:  # seconds per parameter element of an affine collective time
                return f(2e6) - f(1e6)

            # the unit collectives as StageTerms._zero3 prices them (hierarchical across nodes where that pays)
            gather = slope(lambda p: self.comm.unit_gather(p * self.weight_b, z3, intra, k)) / 1e6
            scatter = slope(
                lambda p: self.comm.unit_gather(p * self.grad_b, z3, intra, k) + self.comm.mics_hop(p * self.grad_b, c)
            )
            # on NCCL the gathers run beside the compute (prefetch): a rank takes at least the longer of the two
            found = ("compute" if self.cluster.overlaps_compute else "", m * (2 * gather + scatter / 1e6))
        self._rates[key] = found
        return found

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


def _held(c: Candidate, counts: Sequence[float], kept: Sequence[float], ranks: Sequence[int]) -> list[float]:
    """Per pipeline rank, the stashed activations at its peak: its in-flight count (``counts``) at its largest
    stage's ``kept`` bytes, and with interleaving no more than that count at its smallest stage's plus, per larger
    stage, the most microbatches that stage stashes at once (``_stage_peaks``) at its excess: the last chunk of the
    last rank (the head, the logits) stashes one microbatch at a time, not the rank's whole count."""
    mine: list[list[int]] = [[] for _ in range(c.pp)]
    for s, r in enumerate(ranks):
        mine[r].append(s)
    peaks = _stage_peaks(c.pp, c.microbatches, c.chunks) if c.schedule == "interleaved" and c.pp > 1 else None
    out = []
    for r, ss in enumerate(mine):
        ks = [kept[s] for s in ss]
        top = counts[r] * max(ks)
        if peaks is not None and len(peaks[r]) == len(ks):
            base = min(ks)
            top = min(top, counts[r] * base + sum(p * (k - base) for p, k in zip(peaks[r], ks)))
        out.append(top)
    return out


def _stage_peaks(pp: int, microbatches: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Per rank of interleaved 1F1B, per stage it holds (in stage order), the most microbatches that stage stashes at
    once, read off the schedule's compute orders (``generators.interleaved_orders``, ``actions.stage_peaks``: the
    transfers change no count). From 4 pp microbatches on they no longer grow (the steady state repeats;
    ``tests/test_search_sp.py`` checks it against ``actions.stage_stash_points`` of the whole schedule), so 4 pp
    stand for any more."""
    return _peaks_of(pp, min(microbatches, 4 * pp), chunks)


@functools.cache
def _peaks_of(pp: int, microbatches: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Kept on disk (``kept.py``): a deep pipeline's orders take a fraction of a second, read for every family."""
    return kept(
        "stash_points", f"interleaved-{pp}-{microbatches}-{chunks}", ("interleaved", pp, microbatches, chunks),
        lambda: tuple(map(stage_peaks, interleaved_orders(pp, microbatches, chunks))),
        lambda v: tuple(tuple(p) for p in v),
    )  # fmt: skip


def _exposed(beside: str, seconds: float, backward: float, compute: float) -> float:
    """What a rank takes at least beyond its compute for a sync of ``seconds`` running beside at most one backward of
    ``backward`` seconds (ZeRO-0's buckets), beside its whole ``compute`` (ZeRO-3's prefetched gathers), or not."""
    if beside == "backward":
        return max(0.0, seconds - backward)
    if beside == "compute":
        return max(0.0, seconds - compute)
    return seconds


def _stash_points(schedule: str, pp: int, microbatches: int) -> list[list[tuple[int, int]]]:
    """Per rank, the (stashed, awaiting W) counts that can be its memory peak (``actions.stash_points``),
    read off the schedule's own compute orders. From 2 pp microbatches on the orders only repeat their
    steady state, so 4 pp stand for any more (``tests/test_zero_bubble.py`` checks it)."""
    return _points_of(schedule, pp, min(microbatches, 4 * pp))


@functools.cache
def _points_of(schedule: str, pp: int, microbatches: int) -> list[list[tuple[int, int]]]:
    """Kept on disk (``kept.py``): reading a pp = 64 schedule's orders takes a second."""
    return kept(
        "stash_points", f"{schedule}-{pp}-{microbatches}", (schedule, pp, microbatches),
        lambda: [stash_points(order) for order in zero_bubble_orders(schedule, pp, microbatches)],
        lambda v: [[(live, wait) for live, wait in pts] for pts in v],
    )  # fmt: skip


__all__ = ["Analytic"]
