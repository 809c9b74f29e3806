"""Baseline strategies priced by the same cost model: Megatron, data parallel, ZeRO-2/3, Alpa's objective.

Each baseline fixes how parameters and inputs are stored and lets the ILP (objective: least
communication) place everything else, so it gets the cheapest execution of that storage choice:

- ``megatron``: on axes named ``tp*``, Megatron-LM's hand strategy (Shoeybi et al. 2019): the
  QKV and MLP-up projections column-parallel (output features split; a fused QKV per head), the
  attention-output and MLP-down projections row-parallel (input features split), embeddings and
  the output layer vocabulary-parallel, norms and other weights replicated; every other axis data
  parallel (batch split, weights replicated).
- ``dp``: every axis data parallel; ``zero2`` / ``zero3``: the same with ZeRO stage 2 / 3 over all
  axes (gradients and optimizer states, plus weights for stage 3, sharded over data parallel).
- ``comm``: no constraint, least communication time within the budget (Alpa's objective).

Embedding tables are split by vocabulary on the tp axes, as Megatron's VocabParallelEmbedding.
"""

from __future__ import annotations

import re
from dataclasses import replace

from autopar.passes.ir import Placement, Program, R, Replicate, Shard
from autopar.passes.layout import valid
from autopar.passes.shard import ShardOptions, ShardResult, shard
from autopar.solver.cost import TrainingSetup

BASELINES = ("megatron", "dp", "zero2", "zero3", "comm")

_COLUMN = re.compile(
    r"(c_attn|q_proj|k_proj|v_proj|query|key|value|qkv|gate_proj|up_proj|c_fc|fc1|w1|w3|intermediate\.dense|lm_head)$"
)
_ROW = re.compile(r"(c_proj|o_proj|out_proj|down_proj|fc2|w2|wo|output\.dense|dense)$")
_FUSED_QKV = re.compile(r"(c_attn|qkv)$")


def megatron_layout(prog: Program) -> dict[str, tuple[str, int, int]]:
    """Parameter name -> ("column" | "row", tensor dim to shard, chunks) for Megatron's strategy."""
    layout: dict[str, tuple[str, int, int]] = {}
    readers = prog.users()
    for v in prog.params:
        module, _, kind = v.name.rpartition(".")
        users = readers[v.name]
        if any(u.target == "aten.embedding" for u in users) and kind == "weight":
            layout[v.name] = ("vocab", 0, 1)  # vocab-parallel embedding (and the tied output layer)
            continue
        role = "column" if _COLUMN.search(module) else "row" if _ROW.search(module) else None
        if role is None:
            continue
        # nn.Linear keeps W as [out, in] (aten.linear); HF Conv1D as [in, out] (aten.mm / addmm)
        transposed = any(u.target == "aten.mm" for u in users)
        out_dim = 1 if transposed else 0
        chunks = 3 if _FUSED_QKV.search(module) else 1
        if kind == "bias":
            if role == "column":
                layout[v.name] = ("column", 0, chunks)
            continue
        if len(v.type.shape) != 2:
            continue
        dim = out_dim if role == "column" else 1 - out_dim
        layout[v.name] = (role, dim, chunks if role == "column" else 1)
    return layout


def megatron_constraints(prog: Program) -> dict:
    names = prog.mesh.names
    tp = [i for i, n in enumerate(names) if n.startswith("tp")]
    layout = megatron_layout(prog)
    out: dict = {}
    for v in prog.inputs:
        if v.kind == "param":
            want = [R] * len(names)
            if v.name in layout:
                _, dim, chunks = layout[v.name]
                for i in tp:
                    want[i] = Shard(dim, chunks)
            # a weight too small to split over the tp axes stays replicated, as Megatron's would
            target = tuple(want) if valid(tuple(want), v.type.shape, prog.mesh.sizes) else (R,) * len(names)
            out[v.name] = _exactly(target)
        elif v.kind == "input":
            out[v.name] = _batch_on(tuple(i for i in range(len(names)) if i not in tp), len(names))
    return out


def _exactly(want: tuple[Placement, ...]):
    return lambda p: p == want


def _batch_on(axes: tuple[int, ...], n: int):
    want = tuple(Shard(0) if i in axes else R for i in range(n))
    return lambda p: p == want


def data_parallel_constraints(prog: Program) -> dict:
    n = len(prog.mesh.axes)
    out: dict = {}
    for v in prog.inputs:
        if v.kind == "param":
            out[v.name] = lambda p: all(isinstance(q, Replicate) for q in p)
        elif v.kind == "input":
            out[v.name] = _batch_on(tuple(range(n)), n)
    return out


def run_baseline(prog: Program, name: str, opts: ShardOptions) -> ShardResult:
    """Solve the program under a baseline's constraints with the same cost model as autopar."""
    comm = replace(opts, objective="comm", budget_bytes=None)
    all_axes = prog.mesh.names
    if name == "megatron":
        return shard(prog, replace(comm, constrain=megatron_constraints(prog)))
    if name == "dp":
        return shard(prog, replace(comm, constrain=data_parallel_constraints(prog)))
    if name in ("zero2", "zero3"):
        setup = replace(opts.setup, zero=int(name[-1]), zero_axes=all_axes)
        return shard(prog, replace(comm, constrain=data_parallel_constraints(prog), setup=setup))
    if name == "comm":
        return shard(prog, replace(opts, objective="comm"))
    raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")


def run_baselines(prog: Program, opts: ShardOptions, names=BASELINES) -> dict[str, ShardResult]:
    return {n: run_baseline(prog, n, opts) for n in names}


__all__ = [
    "BASELINES",
    "megatron_layout",
    "megatron_constraints",
    "run_baseline",
    "run_baselines",
    "TrainingSetup",
]
