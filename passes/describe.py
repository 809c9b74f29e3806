"""What a planned program does with each mesh axis, in one short block of text: what ``autopar.compile`` logs
(logger ``autopar``, rank 0), the compiled module's ``repr`` and ``autopar plan`` print.

    plan on mesh [dp=2, tp=2] (roles by name)
      dp=2: data parallel: batch split, weights replicated; gradients of 27 parameters all-reduced in 1 bucket; ZeRO-1
      tp=2: tensor parallel (Megatron): column/row on 5/4 matmuls, 2 embedding tables split by vocabulary, 14 of 28
            parameters sharded                                              (one line in the log, wrapped here)
      predicted: 1.07 MiB per device, step 0.095 ms

Read off the program's placements, not from what was asked, so an axis the plan leaves unused (every rank of it
computes the same) or uses as data parallelism whatever its name says is reported as such. A contraction whose
weight is sharded on an axis is column-parallel there when its result is split, row-parallel when its result is a
partial sum. A mixture of experts' tables (``roles.expert_reads``) are told apart from its dense weights: an axis
that splits them on their experts is expert parallel where an expert op reads them so with its rows split (the
rows then go to their experts' ranks and back by all-to-all, ``passes/experts.py``), and its dense layers are
described on their own (replicated, data parallel, or their matmuls' column/row split):

      ep=2: expert parallel: 2 expert tables split on their experts (2 of 4 a rank), tokens sent to their
            experts' ranks and back by all-to-all at 2 expert ops; dense layers data parallel: batch split,
            weights replicated; gradients of 12 parameters all-reduced in 1 bucket
"""

from __future__ import annotations

from autopar.ir.axes import PIPELINE_AXIS, is_pipeline_axis, is_tensor_axis
from autopar.ir.core import MeshSpec, Op, Partial, Program, Shard, TensorType
from autopar.passes.shard import required_inputs
from autopar.solver.sharding.buckets import grad_buckets
from autopar.solver.sharding.experts import EXPERT_GROUPED_MM, expert_axes, grouped_expert_axes
from autopar.solver.sharding.megatron_roles import CONTRACTIONS, param_origins, weight_values
from autopar.solver.sharding.roles import expert_reads

ROLES_TEXT = {"name": "roles by name", "auto": "roles chosen by the ILP"}


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (KiB at least)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _read(op: Op, types: dict[str, TensorType]) -> list:
    """The placements ``op`` reads its inputs at: the shard pass's ``in`` where it recorded one, else the values'."""
    asked = required_inputs(op) if "in" in op.attrs else []
    refs = [r.name for r in op.input_refs()]
    return [asked[k] if k < len(asked) and asked[k] is not None else types[r].placements for k, r in enumerate(refs)]


def _experts(prog: Program, i: int, types: dict[str, TensorType]) -> tuple[str, set[str]]:
    """What the plan does with a mixture of experts' tables on mesh axis ``i`` ("" where it splits none on their
    experts), and the tables."""
    reads = expert_reads(prog)
    tables = {t for _, t in reads}
    split = sorted(t for t in tables if types[t].placements[i] == Shard(0))
    if not split:
        return "", tables
    size = prog.mesh.axes[i][1]
    counts = sorted({types[t].shape[0] for t in split})
    per_rank = ", ".join(f"{e // size} of {e}" for e in counts)
    head = f"{_plural(len(split), 'expert table')} split on their experts ({per_rank} a rank)"
    parallel = 0
    for op, _ in reads:
        ins = [types[r.name] for r in op.input_refs()]
        axes = (grouped_expert_axes if op.target in EXPERT_GROUPED_MM else expert_axes)(ins, _read(op, types))
        parallel += i in axes
    if parallel:
        moved = f"tokens sent to their experts' ranks and back by all-to-all at {_plural(parallel, 'expert op')}"
        return f"expert parallel: {head}, {moved}", tables
    return f"{head}, gathered whole where read (no tokens sent)", tables


def describe_axis(prog: Program, i: int, bucket_bytes: float, zero: int = 0, zero_axes: tuple[str, ...] = ()) -> str:
    """One line: what the plan ``prog`` does on its mesh axis ``i`` (see the module docstring)."""
    name, size = prog.mesh.axes[i]
    head = f"{name}={size}"
    if size == 1:
        return f"{head}: unused (size 1)"
    params = [v for v in prog.inputs if v.kind == "param"]
    inputs = [v for v in prog.inputs if v.kind == "input" and v.type.shape]
    sharded = [v for v in params if isinstance(v.type.placements[i], Shard)]
    split_inputs = [v for v in inputs if v.type.placements[i] == Shard(0)]
    types = prog.types()
    experts, expert_tables = _experts(prog, i, types)
    weights = weight_values(prog)
    origin = param_origins(prog) if expert_tables else {}
    dense_weights = {w for w in weights if origin.get(w) not in expert_tables}  # an expert's matmul is not dense
    column = row = 0
    for op in prog.ops:
        if op.target not in CONTRACTIONS:
            continue
        refs = [r.name for r in op.input_refs()]
        if not any(r in dense_weights and isinstance(types[r].placements[i], Shard) for r in refs):
            continue
        out = op.types[0].placements[i]
        column += isinstance(out, Shard)
        row += isinstance(out, Partial)
    vocab = sum(
        1
        for op in prog.ops
        if op.target == "aten.embedding"
        and op.input_refs()
        and op.input_refs()[0].name in weights
        and types[op.input_refs()[0].name].placements[i] == Shard(0)
    )
    synced = [v for v in params if name in v.attrs.get("grad_sync", ())]
    buckets = sum(b.axis == name for b in grad_buckets(prog, bucket_bytes)) if synced else 0
    what = [f"column/row on {column}/{row} matmuls"] if column + row else []
    if vocab:
        what.append(f"{_plural(vocab, 'embedding table')} split by vocabulary")
    parts = []
    if experts:  # the expert tables' layout, then the dense layers' own
        parts.append(experts)
        dense = [v for v in sharded if v.name not in expert_tables]
        if dense:
            what.append(f"{len(dense)} of {_plural(len(params) - len(expert_tables), 'dense parameter')} sharded")
            parts.append(f"dense layers {'tensor parallel' if column + row else 'sharded'}: {', '.join(what)}")
        else:
            parts.append("dense layers data parallel: batch split, weights replicated" if split_inputs else
                         "dense weights replicated")  # fmt: skip
            split_inputs = []  # said
    elif sharded:
        kind = "tensor parallel (Megatron)" if column + row else "parameters sharded"
        what.append(f"{len(sharded)} of {_plural(len(params), 'parameter')} sharded")
        parts.append(f"{kind}: {', '.join(what)}")
    if split_inputs:
        dp = "data parallel: " if not sharded else ""
        parts.append(f"{dp}batch split" + (", weights replicated" if not sharded else ""))
    if synced:
        parts.append(f"gradients of {_plural(len(synced), 'parameter')} all-reduced in {_plural(buckets, 'bucket')}")
    zero_text = f"ZeRO-{zero}" if zero and name in zero_axes else ""
    if not parts:
        activations = any(isinstance(p, Shard) for op in prog.ops for t in op.types for p in t.placements[i : i + 1])
        if activations:
            line = f"{head}: activations split (weights and inputs replicated)"
        else:
            line = f"{head}: unused: every rank of it computes the same (everything replicated)"
        return line + (f"; {zero_text} shards the optimizer states over it" if zero_text else "")
    line = f"{head}: {'; '.join(parts + ([zero_text] if zero_text else []))}"
    if is_tensor_axis(name) and not sharded and split_inputs:
        line += f" (used as data parallelism although named {name})"
    return line


def describe_plan(
    prog: Program,
    bucket_bytes: float = 25 * 2**20,
    zero: int = 0,
    zero_axes: tuple[str, ...] = (),
    pipeline: str | None = None,
    pipeline_size: int = 1,
) -> str:
    """The block of text for the planned program ``prog`` (see the module docstring). ``pipeline``: how the
    ``pp`` axis of ``pipeline_size`` ranks runs (stages, schedule), when the mesh has one (a stage's program is
    planned on the mesh without it)."""
    roles = prog.attrs.get("roles")
    mesh = prog.mesh
    if pipeline_size > 1 and PIPELINE_AXIS not in mesh.names:
        mesh = MeshSpec(((PIPELINE_AXIS, pipeline_size), *mesh.axes))
    how = f"; {prog.attrs['plan_how']}" if prog.attrs.get("plan_how") else ""
    lines = [f"plan on mesh {mesh}" + (f" ({ROLES_TEXT[roles]}{how})" if roles in ROLES_TEXT else "")]
    if PIPELINE_AXIS not in prog.mesh.names and pipeline_size > 1:
        lines.append(f"  {PIPELINE_AXIS}={pipeline_size}: pipeline" + (f": {pipeline}" if pipeline else ""))
    for i, (name, size) in enumerate(prog.mesh.axes):
        if is_pipeline_axis(name):
            lines.append(f"  {name}={size}: pipeline" + (f": {pipeline}" if pipeline else ""))
            continue
        lines.append("  " + describe_axis(prog, i, bucket_bytes, zero, zero_axes))
    memory, step = prog.attrs.get("predicted_memory_bytes"), prog.attrs.get("predicted_step_ms")
    if memory is not None and step is not None:
        whole = " (the whole model on the non-pp axes; each stage holds its share)" if mesh.pipeline_size > 1 else ""
        lines.append(f"  predicted: {format_bytes(memory)} per device, step {step:.3g} ms{whole}")
    return "\n".join(lines)


__all__ = ["describe_axis", "describe_plan"]
