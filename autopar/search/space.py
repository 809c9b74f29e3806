"""The search space: the candidate configurations of a whole plan, and their families and chains.

``autopar plan MODEL --cluster SPEC --global-batch B`` (``autopar/search/search.py``) searches over

    mesh          pp x dp x cp x tp = the cluster's devices (tp innermost, then cp, then dp, then pp, as
                  Megatron lays ranks out: a tp group stays inside a node when tp divides the devices per
                  node); cp, context parallelism, splits each sequence over cp ranks (offered where every rank
                  keeps at least ``CP_MIN_TOKENS`` tokens, and the model's attention is SDPA)
    cp form       with cp > 1, how attention runs on the split sequence (``CP_FORMS``): ring attention, the
                  all-gather of keys and values, or Ulysses (where cp x tp divides every attention's heads)
    micro-batch   b, a divisor of B / dp; m = B / (dp b) microbatches per pipeline
    schedule      1F1B, interleaved 1F1B with v chunks, Hanayo waves W, Merak's shifted critical path,
                  the zero-bubble ZB-H1, ZB-H2, ZB-V and DualPipeV (backward split into B and W;
                  ZB-V and DualPipeV on the V of two stages per rank, DualPipeV with m >= 2 pp)
    recompute     none, full (every transformer layer keeps only its input), or Merak's stage-aware
                  ratios alpha_i (SCP only; alpha_1 the largest that fits, on a 1/20 grid)
    ZeRO / MiCS   stage 1, 2, 3 over the dp group or inside MiCS partition groups of g ranks
    sp            Megatron's sequence parallelism (Korthikanti et al. 2022) beside tp > 1: the norms', residuals'
                  and dropouts' activations split over tp along the sequence, each tensor-parallel all-reduce a
                  reduce-scatter and an all-gather (``stage_terms.tp_seconds``); offered only where
                  ``SearchSpace.sequence_parallel`` allows it (default: not), since a plan file of it cannot be
                  written yet (``materialize.build_plan`` refuses: the runtime's sequence-sharded regions are the
                  ILP's, not Megatron's)
    ep            for a mixture of experts (``Profile.experts`` > 0), an expert-parallel degree dividing dp and
                  the experts: the dp ranks laid out as dp / ep x ep (``inner_mesh``), each expert table split
                  over ep, the rows sent to their experts' ranks and back (``stage_terms.py`` prices it);
                  ZeRO-1/2 over the dp / ep axis, no MiCS or ZeRO-3 beside it

A ``Family`` is a mesh and a micro-batch (the candidates sharing a step-time and a memory lower
bound); a ``Chain`` the candidates of a family that differ only in ZeRO stage and recomputation.
Pricing a candidate is ``price.py``; profiles ``profile.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from dataclasses import replace as dc_replace
from fractions import Fraction
from typing import Any, Protocol

from autopar.errors import SearchError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.passes.batch_coupling import TAIL_SCHEDULES
from autopar.schedule.generators import inflight_per_rank, schedule_kind
from autopar.schedule.placement import num_stages
from autopar.search.profile import Profile

RECOMPUTE = ("none", "full", "stage-aware")
ALPHA_GRID = 20  # stage-aware alpha_1 is searched in steps of 1/20
# the schedules the search tries, each enumerated with its options in _schedules ("none": pp = 1, gradient
# accumulation); every other name is the registry's (schedule/generators.py), which says what each one is
SEARCHED = ("none", "1f1b", "interleaved", "wave", "scp", "zb-h1", "zb-h2", "zbv", "dualpipev")
ZERO_BUBBLE = tuple(n for n in SEARCHED[1:] if schedule_kind(n).split_backward)  # each backward split into B and W
# the search's default cp degrees leave every cp rank at least this many tokens of a sequence (Megatron-Core's
# guidance: context parallelism pays from sequences of about 8k tokens; Llama 3 ran 8k per rank, cp 16 at 131k)
CP_MIN_TOKENS = 2048
# the forms of context parallelism (solver/sharding/rules/context.py), each priced by stage_terms.cp_seconds
CP_FORMS = ("ring", "all-gather", "ulysses")


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration of the whole plan. Field order is the tie-break order of equal step times."""

    pp: int
    dp: int
    tp: int
    micro_batch: int  # samples per microbatch per data-parallel replica
    microbatches: int  # per pipeline per step
    schedule: str  # "none" (pp = 1: gradient accumulation), "1f1b", "interleaved", "wave", "scp", or ZERO_BUBBLE
    chunks: int = 1  # interleaved v
    waves: int = 0  # Hanayo W; 1 for ZB-V and DualPipeV (their V)
    recompute: str = "none"  # "none", "full", "stage-aware"
    alpha1: int = 0  # stage-aware alpha_1 in 1/ALPHA_GRID
    zero: int = 0
    mics_group: int = 0  # 0: ZeRO over the whole dp group
    layout: str = "balanced"  # "balanced" (min-max FLOPs) or "even" (Megatron: L / S layers per stage)
    cp: int = 1  # context parallel: each sequence split over cp ranks (between dp and tp in the rank order)
    ep: int = 1  # expert-parallel degree (a mixture of experts only): dp's ranks as dp / ep x ep
    cp_form: str = ""  # with cp > 1 one of CP_FORMS (the plan's context_attention); "" without cp
    sp: bool = False  # Megatron's sequence parallelism over tp (tp > 1 only)

    @property
    def num_stages(self) -> int:
        return num_stages(self.pp, self.chunks, self.waves)

    @property
    def shard_group(self) -> int:
        return self.mics_group or self.dp // self.ep

    @property
    def alpha(self) -> Fraction:
        return Fraction(self.alpha1, ALPHA_GRID)

    def inflight_counts(self) -> list[float]:
        """Stage-microbatches whose activations each pipeline rank stashes at its peak
        (``schedule/generators.inflight_per_rank``)."""
        return inflight_per_rank(self.schedule, self.pp, self.microbatches, self.chunks, self.waves)

    def schedule_options(self) -> dict[str, Any]:
        """Keyword options of ``autopar.schedule.generators.make_schedule`` for this candidate."""
        if self.schedule == "interleaved":
            return {"chunks": self.chunks}
        if self.schedule == "wave":
            return {"waves": self.waves}
        if self.schedule == "scp":
            return {"alpha1": self.alpha}
        if self.schedule in ("1f1b", *ZERO_BUBBLE) and self.recompute == "full":
            return {"recompute": 1}
        return {}

    def inner_mesh(self) -> dict[str, int]:
        """The axes the intra-op plan shards over, outermost first, size-1 axes left out: ``dp``, ``cp`` and
        ``tp``; with MiCS ``dpr`` (replicas of a partition group) and ``dp`` (the group); with expert
        parallelism ``dp`` (dp / ep) and ``ep`` (cp = 1)."""
        if self.mics_group:
            axes = {"dpr": self.dp // self.mics_group, "dp": self.mics_group, "cp": self.cp, "tp": self.tp}
        elif self.ep > 1:
            axes = {"dp": self.dp // self.ep, "ep": self.ep, "tp": self.tp}
        else:
            axes = {"dp": self.dp, "cp": self.cp, "tp": self.tp}
        return {a: n for a, n in axes.items() if n > 1} or {"dp": 1}

    def mesh(self) -> dict[str, int]:
        """The mesh to launch: ``pp`` outermost, then the inner mesh (Megatron's rank order)."""
        return ({PIPELINE_AXIS: self.pp} if self.pp > 1 else {}) | self.inner_mesh()

    def describe(self) -> str:
        sched = {
            "none": "no pipeline",
            "1f1b": "1f1b",
            "interleaved": f"interleaved v={self.chunks}",
            "wave": f"wave W={self.waves}",
            "scp": "scp",
        }.get(self.schedule, self.schedule)
        rc = self.recompute if self.recompute != "stage-aware" else f"stage-aware a1={float(self.alpha):.2f}"
        z = f"zero{self.zero}" + (f" mics{self.mics_group}" if self.mics_group else "")
        lay = " even" if self.layout == "even" else ""
        mesh = f"pp{self.pp} dp{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        mesh += (f" cp{self.cp} {self.cp_form}" if self.cp > 1 else "") + f" tp{self.tp}" + (" sp" if self.sp else "")
        return f"{mesh} b{self.micro_batch} m{self.microbatches} {sched}{lay}, {rc}, {z}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["alpha1"] = float(self.alpha)
        return d


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; ``None`` leaves a dimension to the search. Defaults are the full space."""

    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SEARCHED
    chunks: tuple[int, ...] = (2, 3, 4, 6, 8)
    waves: tuple[int, ...] = (1, 2)
    recompute: tuple[str, ...] = ("none", "full", "stage-aware")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    mics: bool = True  # also MiCS partition groups: divisors g of dp, node-aligned (see _node_aligned)
    mics_max_nodes: int = 8  # the largest MiCS group spans this many nodes
    # pinned partition groups (0: ZeRO over the whole dp group), node-aligned or not; None: every node-aligned one
    mics_groups: tuple[int, ...] | None = None
    devices_per_node: int = 8  # set from the cluster by the search
    # ZeRO-3 / MiCS-3 also with pp > 1: the runtime gathers a stage's weights one unit (layer, embedding, head)
    # at a time in each forward, recomputation and backward (runtime/grads/zero3.py), as price.py prices it; False
    # leaves those candidates out
    pipeline_zero3: bool = True
    layouts: tuple[str, ...] = ("balanced", "even")
    max_pp: int | None = None  # default: the number of layers
    # expert-parallel degrees (a mixture of experts only); None: every divisor of dp that divides the experts
    ep: tuple[int, ...] | None = None
    # context-parallel degrees; None: every divisor of the sequence leaving each rank CP_MIN_TOKENS (1 always)
    cp: tuple[int, ...] | None = None
    cp_forms: tuple[str, ...] = CP_FORMS  # the forms of context parallelism tried (Ulysses only where it divides)
    # Megatron's sequence parallelism with tp > 1: (False,) leaves it out (the default: no plan file of it can be
    # written yet, ``materialize.build_plan``), (True,) takes it wherever tp > 1, (False, True) tries both
    sequence_parallel: tuple[bool, ...] = (False,)

    def sp_options(self, tp: int) -> tuple[bool, ...]:
        """The sequence-parallel settings tried beside ``tp``: ``sequence_parallel``'s with tp > 1, none without."""
        return (False,) if tp == 1 else tuple(sorted(set(self.sequence_parallel)))

    def forms(self, profile: Profile, cp: int, tp: int) -> tuple[str, ...]:
        """The forms of context parallelism the search tries on ``cp`` ranks beside ``tp`` (``cp_forms``): ("",)
        without cp; Ulysses only where cp x tp divides every attention's query and key/value heads."""
        if cp == 1:
            return ("",)
        return tuple(f for f in self.cp_forms if f != "ulysses" or profile.ulysses_ok(cp, tp))

    def cp_degrees(self, profile: Profile, world: int) -> tuple[int, ...]:
        """The cp degrees the search tries for ``profile`` on ``world`` devices (``cp``; see its comment)."""
        if self.cp is not None:
            ok = tuple(c for c in self.cp if world % c == 0 and profile.cp_ok(c))
            if not ok:
                why = (
                    "its attention is not SDPA (an eager softmax(QK^T)V: context parallelism is not priced for it)"
                    if not profile.cp_ready
                    else f"each must divide the {world} devices and the sequence of {profile.seq} tokens"
                )
                raise SearchError(
                    f"no context-parallel degree of {self.cp} can split {profile.model or 'the model'}: {why}"
                )
            return ok
        return tuple(c for c in divisors(world) if c == 1 or (profile.cp_ok(c) and profile.seq // c >= CP_MIN_TOKENS))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int, profile: Profile, global_batch: int, space: SearchSpace) -> Iterator[tuple[int, int, int, int]]:
    """(pp, dp, cp, tp) with pp dp cp tp = world, tp dividing the layers' heads and split dims, dp dividing B,
    cp one of ``SearchSpace.cp_degrees``."""
    layers = profile.num_layers
    for cp in space.cp_degrees(profile, world):
        for tp in divisors(world // cp):
            if (space.tp and tp not in space.tp) or not profile.tp_ok(tp):
                continue
            for pp in divisors(world // cp // tp):
                dp = world // cp // tp // pp
                if space.pp and pp not in space.pp or space.dp and dp not in space.dp:
                    continue
                if pp > (space.max_pp or max(layers, 1)) or global_batch % dp:
                    continue
                yield pp, dp, cp, tp


class Pricer(Protocol):
    """What enumerating families and chains reads of the analytic pricer (``price.Analytic``)."""

    p: Profile
    B: int
    n: int
    zero0_dominated: bool  # ZeRO-1 communicates no more than ZeRO-0 (not on gloo)

    def balanced_layout(self, stages: int) -> tuple[tuple[int, int], ...] | None: ...
    def even_layout(self, stages: int) -> tuple[tuple[int, int], ...] | None: ...


@dataclass(frozen=True, order=True)
class Family:
    """A mesh and a micro-batch: the candidates sharing a step-time and a memory lower bound."""

    pp: int
    dp: int
    tp: int
    micro_batch: int
    microbatches: int
    cp: int = 1
    ep: int = 1
    cp_form: str = ""
    sp: bool = False


@dataclass(frozen=True)
class Chain:
    """Candidates of a family that differ only in ZeRO stage and recomputation.

    ``zeros`` ascend and ``levels`` go from the least recomputation to the most: along the levels of one ZeRO
    stage the step time never falls, so the search walks each stage from its least recomputation on, a level
    only while the one before it could still be among the K best (``search._Walk``). Nothing is assumed across
    ZeRO stages: a higher one can be faster (ZeRO-3's gathers beside the backward, the sharded optimizer step)
    and need more memory (ZeRO-3's gathered units), so every stage is walked.
    """

    base: Candidate
    zeros: tuple[int, ...]
    levels: tuple[tuple[str, int], ...]  # (recompute, alpha1)
    unsupported: int = 0  # ZeRO-3 candidates left out with pp > 1 (SearchSpace.pipeline_zero3=False)

    def candidate(self, zero: int, level: int) -> Candidate:
        rc, a = self.levels[level]
        return dc_replace(self.base, zero=zero, recompute=rc, alpha1=a)

    def candidates(self) -> Iterator[Candidate]:
        """Every candidate of the chain: each ZeRO stage at each recomputation level."""
        return (self.candidate(z, level) for z in self.zeros for level in range(len(self.levels)))

    @property
    def size(self) -> int:
        return len(self.zeros) * len(self.levels) + self.unsupported


def families(analytic: Pricer, space: SearchSpace, world: int) -> list[Family]:
    out = []
    for pp, dp, cp, tp in meshes(world, analytic.p, analytic.B, space):
        per_replica = analytic.B // dp
        for b in divisors(per_replica):
            if analytic.p.coupled and not analytic.p.tail and b != per_replica:
                continue  # a model coupling its batch runs exactly only as one microbatch per step
            if not space.micro_batch or b in space.micro_batch:
                eps = expert_degrees(analytic.p, dp, space) if cp == 1 else [1]
                forms = space.forms(analytic.p, cp, tp)
                sps = space.sp_options(tp)
                m = per_replica // b
                out += [Family(pp, dp, tp, b, m, cp, ep, f, sp) for ep in eps for f in forms for sp in sps]
    return out


def expert_degrees(profile: Profile, dp: int, space: SearchSpace) -> list[int]:
    """The expert-parallel degrees of a mesh with ``dp`` data-parallel ranks: 1, and for a mixture of experts
    every divisor of dp above 1 that divides its experts (``SearchSpace.ep`` restricts them)."""
    out = [1] if not space.ep or 1 in space.ep else []
    if profile.experts:
        out += [e for e in divisors(dp) if e > 1 and profile.experts % e == 0 and (not space.ep or e in space.ep)]
    return out


def max_shard(space: SearchSpace, fam: Family) -> int:
    """The strongest ZeRO stage the space allows for the family (for its memory lower bound)."""
    zs = [z for z in space.zero if (z < 3 or fam.pp == 1 or space.pipeline_zero3) and (z < 3 or fam.ep == 1)]
    return max(zs, default=0) if fam.dp > fam.ep else 0


def sync_options(space: SearchSpace, fam: Family, zero0_dominated: bool = True) -> tuple[tuple[int, int], ...]:
    """The (ZeRO stage, MiCS group) pairs that bound the family's step time from below: those its chains take, less
    ZeRO-0 where ZeRO-1 communicates no more (``zero0_dominated``: its sync is then never the least)."""
    return tuple((z, g) for g, zs, _ in _zeros(fam, space, zero0_dominated) for z in zs)


def chains(analytic: Pricer, space: SearchSpace, fam: Family) -> Iterator[Chain]:
    """Every chain of a family: schedule x chunks/waves x stage layout x MiCS group."""
    L = analytic.p.num_layers
    # a coupled loss over several microbatches runs exactly only as a batch tail: its schedules, no recompute
    tail = analytic.p.coupled and fam.microbatches > 1
    scheds = (
        [(n, 1, 0) for n in TAIL_SCHEDULES if fam.pp > 1] if tail else _schedules(fam.pp, L, space, fam.microbatches)
    )
    for sched, v, w in scheds:
        levels = (("none", 0),) if tail else _levels(sched, space)
        if not levels:
            continue
        stages = num_stages(fam.pp, v, w)
        layouts = _layouts(space, sched)
        for layout in layouts:
            if layout == "even" and (
                L % stages
                or stages == 1
                or ("balanced" in layouts and analytic.even_layout(stages) == analytic.balanced_layout(stages))
            ):
                continue  # no even layout, or the same stages as the balanced one (offered as balanced)
            if layout == "balanced" and stages > analytic.n:
                continue
            # ZeRO-0 stays in every chain: where ZeRO-1 is no slower it is still a plan that may be among the K best
            for g, zeros, unsupported in _zeros(fam, space, zero0_dominated=False):
                base = Candidate(fam.pp, fam.dp, fam.tp, fam.micro_batch, fam.microbatches, sched, v, w,
                                 mics_group=g, layout=layout, cp=fam.cp, ep=fam.ep,
                                 cp_form=fam.cp_form, sp=fam.sp)  # fmt: skip
                yield Chain(base, zeros, levels, unsupported * len(levels))


def _schedules(pp: int, layers: int, space: SearchSpace, microbatches: int) -> Iterator[tuple[str, int, int]]:
    if pp == 1:
        if "none" in space.schedules:
            yield "none", 1, 0
        return
    if "1f1b" in space.schedules:
        yield "1f1b", 1, 0
    if "scp" in space.schedules:
        yield "scp", 1, 0
    if "interleaved" in space.schedules:
        for v in space.chunks:
            if v > 1 and pp * v <= layers:
                yield "interleaved", v, 0
    if "wave" in space.schedules:
        for w in space.waves:
            if 2 * pp * w <= layers:
                yield "wave", 1, w
    for name in ZERO_BUBBLE:
        v_shaped = schedule_kind(name).v_shape
        if name not in space.schedules or (v_shaped and 2 * pp > layers):
            continue
        if name != "dualpipev" or microbatches >= 2 * pp:
            yield name, 1, int(v_shaped)


def _levels(sched: str, space: SearchSpace) -> tuple[tuple[str, int], ...]:
    """Recomputation settings from the least to the most recomputation."""
    if sched == "scp":  # Merak's schedule with stage-aware ratios (alpha_1 = 0: full recomputation)
        if "stage-aware" in space.recompute:
            return tuple(("stage-aware", a) for a in range(ALPHA_GRID, -1, -1))
        return (("stage-aware", 0),) if "full" in space.recompute else ()
    return tuple((rc, 0) for rc in ("none", "full") if rc in space.recompute)


def _layouts(space: SearchSpace, sched: str) -> tuple[str, ...]:
    return ("balanced",) if sched == "none" else space.layouts


def _node_aligned(devices: int, space: SearchSpace) -> bool:
    """A MiCS partition group of this many devices fills part of one node or a few whole nodes."""
    dpn = space.devices_per_node
    return dpn % devices == 0 if devices <= dpn else devices % dpn == 0 and devices <= space.mics_max_nodes * dpn


def _zeros(fam: Family, space: SearchSpace, zero0_dominated: bool = True) -> Iterator[tuple[int, tuple, int]]:
    """(MiCS group, ZeRO stages ascending, ZeRO-3 stages unsupported). ZeRO-0 is left out where it is dominated by
    ZeRO-1 (same communication, less memory: ``zero0_dominated``, for a bound; on gloo, whose reduce-scatter is an
    all-reduce, ZeRO-1 communicates more than ZeRO-0)."""
    if fam.dp == 1:
        yield 0, (0,), 0
        return
    if fam.ep > 1:  # ZeRO-1/2 over dp / ep beside expert parallelism; no MiCS, no ZeRO-3
        zs = sorted(z for z in space.zero if z in (1, 2) or (z == 0 and (1 not in space.zero or not zero0_dominated)))
        unsupported = sum(z >= 3 for z in space.zero)
        if fam.dp == fam.ep:  # nothing for ZeRO to shard over
            zs = [0] if 0 in space.zero or 1 in space.zero else []
        if zs:
            yield 0, tuple(zs), unsupported
        return
    if space.mics_groups is not None:
        groups = [g for g in space.mics_groups if g == 0 or (1 < g < fam.dp and fam.dp % g == 0)]
    else:
        groups = [0] + ([g for g in divisors(fam.dp) if 1 < g < fam.dp and _node_aligned(g * fam.tp * fam.cp, space)]
                        if space.mics else [])  # fmt: skip
    for g in groups:
        zs = sorted(z for z in space.zero if z > 0 or (g == 0 and (1 not in space.zero or not zero0_dominated)))
        unsupported = 0
        if fam.pp > 1 and not space.pipeline_zero3:
            unsupported = sum(z >= 3 for z in zs)
            zs = [z for z in zs if z < 3]
        if zs:
            yield g, tuple(zs), unsupported


__all__ = [
    "ALPHA_GRID",
    "CP_MIN_TOKENS",
    "ZERO_BUBBLE",
    "Candidate",
    "SearchSpace",
    "Chain",
    "Family",
    "Pricer",
    "chains",
    "divisors",
    "expert_degrees",
    "families",
    "max_shard",
    "sync_options",
    "meshes",
]
