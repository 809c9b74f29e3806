"""The whole-plan search space: per-layer costs read from the IR, and the candidate configurations.

``autopar plan MODEL --cluster SPEC --global-batch B`` (``autopar/search.py``) searches over

    mesh          pp x dp x tp = the cluster's devices (tp innermost, then dp, then pp, as Megatron
                  lays ranks out: a tp group stays inside a node when tp divides the devices per node)
    micro-batch   b, a divisor of B / dp; m = B / (dp b) microbatches per pipeline
    schedule      1F1B, interleaved 1F1B with v chunks, Hanayo waves W, Merak's shifted critical path
    recompute     none, full (every transformer layer keeps only its input), or Merak's stage-aware
                  ratios alpha_i (SCP only; alpha_1 the largest that fits, on a 1/20 grid)
    ZeRO / MiCS   stage 1, 2, 3 over the dp group or inside MiCS partition groups of g ranks

The costs of a candidate come from the lowered Program (``profile_program``), read once per model:

- The program is cut into units: ``pre`` (ops before the main layer stack, e.g. the embeddings),
  one unit per layer of the stack (``transformer.h.N``, ``model.layers.N``), ``post`` (final norm,
  head, loss). Per unit and per sample: forward FLOPs, parameters, bytes saved for backward,
  bytes entering the unit, and the tensor-parallel all-reduces of Megatron's layout.
- Megatron's tensor parallelism is read off the IR, not assumed per model: a matmul with a weight
  operand is column-parallel unless its activation comes from a column-parallel output, in which
  case it is row-parallel; values between the two are split over tp, so are their FLOPs and bytes.
  Each row-parallel output is all-reduced in the forward pass (Megatron's g), each distinct input
  of a column-parallel matmul in the backward pass (f); an embedding lookup is vocabulary-parallel
  (forward all-reduce of its output). Matrices (2-D parameters) are split over tp, vectors are not.
- Saved activations: a float tensor is saved for backward when a consumer needs its value to
  compute gradients (matmuls, attention, norms, nonlinear pointwise ops, products of two tensors)
  or its producer needs its own output (softmax, tanh, exp, ...); additions, views, casts, dropout
  with p = 0 save nothing. For a GPT layer this gives 32 s h bytes per sample in 16-bit: Megatron's
  34 s h without its two dropout masks (fused attention: no s^2 term). Common nodes (masks, rotary
  tables) are not counted.

Pricing a candidate is ``solver/search_cost.py``; the search itself ``autopar/search.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from dataclasses import replace as dc_replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from autopar.ir.core import VIEW_OPS, Op, Program

if TYPE_CHECKING:
    from autopar.solver.search_cost import Analytic

PROFILE_VERSION = 1

VIEWS = VIEW_OPS
MATMULS = frozenset({"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm"})
ATTENTION = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention"})
# ops whose backward needs nothing but the incoming gradient (they save no activation)
_NO_SAVE = VIEWS | {
    "aten.add.Tensor",
    "aten.add.Scalar",
    "aten.sub.Tensor",
    "aten.sub.Scalar",
    "aten.neg",
    "aten.dropout",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy",
    "aten.contiguous",
    "aten.clone",
    "aten.cat",
    "aten.sum.dim_IntList",
    "aten.mean.dim",
    "aten.embedding",
    "aten.expand_as",
    "aten.flatten.using_ints",
}
# ops whose backward needs their own output
_SAVE_OUTPUT = frozenset(
    {
        "aten._softmax",
        "aten.softmax.int",
        "aten._log_softmax",
        "aten.log_softmax.int",
        "aten.tanh",
        "aten.sigmoid",
        "aten.exp",
        "aten.rsqrt",
        "aten.sqrt",
    }
)
_PRODUCTS = frozenset({"aten.mul.Tensor", "aten.div.Tensor"})  # save operands only when both are tensors
_LAYER = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")


# ---------------------------------------------------------------------------------------------
# Per-unit costs read from the IR


@dataclass(frozen=True)
class UnitCost:
    """Forward costs of one unit per sample (bytes at the program's float dtype)."""

    kind: str  # "pre", "layer" or "post"
    label: str
    flops: float  # forward FLOPs of every non-view op
    flops_tp: float  # ... of which Megatron's layout divides over tp
    mm_flops: float  # matmul and attention FLOPs only (what Megatron's Eq. 3 counts)
    params_tp: int  # parameter elements split over tp (matrices)
    params_rep: int  # parameter elements replicated over tp (vectors)
    act_tp: float  # bytes saved for backward, split over tp
    act_rep: float  # bytes saved for backward, replicated over tp
    input_bytes: float  # bytes of the non-common tensors entering the unit (a recomputed layer keeps these)
    ar_fwd_bytes: float  # bytes all-reduced over tp in the forward pass
    ar_fwd_count: int  # ... in this many all-reduces
    ar_bwd_bytes: float  # bytes all-reduced over tp in the backward pass
    ar_bwd_count: int

    def act(self, tp: int) -> float:
        return self.act_tp / tp + self.act_rep

    def params(self, tp: int) -> float:
        return self.params_tp / tp + self.params_rep


@dataclass(frozen=True)
class Profile:
    """A model's units and the facts the search needs, per sample; saved as JSON in the profile cache."""

    model: str
    seq: int
    itemsize: int  # bytes per element of the program's floats (4 for a float32 capture)
    units: tuple[UnitCost, ...]  # pre, the layers in order, post
    total_params: int  # distinct parameter elements (a tied weight once)
    tp_divides: tuple[int, ...]  # sizes tp must divide (attention heads, split feature dims)
    version: int = PROFILE_VERSION

    @property
    def num_layers(self) -> int:
        return sum(u.kind == "layer" for u in self.units)

    @property
    def mm_flops(self) -> float:
        """Forward matmul and attention FLOPs per sample of the whole model."""
        return sum(u.mm_flops for u in self.units)

    def tp_ok(self, tp: int) -> bool:
        return all(d % tp == 0 for d in self.tp_divides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        d["units"] = tuple(UnitCost(**u) for u in d["units"])
        d["tp_divides"] = tuple(d["tp_divides"])
        return cls(**d)


def _layer_key(path: str) -> tuple[str, int] | None:
    m = _LAYER.match(path or "")
    return (m.group("stack"), int(m.group("index"))) if m else None


def _units_of(prog: Program) -> list[tuple[str, str, list[Op]]]:
    """(kind, label, ops) in program order: pre, one per layer of the main stack, post."""
    keys = [_layer_key(op.path) for op in prog.ops]
    stacks: dict[str, set[int]] = {}
    for k in keys:
        if k:
            stacks.setdefault(k[0], set()).add(k[1])
    if not stacks:
        return [("layer", "model", list(prog.ops))]
    main = max(stacks, key=lambda s: (len(stacks[s]), s))
    in_main = [i for i, k in enumerate(keys) if k and k[0] == main]
    first, last = in_main[0], in_main[-1]
    units: list[tuple[str, str, list[Op]]] = [("pre", "pre", list(prog.ops[:first]))]
    current = None
    for i in range(first, last + 1):
        k = keys[i]
        if k and k[0] == main and (current is None or k[1] != current):
            current = k[1]
            units.append(("layer", f"{main}.{current}", []))
        units[-1][2].append(prog.ops[i])
    units.append(("post", "post", list(prog.ops[last + 1 :])))
    return units


def profile_program(prog: Program, batch: int, model: str = "", seq: int = 0) -> Profile:
    """Read per-sample unit costs from an unsharded lowered program whose inputs hold ``batch`` samples."""
    from autopar.passes.pipeline_split import common_nodes

    types = prog.types()
    commons = common_nodes(prog)
    params = {v.name: v for v in prog.inputs if v.kind == "param"}
    weights = set(params)  # parameters and views or casts of them
    for op in prog.ops:
        refs = op.input_refs()
        if refs and refs[0].name in weights and op.target in VIEWS | {"aten.to.dtype", "aten._to_copy"}:
            weights.update(op.results)
    saved = _saved_for_backward(prog, weights, commons)
    # the largest embedding table is the vocabulary (Megatron splits it over tp); position tables are not
    tables = [op.input_refs()[0].name for op in prog.ops if op.target == "aten.embedding" and op.input_refs()]
    tables = [n for n in tables if n in weights]
    vocab = max(tables, key=lambda n: (types[n].shape[0], n)) if tables else None
    units = _units_of(prog)
    unit_of: dict[str, int] = {v.name: -1 for v in prog.inputs}
    for k, (_, _, ops) in enumerate(units):
        for op in ops:
            for r in op.results:
                unit_of[r] = k
    column: set[str] = set()  # values split over tp (downstream of a column-parallel matmul)
    tp_divides: set[int] = set()
    out: list[UnitCost] = []
    itemsize = 4
    for k, (kind, label, ops) in enumerate(units):
        c = dict(flops=0.0, flops_tp=0.0, mm=0.0, ptp=0, prep=0, atp=0.0, arep=0.0, inb=0.0)
        arf = [0.0, 0]
        arb = [0.0, 0]
        f_inputs: set[str] = set()
        seen_params: set[str] = set()
        seen_in: set[str] = set()
        for op in ops:
            refs = [r.name for r in op.input_refs()]
            for n in refs:
                if n in params and n not in seen_params:
                    seen_params.add(n)
                    if len(params[n].type.shape) >= 2:
                        c["ptp"] += params[n].type.numel
                    else:
                        c["prep"] += params[n].type.numel
                t = types[n]
                if (
                    n not in seen_in
                    and unit_of.get(n, -1) >= 0
                    and unit_of[n] < k
                    and n not in commons
                    and n not in weights
                    and t.is_float
                ):
                    seen_in.add(n)
                    c["inb"] += t.nbytes
            acts = [n for n in refs if n not in weights]
            has_weight = len(acts) < len(refs)
            split = False
            if op.target in MATMULS and has_weight and acts:
                w = next(n for n in refs if n in weights)
                wshape = types[w].shape
                if any(n in column for n in acts):  # row-parallel: partial output, all-reduced (g)
                    arf[0] += op.types[0].nbytes
                    arf[1] += 1
                    if kind == "layer" and len(wshape) == 2:
                        tp_divides.add(wshape[0] if op.target == "aten.mm" else wshape[1])
                    split = True  # its FLOPs divide; its output does not
                    out_split = False
                else:  # column-parallel: output split; its input's gradient all-reduced (f)
                    for n in acts:
                        if n not in f_inputs:
                            f_inputs.add(n)
                            arb[0] += types[n].nbytes
                            arb[1] += 1
                    if kind == "layer" and len(wshape) == 2:
                        tp_divides.add(wshape[1] if op.target == "aten.mm" else wshape[0])
                    split = out_split = True
            elif op.target == "aten.embedding" and has_weight and refs[0] == vocab:
                arf[0] += op.types[0].nbytes  # vocabulary-parallel lookup: partial sums all-reduced
                arf[1] += 1
                split, out_split = True, False
            else:
                split = out_split = any(n in column for n in acts)
                if op.target in ATTENTION and kind == "layer":
                    tp_divides.update(types[n].shape[1] for n in refs[:3] if len(types[n].shape) == 4)
            if out_split:
                column.update(op.results)
            if op.target not in VIEWS:
                c["flops"] += op.flops
                if split:
                    c["flops_tp"] += op.flops
                if op.target in MATMULS or op.target in ATTENTION:
                    c["mm"] += op.flops
            for r, t in zip(op.results, op.types):
                if r in saved:
                    itemsize = t.itemsize
                    if r in column:
                        c["atp"] += t.nbytes
                    else:
                        c["arep"] += t.nbytes
        out.append(
            UnitCost(
                kind=kind,
                label=label,
                flops=c["flops"] / batch,
                flops_tp=c["flops_tp"] / batch,
                mm_flops=c["mm"] / batch,
                params_tp=c["ptp"],
                params_rep=c["prep"],
                act_tp=c["atp"] / batch,
                act_rep=c["arep"] / batch,
                input_bytes=c["inb"] / batch,
                ar_fwd_bytes=arf[0] / batch,
                ar_fwd_count=arf[1],
                ar_bwd_bytes=arb[0] / batch,
                ar_bwd_count=arb[1],
            )
        )
    # activations saved in a unit but produced in an earlier one are the later unit's input: counted there
    return Profile(
        model=model,
        seq=seq,
        itemsize=itemsize,
        units=tuple(out),
        total_params=sum(v.type.numel for v in params.values()),
        tp_divides=tuple(sorted(tp_divides)),
    )


def _saved_for_backward(prog: Program, weights: set[str], commons: set[str]) -> set[str]:
    """Float op results some op needs in its backward pass (see the module docstring)."""
    types = prog.types()
    produced = {r for op in prog.ops for r in op.results}
    saved: set[str] = set()
    for op in prog.ops:
        refs = [r.name for r in op.input_refs()]
        if op.target in _SAVE_OUTPUT:
            saved.update(op.results)
        if op.target in _NO_SAVE:
            continue
        tensors = [n for n in refs if types[n].shape != ()]
        if op.target in _PRODUCTS and len(tensors) < 2:
            continue
        saved.update(refs)
    return {n for n in saved if n in produced and n not in weights and n not in commons and types[n].is_float}


# ---------------------------------------------------------------------------------------------
# Candidates


SCHEDULES = ("none", "1f1b", "interleaved", "wave", "scp")
RECOMPUTE = ("none", "full", "stage-aware")
ALPHA_GRID = 20  # stage-aware alpha_1 is searched in steps of 1/20


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration of the whole plan. Field order is the tie-break order of equal step times."""

    pp: int
    dp: int
    tp: int
    micro_batch: int  # samples per microbatch per data-parallel replica
    microbatches: int  # per pipeline per step
    schedule: str  # "none" (pp = 1: gradient accumulation), "1f1b", "interleaved", "wave", "scp"
    chunks: int = 1  # interleaved v
    waves: int = 0  # Hanayo W
    recompute: str = "none"  # "none", "full", "stage-aware"
    alpha1: int = 0  # stage-aware alpha_1 in 1/ALPHA_GRID
    zero: int = 0
    mics_group: int = 0  # 0: ZeRO over the whole dp group
    layout: str = "balanced"  # "balanced" (min-max FLOPs) or "even" (Megatron: L / S layers per stage)

    @property
    def num_stages(self) -> int:
        if self.schedule == "wave":
            return 2 * self.pp * self.waves
        return self.pp * self.chunks

    @property
    def shard_group(self) -> int:
        return self.mics_group or self.dp

    @property
    def alpha(self) -> Fraction:
        return Fraction(self.alpha1, ALPHA_GRID)

    def schedule_options(self) -> dict[str, Any]:
        """Keyword options of ``autopar.runtime.schedules.make_schedule`` for this candidate."""
        if self.schedule == "interleaved":
            return {"chunks": self.chunks}
        if self.schedule == "wave":
            return {"waves": self.waves}
        if self.schedule == "scp":
            return {"alpha1": self.alpha}
        if self.schedule == "1f1b" and self.recompute == "full":
            return {"recompute": 1}
        return {}

    def inner_mesh(self) -> dict[str, int]:
        """The axes the intra-op plan shards over, outermost first, size-1 axes left out: ``dp`` and
        ``tp``; with MiCS ``dpr`` (replicas of a partition group) and ``dp`` (the group)."""
        if self.mics_group:
            axes = {"dpr": self.dp // self.mics_group, "dp": self.mics_group, "tp": self.tp}
        else:
            axes = {"dp": self.dp, "tp": self.tp}
        return {a: n for a, n in axes.items() if n > 1} or {"dp": 1}

    def mesh(self) -> dict[str, int]:
        """The mesh to launch: ``pp`` outermost, then the inner mesh (Megatron's rank order)."""
        return ({"pp": self.pp} if self.pp > 1 else {}) | self.inner_mesh()

    def describe(self) -> str:
        sched = {
            "none": "no pipeline",
            "1f1b": "1f1b",
            "interleaved": f"interleaved v={self.chunks}",
            "wave": f"wave W={self.waves}",
            "scp": "scp",
        }[self.schedule]
        rc = self.recompute if self.recompute != "stage-aware" else f"stage-aware a1={float(self.alpha):.2f}"
        z = f"zero{self.zero}" + (f" mics{self.mics_group}" if self.mics_group else "")
        lay = " even" if self.layout == "even" else ""
        return f"pp{self.pp} dp{self.dp} tp{self.tp} b{self.micro_batch} m{self.microbatches} {sched}{lay}, {rc}, {z}"

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
    schedules: tuple[str, ...] = ("none", "1f1b", "interleaved", "wave", "scp")
    chunks: tuple[int, ...] = (2, 3, 4, 6, 8)
    waves: tuple[int, ...] = (1, 2)
    recompute: tuple[str, ...] = ("none", "full", "stage-aware")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    mics: bool = True  # also MiCS partition groups: divisors g of dp, node-aligned (see _node_aligned)
    mics_max_nodes: int = 8  # the largest MiCS group spans this many nodes
    devices_per_node: int = 8  # set from the cluster by the search
    pipeline_zero3: bool = False  # ZeRO-3 / MiCS-3 with pp > 1 (the pipeline runtime implements 1 and 2)
    layouts: tuple[str, ...] = ("balanced", "even")
    max_pp: int | None = None  # default: the number of layers


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int, profile: Profile, global_batch: int, space: SearchSpace) -> Iterator[tuple[int, int, int]]:
    """(pp, dp, tp) with pp dp tp = world, tp dividing the layers' heads and split dims, dp dividing B."""
    layers = profile.num_layers
    for tp in divisors(world):
        if (space.tp and tp not in space.tp) or not profile.tp_ok(tp):
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            if space.pp and pp not in space.pp or space.dp and dp not in space.dp:
                continue
            if pp > (space.max_pp or max(layers, 1)) or global_batch % dp:
                continue
            yield pp, dp, tp


# ---------------------------------------------------------------------------------------------
# Analytic evaluation


def inflight_counts(c: Candidate) -> list[float]:
    """Microbatches whose activations rank r holds at its peak (in units of one stage's microbatch).

    1F1B and pp = 1: min(pp - r, m) (pp = 1: one); SCP the same, except 3 on the penultimate rank
    (Merak Fig. 3c runs a third forward ahead); interleaved: the warm-up plus one,
    min(2 (pp - r - 1) + (v - 1) pp + 1, v m); waves: 2 W min(2 pp, m) (the wave schedule's in-flight
    cap is 2 pp microbatches). ``tests/test_search.py`` checks these against the simulator.
    """
    P, m = c.pp, c.microbatches
    if c.schedule == "none":
        return [1.0]
    if c.schedule == "1f1b":
        return [float(min(P - r, m)) for r in range(P)]
    if c.schedule == "scp":
        return [float(min(3 if r == P - 2 and P > 1 else P - r, m)) for r in range(P)]
    if c.schedule == "interleaved":
        v = c.chunks
        return [float(min(2 * (P - r - 1) + (v - 1) * P + 1, v * m)) for r in range(P)]
    if c.schedule == "wave":
        return [float(2 * c.waves * min(2 * P, m)) for _ in range(P)]
    raise ValueError(f"unknown schedule {c.schedule!r}")


@dataclass(frozen=True, order=True)
class Family:
    """A mesh and a micro-batch: the candidates sharing a step-time and a memory lower bound."""

    pp: int
    dp: int
    tp: int
    micro_batch: int
    microbatches: int


@dataclass(frozen=True)
class Chain:
    """Candidates of a family that differ only in ZeRO stage and recomputation.

    ``zeros`` ascend and ``levels`` go from the least recomputation to the most: memory falls and
    step time rises along both, so per ZeRO stage only the first level that fits is worth scoring,
    and a higher ZeRO stage only with strictly less recomputation (``autopar.search`` walks it).
    """

    base: Candidate
    zeros: tuple[int, ...]
    levels: tuple[tuple[str, int], ...]  # (recompute, alpha1)
    dominated: int = 0  # ZeRO-0 candidates left out (ZeRO-1: same time, less memory)
    unsupported: int = 0  # ZeRO-3 candidates left out with pp > 1

    def candidate(self, zero: int, level: int) -> Candidate:
        rc, a = self.levels[level]
        return dc_replace(self.base, zero=zero, recompute=rc, alpha1=a)

    @property
    def size(self) -> int:
        return len(self.zeros) * len(self.levels) + self.dominated + self.unsupported


def families(analytic: Analytic, space: SearchSpace, world: int) -> list[Family]:
    out = []
    for pp, dp, tp in meshes(world, analytic.p, analytic.B, space):
        per_replica = analytic.B // dp
        for b in divisors(per_replica):
            if not space.micro_batch or b in space.micro_batch:
                out.append(Family(pp, dp, tp, b, per_replica // b))
    return out


def max_shard(space: SearchSpace, fam: Family) -> int:
    """The strongest ZeRO stage the space allows for the family (for its memory lower bound)."""
    zs = [z for z in space.zero if z < 3 or fam.pp == 1 or space.pipeline_zero3]
    return max(zs, default=0) if fam.dp > 1 else 0


def chains(analytic: Analytic, space: SearchSpace, fam: Family) -> Iterator[Chain]:
    """Every chain of a family: schedule x chunks/waves x stage layout x MiCS group."""
    L = analytic.p.num_layers
    for sched, v, w in _schedules(fam.pp, L, space):
        levels = _levels(sched, space)
        if not levels:
            continue
        stages = 2 * fam.pp * w if sched == "wave" else fam.pp * v
        for layout in _layouts(space, sched):
            if layout == "even" and (
                L % stages or stages == 1 or analytic.even_layout(stages) == analytic.balanced_layout(stages)
            ):
                continue  # no even layout, or the same stages as the balanced one
            if layout == "balanced" and stages > analytic.n:
                continue
            for g, zeros, dominated, unsupported in _zeros(fam, space):
                base = Candidate(fam.pp, fam.dp, fam.tp, fam.micro_batch, fam.microbatches, sched, v, w,
                                 mics_group=g, layout=layout)  # fmt: skip
                n = len(levels)
                yield Chain(base, zeros, levels, dominated * n, unsupported * n)


def _schedules(pp: int, layers: int, space: SearchSpace) -> Iterator[tuple[str, int, int]]:
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


def _zeros(fam: Family, space: SearchSpace) -> Iterator[tuple[int, tuple[int, ...], int, int]]:
    """(MiCS group, ZeRO stages ascending, ZeRO-0 stages dominated, ZeRO-3 stages unsupported)."""
    if fam.dp == 1:
        yield 0, (0,), 0, 0
        return
    groups = [0] + ([g for g in divisors(fam.dp) if 1 < g < fam.dp and _node_aligned(g * fam.tp, space)]
                    if space.mics else [])  # fmt: skip
    for g in groups:
        zs = sorted(z for z in space.zero if z > 0 or (g == 0 and 1 not in space.zero))
        dominated = int(g == 0 and 0 in space.zero and 1 in space.zero)
        unsupported = 0
        if fam.pp > 1 and not space.pipeline_zero3:
            unsupported = sum(z >= 3 for z in zs)
            zs = [z for z in zs if z < 3]
        if zs:
            yield g, tuple(zs), dominated, unsupported


__all__ = [
    "ALPHA_GRID",
    "Candidate",
    "Profile",
    "SearchSpace",
    "UnitCost",
    "Chain",
    "Family",
    "chains",
    "families",
    "max_shard",
    "inflight_counts",
    "meshes",
    "profile_program",
]
