"""Profile a model for the search: capture it once with one sample and read per-layer costs from its IR.

The program is cut into units: ``pre`` (ops before the main layer stack, e.g. the embeddings), one
unit per layer of the stack (``transformer.h.N``, ``model.layers.N``), ``post`` (final norm, head,
loss). Per unit and per sample (``UnitCost``): forward FLOPs, parameters, bytes saved for backward,
bytes entering the unit, and the tensor-parallel all-reduces of Megatron's layout.

- Megatron's tensor parallelism is read off the IR (``solver/sharding/megatron_roles.py``, the one copy of the
  column/row detection): values between a column- and a row-parallel matmul are split over tp, so
  are their FLOPs and bytes. Each row-parallel output is all-reduced in the forward pass (Megatron's
  g), each distinct input of a column-parallel matmul in the backward pass (f); an embedding lookup
  of the largest table is vocabulary-parallel (forward all-reduce of its output). Matrices (2-D
  parameters) are split over tp, vectors are not.
- Saved activations: what autograd saves for backward, from ``solver/sharding/saved.py`` (the ILP's cost model
  reads the same): each storage some op keeps, counted in the unit whose op produced it (a layer's
  output saved by the next layer's norm is the layer's), plus the intermediates an op saves (a layer
  norm's mean and rstd, attention's logsumexp and float mask) in the op's unit; split over tp where the
  value (for an intermediate: the operand it lines up with, as ``solver/sharding/saved.py`` splits it) lies
  between Megatron's column- and row-parallel matmuls. Parameters and the batch are not activations.

``profile_model`` captures a model spec on the meta device and caches its profile on disk by spec
beside the plan cache (``$AUTOPAR_CACHE_DIR/../profiles``), so a second search skips the capture.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autopar.errors import PresetError
from autopar.ir.core import VIEW_OPS, MeshSpec, Op, Program
from autopar.models.presets import PRESETS
from autopar.models.resolve import build
from autopar.passes.batch_coupling import batch_couplings, batch_tail
from autopar.passes.lower import lower
from autopar.passes.pipeline_split import common_nodes
from autopar.passes.split_cache import cache_dir, write_atomic
from autopar.planner import capture_for_planning
from autopar.solver.cluster.compute import compiled_shares, op_work
from autopar.solver.sharding.experts import EP_BLOCK, EXPERT_GATHER, EXPERT_GROUPED_MM, exchange_sides
from autopar.solver.sharding.megatron_roles import (
    COLUMN,
    CONTRACTIONS,
    ROW,
    SPLIT,
    VOCAB,
    megatron_roles,
    weight_values,
)
from autopar.solver.sharding.saved import NOTHING, aligned_operand, op_saved, saved_values

PROFILE_VERSION = 16  # bump when what a profile holds or how it is read changes: cached profiles are then ignored
# 16: each work's rate classes as (class, fraction of its FLOPs) pairs (compute.Work.rated: a fused kernel's
# members' classes; 14-15: one class name)
# 15: each attention's queries, FLOPs and heads (the search prices ring attention and Ulysses beside the all-gather)
# 14: per-op works as a compiled run prices them (compute.compiled_shares: its kernel and its share) beside the eager
# ones (13: the share folded into the FLOPs, bytes and kernels); each work's rate class (compute.RATE_CLASSES)
# 12: a grouped matmul's all-to-alls by its place in its expert block
# 11: each unit's experts (their tables, count, routed rows and FLOPs) for the search's expert parallelism
# 10: the keys and values of each attention (what context parallelism all-gathers and keeps whole)
# 9: per-op works (solver/cluster/compute.py) in each unit
# 4: saved activations from solver/sharding/saved.py (what autograd saves), no longer a table of ops

ATTENTION = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention"})
SOFTMAX = frozenset({"aten.softmax.int", "aten._softmax"})
# ops that hand one tensor on as it is, reshaped or copied: the cp axis may all-gather anywhere along such a chain
_PASS_ON = VIEW_OPS | {"aten.clone", "aten.contiguous", "aten.to.dtype"}
_LAYER = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")

# ---------------------------------------------------------------------------------------------
# Per-unit costs read from the IR

# one op's ``compute.Work`` in a profile: (kind, FLOPs, bytes, m, n, k, kernels, split over tp, share, rated)
WorkRow = tuple[str, float, float, float, int, int, int, bool, float, tuple[tuple[str, float], ...]]


def _work(row: Any) -> WorkRow:
    """A work row read back from a profile's JSON form (lists for its tuples): hashable again."""
    *head, rated = row
    return (*head, tuple((str(c), float(f)) for c, f in rated))


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
    # bytes of the outputs of ops that read a weight: their gradients are what a split backward keeps
    # from B to W (runtime/execute/split_backward.py captures each where the weight's branch leaves the input path)
    wgrad_tp: float = 0.0
    wgrad_rep: float = 0.0
    # per Megatron f of the unit: (bytes its backward all-reduces, forward FLOPs of the column-parallel matmuls
    # reading it = their weight gradients' FLOPs), per sample: the runtime computes those weight gradients while
    # the all-reduce is in flight (runtime/comm/column_linear.py)
    ar_bwd_groups: tuple[tuple[float, float], ...] = ()
    # the unit's forward ops as the compute model prices them (solver/cluster/compute.py), per sample:
    # (kind, FLOPs, bytes at 4 per float, rows m, n, k, kernels, split over tp, share of the kernel, rate classes:
    # compute.Work's fields), one per non-view op
    works: tuple[WorkRow, ...] = ()
    # the same ops as a torch.compile'd run prices them (``compute.compiled_shares`` over the whole program: each
    # op its fused kernel's work and its share of that kernel), aligned with ``works``
    compiled_works: tuple[WorkRow, ...] = ()
    # context parallelism (``cp``, the all-gather form of ``solver/sharding/rules/context.py``): per sample, the
    # bytes of the keys and values the unit's SDPA calls read (each cp rank keeps them whole for the backward;
    # split over tp when they lie between Megatron's column- and row-parallel matmuls), the bytes the cp axis
    # all-gathers to make them (the smallest tensor of each one's chain of views and copies: before a
    # grouped-query repeat), and how many tensors are gathered (two per attention)
    kv_tp: float = 0.0
    kv_rep: float = 0.0
    kv_gather_tp: float = 0.0
    kv_gather_rep: float = 0.0
    kv_count: int = 0
    attentions: int = 0  # attention ops in the unit (SDPA and the eager softmax over [.., queries, keys] scores)
    # per sample, the bytes of the queries the unit's SDPA calls read (as kv_*: what ring attention's load
    # balancing exchanges half of, and Ulysses moves by all-to-all with the output), their forward FLOPs (what a
    # ring step's transfer runs beside), and each call's (query heads, key/value heads): what Ulysses splits
    q_tp: float = 0.0
    q_rep: float = 0.0
    attn_flops: float = 0.0
    attn_heads: tuple[tuple[int, int], ...] = ()
    # a mixture of experts' expert ops (solver/sharding/experts.py: grouped matmuls, gathers of expert tables):
    # the elements of the unit's expert tables (3-D parameters, also counted in params_tp), the number of experts,
    # per expert op (rows routed per sample, bytes per row an expert-parallel op sends there and back at 4 per
    # float, all-to-alls per forward), and the ops' forward FLOPs per sample (grouped matmuls: the experts' own)
    params_ep: int = 0
    experts: int = 0
    routed: tuple[tuple[float, float, int], ...] = ()
    expert_flops: float = 0.0

    def act(self, tp: int) -> float:
        return self.act_tp / tp + self.act_rep

    def kv(self, tp: int) -> float:
        return self.kv_tp / tp + self.kv_rep

    def params(self, tp: int) -> float:
        return self.params_tp / tp + self.params_rep

    def q(self, tp: int) -> float:
        return self.q_tp / tp + self.q_rep


@dataclass(frozen=True)
class Profile:
    """A model's units and the facts the search needs, per sample; saved as JSON in the profile cache."""

    model: str
    seq: int
    itemsize: int  # bytes per element of the program's floats (4 for a float32 capture)
    units: tuple[UnitCost, ...]  # pre, the layers in order, post
    total_params: int  # distinct parameter elements (a tied weight once)
    tp_divides: tuple[int, ...]  # sizes tp must divide (attention heads, split feature dims)
    # the ops that couple the batch (passes/batch_coupling.py): such a model runs exactly only as one microbatch
    coupled: tuple[str, ...] = ()
    # a batch tail makes them exact under the schedules that run every forward of the last stage before its
    # backwards (runtime/execute/batch_tail.py: TAIL_SCHEDULES, without recomputation)
    tail: bool = False
    version: int = PROFILE_VERSION

    @property
    def num_layers(self) -> int:
        return sum(u.kind == "layer" for u in self.units)

    @property
    def mm_flops(self) -> float:
        """Forward matmul and attention FLOPs per sample of the whole model."""
        return sum(u.mm_flops for u in self.units)

    @property
    def experts(self) -> int:
        """The experts of the model's mixtures of experts (the fewest of any unit that has some; 0: a dense
        model): what an expert-parallel degree must divide."""
        return min((u.experts for u in self.units if u.experts), default=0)

    def tp_ok(self, tp: int) -> bool:
        return all(d % tp == 0 for d in self.tp_divides)

    @property
    def cp_ready(self) -> bool:
        """Whether the search can price context parallelism: the model has attention and every attention is an
        SDPA call whose keys and values the profile found (an eager softmax(QK^T)V is not priced on cp)."""
        return any(u.attentions for u in self.units) and all(u.kv_count == 2 * u.attentions for u in self.units)

    def ulysses_ok(self, cp: int, tp: int) -> bool:
        """Whether Ulysses can split every attention's heads over ``cp`` beside ``tp``: each call's query and
        key/value heads divide by cp x tp (``solver/sharding/rules/context.py``: q, k, v split on the heads)."""
        calls = [h for u in self.units for h in u.attn_heads]
        return bool(calls) and all(q % (cp * tp) == 0 and k % (cp * tp) == 0 for q, k in calls)

    def cp_ok(self, cp: int) -> bool:
        """Whether ``cp`` ranks can split the sequence: it divides the sequence, and cp is priced (``cp_ready``)."""
        return cp == 1 or (self.cp_ready and self.seq % cp == 0 and self.seq >= cp)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        units = [
            dict(
                u,
                ar_bwd_groups=tuple(tuple(g) for g in u.get("ar_bwd_groups", ())),
                works=tuple(_work(w) for w in u.get("works", ())),
                compiled_works=tuple(_work(w) for w in u.get("compiled_works", ())),
                routed=tuple(tuple(r) for r in u.get("routed", ())),
                attn_heads=tuple(tuple(h) for h in u.get("attn_heads", ())),
            )
            for u in d["units"]
        ]
        d["units"] = tuple(UnitCost(**u) for u in units)
        d["tp_divides"] = tuple(d["tp_divides"])
        d["coupled"] = tuple(d.get("coupled", ()))
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
    types = prog.types()
    commons = common_nodes(prog)
    params = {v.name: v for v in prog.inputs if v.kind == "param"}
    weights = weight_values(prog)  # parameters and views or casts of them
    saved = saved_values(prog)
    grad = prog.requires_grad()
    held = {v.name for v in prog.inputs}  # parameters, buffers, the batch: not activations
    # the largest embedding table is the vocabulary (Megatron splits it over tp); position tables are not
    tables = [op.input_refs()[0].name for op in prog.ops if op.target == "aten.embedding" and op.input_refs()]
    tables = [n for n in tables if n in weights]
    vocab = max(tables, key=lambda n: (types[n].shape[0], n)) if tables else None
    role = dict(zip((id(op) for op in prog.ops), megatron_roles(prog.ops, weights, vocab)))
    split_values = {r for op in prog.ops if role[id(op)] in (COLUMN, SPLIT) for r in op.results}
    units = _units_of(prog)
    unit_of: dict[str, int] = {v.name: -1 for v in prog.inputs}
    producer = {r: op for op in prog.ops for r in op.results}
    for k, (_, _, ops) in enumerate(units):
        for op in ops:
            for r in op.results:
                unit_of[r] = k
    tp_divides: set[int] = set()
    shares = dict(zip(map(id, prog.ops), compiled_shares(prog.ops, types, "fp32")))  # a compiled run's op prices
    out: list[UnitCost] = []
    itemsize = 4
    for k, (kind, label, ops) in enumerate(units):
        c = dict(flops=0.0, flops_tp=0.0, mm=0.0, ptp=0, prep=0, atp=0.0, arep=0.0, inb=0.0, wtp=0.0, wrep=0.0,
                 kvtp=0.0, kvrep=0.0, kvgtp=0.0, kvgrep=0.0, kvn=0, attn=0, qtp=0.0, qrep=0.0, aflops=0.0)  # fmt: skip
        heads: list[tuple[int, int]] = []
        arf = [0.0, 0]
        arb = [0.0, 0]
        f_inputs: dict[str, list[float]] = {}  # f's input -> [bytes, its readers' forward FLOPs]
        works: list[tuple] = []
        fused: list[tuple] = []
        moe = _experts_of(ops, types, batch)
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
            r_ = role[id(op)]
            if r_ in (ROW, COLUMN):
                wshape = types[next(n for n in refs if n in weights)].shape
                # the dim tp splits: a row-parallel weight's input features, a column-parallel one's outputs
                dim = (0 if op.target == "aten.mm" else 1) if r_ == ROW else (1 if op.target == "aten.mm" else 0)
                if kind == "layer" and len(wshape) == 2:
                    tp_divides.add(wshape[dim])
            if r_ in (ROW, VOCAB):  # partial output all-reduced in the forward pass (g)
                arf[0] += op.types[0].nbytes
                arf[1] += 1
            elif r_ == COLUMN:  # its activation input's gradient all-reduced in the backward pass (f)
                for n in refs:
                    if n not in weights and n not in f_inputs:
                        f_inputs[n] = [types[n].nbytes, 0.0]
                        arb[0] += types[n].nbytes
                        arb[1] += 1
                    if n in f_inputs:
                        f_inputs[n][1] += op.flops
            elif op.target in ATTENTION and kind == "layer":
                tp_divides.update(types[n].shape[1] for n in refs[:3] if len(types[n].shape) == 4)
            if op.target in ATTENTION and len(refs) >= 3:
                c["attn"] += 1
                for n in refs[1:3]:  # the keys and the values: whole on every cp rank
                    tag = "tp" if n in split_values else "rep"
                    c["kv" + tag] += types[n].nbytes
                    c["kvg" + tag] += _gathered_bytes(n, producer, types)
                    c["kvn"] += 1
                c["q" + ("tp" if refs[0] in split_values else "rep")] += types[refs[0]].nbytes
                c["aflops"] += op.flops
                qt, kt = types[refs[0]], types[refs[1]]
                if len(qt.shape) == 4 and len(kt.shape) == 4:
                    heads.append((qt.shape[1], kt.shape[1]))
            elif op.target in SOFTMAX and len(op.types[0].shape) == 4:
                c["attn"] += 1  # an eager attention: its keys and values not recognized (no cp priced)
            if op.target not in VIEW_OPS:
                eager = op_work(op, types, "fp32")  # bytes at 4 per float: StageTerms scales them to the training dtype
                for w, into in ((eager, works), (shares[id(op)], fused)):  # compiled: its kernel's work and its share
                    into.append(
                        (w.kind, w.flops / batch, w.bytes / batch, w.m / batch, w.n, w.k, w.ops, bool(r_), w.share,
                         w.rated)
                    )  # fmt: skip
                c["flops"] += op.flops
                if r_:
                    c["flops_tp"] += op.flops
                if op.target in CONTRACTIONS or op.target in ATTENTION:
                    c["mm"] += op.flops
            if any(n in weights for n in refs) and op_saved(op, types, grad) != NOTHING:
                # a weight op's output (not a cast of the weight); one whose backward needs nothing (a bias
                # added) hands the incoming gradient on as it is: the same tensor as its producer's, counted there
                for r, t in zip(op.results, op.types):
                    if r not in weights and t.is_float:
                        c["wtp" if r in split_values else "wrep"] += t.nbytes
            # what autograd keeps: the saved storages this op produced, and the intermediates it saves
            for r, t in zip(op.results, op.types):
                if saved.activation(r) and r not in held:
                    itemsize = t.itemsize if t.is_float else itemsize
                    c["atp" if r in split_values else "arep"] += t.nbytes
            names = refs + list(op.results)
            operands = [types[n] for n in names]
            for shape, nbytes in saved.extra.get(op.result, ()):  # split as the operand it lines up with
                c["atp" if names[aligned_operand(shape, operands)[0]] in split_values else "arep"] += nbytes
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
                wgrad_tp=c["wtp"] / batch,
                wgrad_rep=c["wrep"] / batch,
                ar_bwd_groups=tuple((nbytes / batch, flops / batch) for nbytes, flops in f_inputs.values()),
                works=tuple(works),
                compiled_works=tuple(fused),
                kv_tp=c["kvtp"] / batch,
                kv_rep=c["kvrep"] / batch,
                kv_gather_tp=c["kvgtp"] / batch,
                kv_gather_rep=c["kvgrep"] / batch,
                kv_count=c["kvn"],
                attentions=c["attn"],
                q_tp=c["qtp"] / batch,
                q_rep=c["qrep"] / batch,
                attn_flops=c["aflops"] / batch,
                attn_heads=tuple(heads),
                params_ep=sum(params[n].type.numel for n in seen_params if len(params[n].type.shape) == 3)
                if moe[0]
                else 0,
                experts=moe[0],
                routed=moe[1],
                expert_flops=moe[2],
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
        coupled=tuple(c.describe() for c in batch_couplings(prog) if c.certain),
        tail=batch_tail(prog) is not None,
    )


def _gathered_bytes(name: str, producer: dict[str, Op], types: dict) -> float:
    """The bytes the cp axis all-gathers to give an attention the whole ``name`` (its keys or values): the
    smallest tensor along the chain of views and copies that makes it (a grouped-query attention's keys before
    their heads are repeated), as the ILP places the all-gather where it moves least."""
    best = types[name].nbytes
    op = producer.get(name)
    while op is not None and op.target in _PASS_ON:
        ins = [r.name for r in op.input_refs()]
        if len(ins) != 1:
            break
        best = min(best, types[ins[0]].nbytes)
        op = producer.get(ins[0])
    return best


def _experts_of(ops: list[Op], types: dict, batch: int) -> tuple[int, tuple[tuple[float, float, int], ...], float]:
    """(experts, per expert op (rows per sample, bytes per row there and back at 4 per float, all-to-alls per
    forward), the grouped matmuls' forward FLOPs per sample) of a unit's expert ops: grouped matmuls
    ``(x[S, K], w[E, K, N], offs)``, of which a block's first sends each row there at K and its last back at N
    (one dispatch and one combine per MoE layer), and gathers of 3-D expert tables by 1-D indices (the
    batched_mm kernel), which send each row at the table's last width."""
    experts, routed, flops = 0, [], 0.0
    for op in ops:
        ins = [types[r.name] for r in op.input_refs()]
        if op.target in EXPERT_GROUPED_MM and len(ins) == 3 and len(ins[0].shape) == 2 and len(ins[1].shape) == 3:
            (rows, k), (e, _, n) = ins[0].shape, ins[1].shape
            experts = min(experts or e, e)
            # by its place in its expert block (passes/lower.py marks it): the first dispatches the rows, the
            # last combines the results, one alone does both (solver/sharding/experts.py grouped_price)
            sides = exchange_sides(op.attrs.get(EP_BLOCK))
            width = (k if "in" in sides else 0) + (n if "out" in sides else 0)
            if sides:
                routed.append((rows / batch, 4.0 * width, len(sides)))
            flops += op.flops / batch
        elif op.target == EXPERT_GATHER and len(ins) == 2 and len(ins[0].shape) == 3 and len(ins[1].shape) == 1:
            experts = min(experts or ins[0].shape[0], ins[0].shape[0])
            routed.append((ins[1].shape[0] / batch, 4.0 * ins[0].shape[-1], 1))
    return experts, tuple(routed), flops


# ---------------------------------------------------------------------------------------------
# Profiles of model specs (one capture per spec, cached)


def with_batch(spec: str, batch: int) -> str:
    """The MODEL string with its example batch set to ``batch`` (presets only)."""
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
        raise PresetError(
            f"the search sets the example batch through the preset override batch=N; {spec!r} is not a "
            "preset: plan it with --mesh, or wrap it as a preset-like function taking the batch"
        )
    items = [s.strip() for s in rest.split(",") if s.strip() and not s.strip().startswith("batch=")]
    return f"{name}:" + ",".join(items + [f"batch={batch}"])


def with_seq(spec: str, seq: int) -> str:
    """The MODEL string with its sequence length set to ``seq`` (presets only: ``autopar plan --seq-len``)."""
    name, _, rest = spec.partition(":")
    if name not in PRESETS:
        raise PresetError(
            f"--seq-len sets a preset's sequence through its override seq=N; {spec!r} is not a preset: give the "
            "sequence in the model's own example inputs"
        )
    if seq < 1:
        raise PresetError(f"--seq-len must be positive, not {seq}")
    items = [s.strip() for s in rest.split(",") if s.strip() and not s.strip().startswith("seq=")]
    extra = [f"seq={seq}"]
    preset = PRESETS[name]
    limit = preset.config.get("max_position_embeddings")
    given = any(s.startswith("max_position_embeddings=") for s in items)
    if preset.family in _ROTARY and limit is not None and limit < seq and not given:
        extra.append(f"max_position_embeddings={seq}")  # rotary positions: no table to grow, only the limit
    return f"{name}:" + ",".join(items + extra)


_ROTARY = ("llama", "mixtral", "qwen3_moe", "deepseek_v3")  # preset families whose positions are rotary


_PROFILES: dict[str, Profile] = {}


def profile_model(spec: str, cache: bool = True) -> Profile:
    """Capture ``spec`` with one sample on the meta device and read its per-unit costs (cached)."""
    one = with_batch(spec, 1)
    try:  # deferred: transformers is optional (the hf extra); its version is part of the cache key
        import transformers

        tv = transformers.__version__
    except ImportError:  # pragma: no cover - the presets need transformers
        tv = ""
    key = hashlib.sha256(f"{one}|{torch.__version__}|{tv}|{PROFILE_VERSION}".encode()).hexdigest()[:24]
    if cache and key in _PROFILES:
        return _PROFILES[key]
    d = cache_dir("profiles") if cache else None
    path = d / f"{key}.json" if d else None
    if path is not None and path.exists():
        try:
            prof = Profile.from_dict(json.loads(path.read_text()))
            _PROFILES[key] = prof
            return prof
        except (ValueError, TypeError, KeyError):
            pass  # a stale or damaged entry: capture again
    m = build(one, device="meta")
    prog = lower(capture_for_planning(m.model, m.args, m.kwargs), MeshSpec())
    seq = next((v.type.shape[1] for v in prog.inputs if v.kind == "input" and len(v.type.shape) >= 2), 0)
    prof = profile_program(prog, batch=1, model=spec, seq=seq)
    if cache:
        _PROFILES[key] = prof
    if path is not None:
        write_atomic(path, json.dumps(prof.to_dict()))
    return prof


__all__ = ["PROFILE_VERSION", "Profile", "UnitCost", "profile_model", "profile_program", "with_batch", "with_seq"]
