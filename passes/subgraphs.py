"""The result of a pipeline split as plain data (its options, its subgraphs: op ranges and what crosses, JSON),
and the two ways it goes back into the IR: ``annotate`` (``subgraph=``/``stage=`` on every op) and ``extract``
(a run of subgraphs as a program of its own).

``autopar.passes.pipeline_split.split_program`` computes a ``Split``; ``passes/split_cache.py`` keeps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.ir.core import Program, Ref, Value

SPLIT_VERSION = 1  # bump when the algorithm changes: old cache entries are then ignored


@dataclass(frozen=True)
class SplitOptions:
    """Knobs of the split; each is part of the cache key."""

    max_crossing: int = 3  # deepest gap level used to re-cut segments (Merak's rule alone is 1)
    light: float = 0.02  # a segment under this fraction of the largest segment's FLOPs is merged away
    oversize: float = 4.0  # a segment over this multiple of the median segment's FLOPs is re-cut
    pieces: int = 5  # ... and so is one that deeper gaps split into this many non-light pieces
    cache: bool = True  # use the in-process and on-disk caches

    def key(self) -> str:
        return f"max_crossing={self.max_crossing},light={self.light},oversize={self.oversize},pieces={self.pieces}"


@dataclass(frozen=True)
class Subgraph:
    """One contiguous run of ops ``prog.ops[start:stop]`` and what flows in and out of it."""

    index: int
    start: int
    stop: int
    label: str  # module path that holds the subgraph's heavy ops, e.g. transformer.h.3.attn
    inputs: tuple[str, ...]  # non-common tensors received from the previous subgraph (X at start)
    commons: tuple[str, ...]  # common nodes received (forward only)
    outputs: tuple[str, ...]  # non-common tensors sent on (X at stop); program outputs for the last
    commons_out: tuple[str, ...]  # common nodes sent on
    graph_inputs: tuple[str, ...]  # parameters, buffers and user inputs read here
    flops: int  # forward FLOPs of the ops (global, the program's batch)
    params: int  # elements of the parameters first read here

    @property
    def num_ops(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Split:
    """The subgraph sequence of a program, with its fingerprint and how it was obtained."""

    fingerprint: str
    num_ops: int
    subgraphs: tuple[Subgraph, ...]
    seconds: float = 0.0  # time to compute (or load) the split
    source: str = "computed"  # "computed", "memory" (in-process cache) or "disk"

    def __len__(self) -> int:
        return len(self.subgraphs)

    def crossings(self) -> list[tuple[int, int]]:
        """(non-common tensors, common nodes) crossing each cut, in order."""
        return [(len(s.outputs), len(s.commons_out)) for s in self.subgraphs[:-1]]

    def subgraph_of_op(self) -> list[int]:
        out = [0] * self.num_ops
        for s in self.subgraphs:
            out[s.start : s.stop] = [s.index] * s.num_ops
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SPLIT_VERSION,
            "fingerprint": self.fingerprint,
            "num_ops": self.num_ops,
            "subgraphs": [dataclasses.asdict(s) for s in self.subgraphs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "disk") -> Split:
        subs = tuple(
            Subgraph(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}) for s in data["subgraphs"]
        )
        return cls(data["fingerprint"], data["num_ops"], subs, source=source)

    def format(self) -> str:
        """One line per subgraph: index, op range, label, FLOPs, params, tensors out (+ commons)."""
        lines = [f"{'sg':>4} {'ops':>13} {'GFLOP':>10} {'params':>12} {'out':>3} {'+c':>3}  label"]
        for s in self.subgraphs:
            lines.append(
                f"{s.index:>4} {f'{s.start}-{s.stop - 1}':>13} {s.flops / 1e9:>10.3f} {s.params:>12,} "
                f"{len(s.outputs):>3} {len(s.commons_out):>3}  {s.label}"
            )
        return "\n".join(lines)


def annotate(prog: Program, split: Split, stage_of_subgraph: list[int] | None = None) -> Program:
    """Record the split in the IR: ``subgraph=k`` (and ``stage=s``) on every op, and on every graph
    input the subgraph (stage) of its first use."""
    sg_of_op = split.subgraph_of_op()

    def tag(attrs: dict[str, Any], k: int) -> dict[str, Any]:
        out = {a: v for a, v in attrs.items() if a not in ("subgraph", "stage")}
        out["subgraph"] = k
        if stage_of_subgraph is not None:
            out["stage"] = stage_of_subgraph[k]
        return out

    ops = tuple(op.with_(attrs=tag(op.attrs, sg_of_op[i])) for i, op in enumerate(prog.ops))
    first: dict[str, int] = {}
    for s in split.subgraphs:
        for name in s.graph_inputs:
            first.setdefault(name, s.index)
    inputs = tuple(
        dataclasses.replace(v, attrs=tag(v.attrs, first[v.name])) if v.name in first else v for v in prog.inputs
    )
    attrs = dict(prog.attrs)
    attrs["pipeline_subgraphs"] = len(split)
    if stage_of_subgraph is not None:
        attrs["pipeline_stages"] = max(stage_of_subgraph) + 1
    return prog.with_(ops=ops, inputs=inputs, attrs=attrs)


def extract(prog: Program, split: Split, first: int, last: int | None = None) -> Program:
    """Subgraphs ``first..last`` (inclusive) as a self-contained Program: the tensors crossing into
    it (and the common nodes) become inputs named as in ``prog``, followed by the parameters,
    buffers and user inputs it reads; its outputs are what crosses out of it."""
    last = first if last is None else last
    a, b = split.subgraphs[first], split.subgraphs[last]
    types = prog.types()
    received = [Value(name, "input", types[name]) for name in (*a.inputs, *a.commons)]
    reads: dict[str, None] = {}
    for s in split.subgraphs[first : last + 1]:
        reads.update(dict.fromkeys(s.graph_inputs))
    graph_inputs = [v for v in prog.inputs if v.name in reads]
    if last == len(split) - 1:
        outputs = prog.outputs
    else:
        outputs = tuple(Ref(name) for name in (*b.outputs, *b.commons_out))
    return Program(prog.mesh, (*received, *graph_inputs), prog.ops[a.start : b.stop], outputs, dict(prog.attrs))


__all__ = ["SPLIT_VERSION", "Split", "SplitOptions", "Subgraph", "annotate", "extract"]
