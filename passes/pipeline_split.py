"""Pass pipeline-split: cut a program into a sequence of subgraphs with few tensors crossing each cut.

This is Merak's graph sharding (Alg. 1 "dependency search" and Alg. 2 "graph sharding") on the
autopar IR. Ops stay in program (topological) order and every subgraph is a contiguous run of them,
so the subgraphs executed in order compute exactly what the whole program computes.

Vocabulary (see docs/pipeline.md for the worked GPT-2 example):

- **gap g**: the place between op g-1 and op g (1 <= g < n).
- **free inputs**: parameters, buffers and user inputs. They never cross a cut: each subgraph reads
  the ones it uses (parameters live on the stage, the data loader feeds inputs to the stage that
  needs them). A parameter read by several subgraphs (a tied embedding) is listed in each.
- **common nodes**: op results no gradient flows through, i.e. computed only from user inputs,
  buffers and constants (attention masks, position ids, rotary cos/sin). Merak lets common nodes
  "pass among subgraphs" instead of blocking cuts; it picks them by user count (more users than
  layers). Here the test is structural: a common node needs only a forward transfer, never a
  gradient back, and it includes every mask or rotary table a layer stack shares.
- **crossing set X(g)**: results of ops before g that are not common nodes and are used at or after
  g (or are program outputs). ``|X(g)|`` is the *level* of the gap, the number of tensors that must
  be sent forward and whose gradients come back. Common nodes still live at g are counted apart.

Algorithm 1 (dependency search) becomes one linear liveness sweep: the level of every gap is a
difference array over the live intervals [definition, last use] of non-common values. Merak's rule
"a node stays with its farthest dependency unless that dependency is the last node" is a cut at
level 1. Algorithm 2 (graph sharding) becomes the choice among legal gaps:

1. cut at every level-1 gap (Merak's single-tensor rule);
2. a segment that level 1 leaves too coarse is re-cut at its gaps of level 2, then 3, up to
   ``max_crossing``: one with more than ``oversize`` times the median FLOPs of the non-light
   segments (a stretch a long skip connection keeps whole; 4 lies above the ratio of a LLaMA MLP to
   its attention, about 3.2, which must not be re-cut), or one that the deeper gaps split into
   ``pieces`` or more non-light pieces (a whole T5 encoder, held together by the relative position
   bias every layer reads; a transformer block has at most 3 such pieces);
3. light segments (under ``light`` times the largest segment's FLOPs: masks, views, layer norms,
   the loss) are merged into a neighbour so that every subgraph carries real work: a run between
   two heavy segments joins the one whose boundary op shares the longer module path (ties: the
   next). A light run at the start or end holding at least a quarter of the median parameters of
   the heavy segments (the embeddings) stays a subgraph of its own, as Merak's implementation
   gives embeddings a shard of their own.

For HF GPT-2 with L layers this gives 2L + 2 subgraphs: embeddings (with the mask building), the
attention and MLP half of each block, and the head (lm_head and the loss), with one tensor (the
residual stream) crossing every cut plus one common node (the causal mask) passed along.

The result (``passes/subgraphs.py``) is cached by a fingerprint of the program
(``passes/split_cache.py``): in-process and as JSON under ``$AUTOPAR_CACHE_DIR`` (default
``~/.cache/autopar/plans``; ``off``, ``0`` or empty disables disk). Stages are assigned to the
subgraphs by the next pass, ``autopar.passes.assign_stages``.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import PipelineError
from autopar.ir.core import Op, Program, Value, iter_refs
from autopar.passes.split_cache import cached_split, program_fingerprint, remember_split
from autopar.passes.subgraphs import Split, SplitOptions, Subgraph, annotate

# ---------------------------------------------------------------------------------------------
# Liveness (Algorithm 1 as a sweep)


@dataclass
class _Liveness:
    """Per SSA value: the op index defining it, its last use (n = program output), common or not."""

    n: int
    defined: dict[str, int] = field(default_factory=dict)
    last_use: dict[str, int] = field(default_factory=dict)
    common: set[str] = field(default_factory=set)
    free: dict[str, Value] = field(default_factory=dict)  # graph inputs
    first_param_use: dict[str, int] = field(default_factory=dict)


def _liveness(prog: Program) -> _Liveness:
    n = len(prog.ops)
    live = _Liveness(n, free={v.name: v for v in prog.inputs})
    grad = {v.name for v in prog.inputs if v.kind == "param"}  # values a gradient flows through
    for i, op in enumerate(prog.ops):
        refs = op.input_refs()
        carries = False
        for r in refs:
            live.last_use[r.name] = i
            carries = carries or r.name in grad
            if r.name in live.free and r.name not in live.first_param_use:
                live.first_param_use[r.name] = i
        for res in op.results:
            live.defined[res] = i
            if carries:
                grad.add(res)
            else:
                live.common.add(res)
    for r in iter_refs(prog.outputs):
        live.last_use[r.name] = n
    return live


def _levels(live: _Liveness) -> list[int]:
    """level[g] = |X(g)| for g in 0..n (entries 0 and n unused)."""
    diff = [0] * (live.n + 2)
    for name, d in live.defined.items():
        u = live.last_use.get(name, d)
        if u > d and name not in live.common:
            diff[d + 1] += 1
            diff[u + 1] -= 1
    level, acc = [0] * (live.n + 1), 0
    for g in range(live.n + 1):
        acc += diff[g]
        level[g] = acc
    return level


# ---------------------------------------------------------------------------------------------
# Choosing the cuts (Algorithm 2)


def _segments(cuts: list[int], n: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _common_prefix(a: str, b: str) -> int:
    k = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y or not x:
            break
        k += 1
    return k


def _choose_cuts(prog: Program, live: _Liveness, level: list[int], opts: SplitOptions) -> list[int]:
    n = len(prog.ops)
    fpre = [0]
    for op in prog.ops:
        fpre.append(fpre[-1] + op.flops)
    ppre = [0] * (n + 1)
    for name, i in live.first_param_use.items():
        if live.free[name].kind == "param":
            ppre[i + 1] += live.free[name].type.numel
    for i in range(n):
        ppre[i + 1] += ppre[i]

    def flops(seg: tuple[int, int]) -> int:
        return fpre[seg[1]] - fpre[seg[0]]

    def params(seg: tuple[int, int]) -> int:
        return ppre[seg[1]] - ppre[seg[0]]

    cuts = [g for g in range(1, n) if level[g] <= 1]
    for depth in range(2, opts.max_crossing + 1):
        segs = _segments(cuts, n)
        f = [flops(s) for s in segs]
        fmax = max(f)
        heavy = [x for x in f if x >= opts.light * fmax] or [0]
        ref = statistics.median(heavy)
        extra = []
        for seg, x in zip(segs, f):
            inner = [g for g in range(seg[0] + 1, seg[1]) if level[g] <= depth]
            bounds = [seg[0], *inner, seg[1]]
            pieces = sum(flops(p) >= opts.light * fmax for p in zip(bounds, bounds[1:]))
            if x > opts.oversize * ref or pieces >= opts.pieces or (len(heavy) == 1 and x == fmax):
                extra += inner
        cuts = sorted(set(cuts) | set(extra))

    # merge light segments into neighbours: groups of segment indices, one group per subgraph
    segs = _segments(cuts, n)
    f = [flops(s) for s in segs]
    fmax = max(f)
    light = [x < opts.light * fmax or fmax == 0 for x in f]
    typical = statistics.median([params(s) for s, lt in zip(segs, light) if not lt] or [0])
    groups: list[list[int]] = []
    waiting: list[int] = []  # a light run that joins the next heavy segment
    i = 0
    while i < len(segs):
        if not light[i]:
            groups.append([*waiting, i])
            waiting = []
            i += 1
            continue
        j = i
        while j < len(segs) and light[j]:
            j += 1
        run = list(range(i, j))
        own = params((segs[i][0], segs[j - 1][1])) >= max(1, 0.25 * typical)
        if (i == 0 and j == len(segs)) or ((i == 0 or j == len(segs)) and own):
            groups.append(run)  # the embeddings (or a parameter-holding tail): a subgraph of their own
        elif i > 0 and (j == len(segs) or not _merge_forward(prog, segs[i - 1], segs[i], segs[j - 1], segs[j])):
            groups[-1].extend(run)
        else:
            waiting = run
        i = j
    return [segs[g[0]][0] for g in groups[1:]]


def _merge_forward(
    prog: Program,
    before: tuple[int, int],
    run_first: tuple[int, int],
    run_last: tuple[int, int],
    after: tuple[int, int],
) -> bool:
    """Whether a light run between two heavy segments joins the one after it: the side whose
    boundary op shares the longer module path with the run's boundary op wins; ties go forward."""

    def path(i: int, step: int, stop: int) -> str:
        while i != stop:
            if prog.ops[i].path:
                return prog.ops[i].path
            i += step
        return ""

    back = _common_prefix(path(before[1] - 1, -1, before[0] - 1), path(run_first[0], 1, run_last[1]))
    fwd = _common_prefix(path(run_last[1] - 1, -1, run_first[0] - 1), path(after[0], 1, after[1]))
    return fwd >= back


# ---------------------------------------------------------------------------------------------
# Building the subgraphs


def _label(ops: tuple[Op, ...] | list[Op]) -> str:
    top = max((op.flops for op in ops), default=0)
    paths = [op.path for op in ops if op.path and op.flops >= 0.1 * top]
    if not paths:
        return next((op.path for op in ops if op.path), "")
    parts = paths[0].split(".")
    for p in paths[1:]:
        parts = parts[: _common_prefix(".".join(parts), p)]
    return ".".join(parts) or paths[0]


def _build(prog: Program, live: _Liveness, cuts: list[int], fingerprint: str) -> Split:
    n = len(prog.ops)
    segs = _segments(cuts, n)
    x_at: dict[int, list[str]] = {g: [] for g in cuts}
    c_at: dict[int, list[str]] = {g: [] for g in cuts}
    for name, d in live.defined.items():
        u = live.last_use.get(name, d)
        lo = bisect.bisect_right(cuts, d)
        hi = bisect.bisect_right(cuts, u)
        for g in cuts[lo:hi]:
            (c_at if name in live.common else x_at)[g].append(name)
    out_names = tuple(r.name for r in iter_refs(prog.outputs))
    subs = []
    for k, (a, b) in enumerate(segs):
        ops = prog.ops[a:b]
        used: dict[str, None] = {}
        for op in ops:
            for r in op.input_refs():
                if r.name in live.free:
                    used[r.name] = None
        if b == n:
            used.update({r: None for r in out_names if r in live.free})
        params = sum(
            live.free[p].type.numel
            for p, i in live.first_param_use.items()
            if a <= i < b and live.free[p].kind == "param"
        )
        last = b == n
        subs.append(
            Subgraph(
                index=k,
                start=a,
                stop=b,
                label=_label(ops),
                inputs=tuple(x_at.get(a, ())),
                commons=tuple(c_at.get(a, ())),
                outputs=out_names if last else tuple(x_at[b]),
                commons_out=() if last else tuple(c_at[b]),
                graph_inputs=tuple(used),
                flops=sum(op.flops for op in ops),
                params=params,
            )
        )
    return Split(fingerprint, n, tuple(subs))


# ---------------------------------------------------------------------------------------------
# Public API


def split_program(prog: Program, options: SplitOptions | None = None) -> Split:
    """The subgraph sequence of ``prog`` (cached by fingerprint)."""
    opts = options or SplitOptions()
    t0 = time.perf_counter()
    if not prog.ops:
        raise PipelineError("the program has no ops: there is nothing to split into pipeline stages")
    fp = program_fingerprint(prog)
    if opts.cache:
        hit = cached_split(fp, opts, len(prog.ops))
        if hit is not None:
            return dataclasses.replace(hit, seconds=time.perf_counter() - t0)
    live = _liveness(prog)
    cuts = _choose_cuts(prog, live, _levels(live), opts)
    split = _build(prog, live, cuts, fp)
    if opts.cache:
        remember_split(opts, split)
    return dataclasses.replace(split, seconds=time.perf_counter() - t0)


def common_nodes(prog: Program) -> set[str]:
    """Op results no gradient flows through (computed only from user inputs, buffers, constants)."""
    return _liveness(prog).common


def blockers(prog: Program, top: int = 3) -> list[str]:
    """The non-common values live across the most gaps: what keeps a graph from being cut."""
    live = _liveness(prog)
    spans = sorted(
        ((live.last_use.get(name, d) - d, name, d) for name, d in live.defined.items() if name not in live.common),
        reverse=True,
    )
    out = []
    for _span, name, d in spans[:top]:
        u = live.last_use.get(name, d)
        user = "the program output" if u >= live.n else f"op {u} ({prog.ops[u].path or prog.ops[u].target})"
        out.append(f"%{name} from op {d} ({prog.ops[d].path or prog.ops[d].target}) is used until {user}")
    return out


def split_options(options: Any) -> SplitOptions:
    """``SplitOptions`` from None, a SplitOptions or a dict of its fields (an unknown key is an error)."""
    if isinstance(options, SplitOptions):
        return options
    opts = dict(options or {})
    known = {f.name for f in dataclasses.fields(SplitOptions)}
    unknown = sorted(set(opts) - known)
    if unknown:
        staging = {"chunks", "waves", "microbatches", "cluster", "budget_bytes"} & set(unknown)
        where = "; stage options (chunks, waves, ...) belong to the assign-stages pass" if staging else ""
        raise PipelineError(f"unknown split option(s) {unknown}{where}; known: {sorted(known)}")
    return SplitOptions(**opts)


def pipeline_split(prog: Program, options: Any = None) -> Program:
    """The ``split`` pass: ``subgraph=k`` on every op (``annotate``). ``options``: None, a SplitOptions
    or a dict of its fields, plus ``pp``, the pipeline depth: with ``pp=1`` there is nothing to split."""
    if isinstance(options, dict) and "pp" in options:
        if options["pp"] == 1:
            return prog
        options = {k: v for k, v in options.items() if k != "pp"}
    return annotate(prog, split_program(prog, split_options(options)))


__all__ = [
    "Split",
    "SplitOptions",
    "Subgraph",
    "blockers",
    "common_nodes",
    "pipeline_split",
    "split_options",
    "split_program",
]
