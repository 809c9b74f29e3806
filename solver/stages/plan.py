"""The stage plan: which subgraphs each pipeline stage runs on which rank, with its predicted time and memory.

``solver/stages/balance.py`` (``balance_stages``) builds it; it is plain data (``to_dict`` / ``to_json`` for the
plan file and ``format`` for the table ``autopar plan`` prints).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of subgraphs on one rank."""

    index: int
    rank: int
    first: int  # first subgraph
    last: int  # last subgraph (inclusive)
    ops: int
    modules: tuple[str, ...]  # module paths covered, e.g. ("transformer.wte", "transformer.h.0-11")
    params: int  # parameters held (global elements; a tied one counts on every stage reading it)
    flops: int  # forward FLOPs per microbatch (global)
    inflight: float  # microbatches whose activations are stashed at the peak
    weight_bytes: float  # model states per device
    activation_bytes: float  # per microbatch per device
    memory_bytes: float  # weight_bytes + the activations held at the peak (inflight * activation_bytes, + W-kept)
    compute_seconds: float  # forward + backward per microbatch
    comm_seconds: float  # tensor-parallel communication per microbatch
    wkept_bytes: float = 0.0  # per microbatch per device: output gradients a split B keeps until its W

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


@dataclass(frozen=True)
class StagePlan:
    """Stages of a pipeline, their ranks, and the predicted time and memory of each."""

    pp: int
    chunks: int
    waves: int | None
    microbatches: int | None
    cluster: str
    precision: str
    efficiency: float | None  # a constant fraction of peak (None: the device table's per-op curves)
    budget_bytes: float
    fingerprint: str
    num_subgraphs: int
    stages: tuple[Stage, ...]
    split_seconds: float = 0.0
    assign_seconds: float = 0.0
    run_schedule: str | None = None  # the schedule the balance was told runs (its in-flight counts)
    # per rank: activations and W-kept gradients at the rank's worst point, its stages together (given the
    # schedule's stash points; None: each stage's own peak, summed)
    rank_activation_bytes: tuple[float, ...] | None = None

    @property
    def schedule(self) -> str:
        if self.run_schedule:
            return self.run_schedule
        return "wave" if self.waves else ("interleaved" if self.chunks > 1 else "1f1b")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stages)

    @property
    def stage_of_subgraph(self) -> list[int]:
        out = [0] * self.num_subgraphs
        for s in self.stages:
            out[s.first : s.last + 1] = [s.index] * (s.last - s.first + 1)
        return out

    @property
    def bottleneck_seconds(self) -> float:
        return max(s.seconds for s in self.stages)

    @property
    def balance(self) -> float:
        """Slowest stage over the mean stage time (1.0 is perfect)."""
        mean = statistics.fmean(s.seconds for s in self.stages)
        return self.bottleneck_seconds / mean if mean > 0 else 1.0

    def rank_memory(self) -> list[float]:
        out = [0.0] * self.pp
        for s in self.stages:
            out[s.rank] += s.memory_bytes if self.rank_activation_bytes is None else s.weight_bytes
        if self.rank_activation_bytes is not None:
            out = [w + a for w, a in zip(out, self.rank_activation_bytes)]
        return out

    def rank_seconds(self) -> list[float]:
        out = [0.0] * self.pp
        for s in self.stages:
            out[s.rank] += s.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedule"] = self.schedule
        d["stage_to_rank"] = list(self.stage_to_rank)
        d["balance"] = self.balance
        d["rank_memory_bytes"] = self.rank_memory()
        for s, sd in zip(self.stages, d["stages"]):
            sd["seconds"] = s.seconds
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def format(self) -> str:
        gib = 2**30
        head = (
            f"pipeline {self.schedule}: pp={self.pp}"
            + (f" chunks={self.chunks}" if self.chunks > 1 else "")
            + (f" waves={self.waves}" if self.waves else "")
            + f", {self.num_subgraphs} subgraphs -> {self.num_stages} stages on {self.cluster}"
            f" ({self.precision}, "
            + (f"{self.efficiency:.0%} of peak)," if self.efficiency is not None else "per-op efficiency),")
            + f" budget {self.budget_bytes / gib:.1f} GiB/device"
        )
        rows = [
            head,
            f"{'stage':>5} {'rank':>4} {'subgraphs':>9} {'ops':>5} {'params':>8} {'GFLOP':>9} "
            f"{'mem GiB':>8} {'ms':>8}  modules",
        ]
        for s in self.stages:
            mods = ", ".join(s.modules)
            rows.append(
                f"{s.index:>5} {s.rank:>4} {f'{s.first}-{s.last}':>9} {s.ops:>5} {_human(s.params):>8} "
                f"{s.flops / 1e9:>9.1f} {s.memory_bytes / gib:>8.3g} {s.seconds * 1e3:>8.4g}  "
                f"{mods if len(mods) <= 60 else mods[:57] + '...'}"
            )
        worst = max(self.stages, key=lambda s: s.seconds)
        rows.append(
            f"balance max/mean {self.balance:.3f}; slowest stage {worst.index} "
            f"({worst.seconds * 1e3:.2f} ms per microbatch); peak rank memory "
            f"{max(self.rank_memory()) / gib:.2f} GiB"
        )
        return "\n".join(rows)


def _human(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def module_units(paths: Sequence[str]) -> tuple[str, ...]:
    """Module paths cut after their first layer index (``transformer.h.3``) or two components,
    prefixes of others dropped, consecutive layers compressed (``transformer.h.0-11``)."""
    units: list[str] = []
    for p in paths:
        if not p:
            continue
        parts = p.split(".")
        k = next((i + 1 for i, x in enumerate(parts) if x.isdigit()), min(2, len(parts)))
        u = ".".join(parts[:k])
        if u not in units:
            units.append(u)
    units = [u for u in units if not any(o != u and o.startswith(u + ".") for o in units)]
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # prefix, first index, last index
    for u in units:
        prefix, _, idx = u.rpartition(".")
        if idx.isdigit() and run and run[0] == prefix and int(idx) == run[2] + 1:
            run = (prefix, run[1], int(idx))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
            run = None
        if idx.isdigit():
            run = (prefix, int(idx), int(idx))
        else:
            out.append(u)
    if run:
        out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
    return tuple(out)


__all__ = ["Stage", "StagePlan", "module_units"]
