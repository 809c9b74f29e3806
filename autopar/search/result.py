"""The outcome of a search: the K best plans with their predicted step time, MFU and memory, as a table or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.errors import SearchError
from autopar.plan import Plan
from autopar.schedule.simulator import simulate
from autopar.schedule.timeline import SimResult
from autopar.search.evaluation import Evaluation
from autopar.search.explain import explain_step, format_explain
from autopar.search.materialize import build_plan
from autopar.search.price import Analytic
from autopar.search.score import Scorer
from autopar.search.space import SearchSpace
from autopar.solver.cluster.spec import ClusterSpec

GiB = 2**30


@dataclass
class SearchResult:
    """The K best plans of a search, its counters, and what is needed to materialize the best."""

    best: list[Evaluation]
    stats: dict[str, Any]
    analytic: Analytic
    cluster: ClusterSpec
    global_batch: int
    budget_bytes: float
    space: SearchSpace
    spec: str | None = None
    precision: str = "bf16"
    scorer: Scorer | None = field(default=None, repr=False)

    def mfu(self, ev: Evaluation) -> float:
        """Model FLOPs utilization: 3 x forward matmul FLOPs (Eq. 3 without the recomputation pass)
        per step over (step time x devices x peak)."""
        return self.analytic.model_flops() / (ev.step_time * self.cluster.world_size * self._peak())

    def tflops_eq3(self, ev: Evaluation) -> float:
        """Per-GPU TFLOP/s as Megatron reports them: Eq. 3 (with the recomputation pass) over step time."""
        return self.analytic.eq3_flops() / (ev.step_time * self.cluster.world_size) / 1e12

    def _peak(self) -> float:
        return self.cluster.peak("fp32" if self.precision == "fp32" else self.precision)

    def summary(self, ev: Evaluation) -> dict[str, Any]:
        c = ev.candidate
        return {
            "configuration": c.describe(),
            "candidate": c.to_dict(),
            "mesh": c.mesh(),
            "step_seconds": ev.step_time,
            "mfu": self.mfu(ev),
            "tflops_per_gpu_eq3": self.tflops_eq3(ev),
            "peak_memory_bytes": ev.memory,
            "memory_per_rank_bytes": list(ev.rank_memory),
            "bubble": ev.bubble,
            "lower_bound_seconds": ev.lower_bound,
            "simulated": ev.simulated,
        }

    def explain_step(self, ev: Evaluation) -> dict[str, Any]:
        """``ev``'s predicted step in parts: compute per stage, recompute, exposed communication per axis,
        bubble, optimizer (``explain.py``; they sum to the step)."""
        return explain_step(self.analytic, ev, self.scorer)

    def format_explain(self, ev: Evaluation) -> str:
        return format_explain(self.explain_step(ev))

    def format(self, top: int | None = None) -> str:
        """The table of the ``top`` best plans the search kept (default: all of them). The search keeps as many
        as ``search_model(..., top=K)`` asked: asking here for more is refused, saying so."""
        if top is not None and top > self.stats.get("top", len(self.best)):
            raise SearchError(
                f"the search kept its {self.stats['top']} best plans, not {top}: ask the "
                f"search for them, search_model(..., top={top}) (autopar plan --top {top}), then format()"
            )
        s = self.stats
        cl = self.cluster
        head = (
            f"{self.spec or 'model'} on {cl.name} x {cl.world_size} ({cl.nodes} nodes x {cl.devices_per_node}), "
            f"global batch {self.global_batch}, budget {self.budget_bytes / GiB:.1f} GiB/device, "
            f"{self.precision} + Adam, attention {self.analytic.attention}{self._router()}"
        )
        counts = (
            f"searched {s['space']:,} candidates ({s['families']:,} mesh x micro-batch families) in "
            f"{s['search_seconds']:.1f} s (profile {s['profile_seconds']:.1f} s): {s['over_budget']:,} over the "
            f"memory budget, {s['dominated']:,} dominated, {s['unsupported']:,} unsupported, "
            f"{s['pruned_by_bound']:,} pruned by the step-time lower bound "
            f"({s['families_pruned_by_bound']:,} whole families), {s['priced']:,} priced, "
            f"{s['scored']:,} scored ({s['simulations']:,} pipeline simulations, "
            f"{s['schedules_built']:,} schedules built)"
        )
        rows = [head, counts, "", f"{'#':>2} {'step s':>9} {'MFU':>6} {'TFLOP/s':>8} {'mem GiB':>8}  configuration"]
        for i, ev in enumerate(self.best[: top or len(self.best)], 1):
            rows.append(
                f"{i:>2} {ev.step_time:>9.4g} {self.mfu(ev):>6.1%} {self.tflops_eq3(ev):>8.1f} "
                f"{ev.memory / GiB:>8.2f}  {ev.candidate.describe()}"
                + (" (extrapolated)" if ev.simulated == "extrapolated" else "")
            )
        rows.append(
            "(MFU: 3 x forward matmul FLOPs per step / (step x devices x peak); TFLOP/s per GPU as Megatron "
            "counts it, Eq. 3 with the recomputation pass; mem: the busiest rank)"
        )
        return "\n".join(rows)

    def _router(self) -> str:
        """A mixture of experts' routing assumption, for the table's head line (nothing for a dense model)."""
        if not self.analytic.p.experts:
            return ""
        cf = self.analytic.capacity_factor
        return f", router imbalance {self.analytic.router_imbalance:g}, " + (
            "dropless" if cf is None else f"capacity factor {cf:g}"
        )

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        return {
            "model": self.spec,
            "cluster": self.cluster.name,
            "devices": self.cluster.world_size,
            "global_batch": self.global_batch,
            "budget_bytes": self.budget_bytes,
            "precision": self.precision,
            "attention": self.analytic.attention,
            "router_imbalance": self.analytic.router_imbalance,
            "capacity_factor": self.analytic.capacity_factor,
            "stats": dict(self.stats),
            "best": [self.summary(ev) for ev in self.best[: top or len(self.best)]],
        }

    def simulate(self, rank: int = 0) -> SimResult:
        """The simulated step (``SimResult``) of the ``rank``-th best plan at its own microbatch count,
        for ``autopar.schedule.chart.draw_gantt``; the plan needs a pipeline (pp > 1)."""
        ev = self.best[rank]
        c = ev.candidate
        if c.pp == 1:
            raise ValueError(f"{c.describe()} has no pipeline to simulate")
        scorer = self.scorer or Scorer()
        sched = scorer.schedule(c.schedule, c.pp, c.microbatches, tuple(sorted(c.schedule_options().items())))
        return simulate(sched, scorer.costs(ev))

    def materialize(self, rank: int = 0, **kw: Any) -> Plan:
        """The Plan of the ``rank``-th best candidate (see ``build_plan``)."""
        if self.spec is None:
            raise ValueError("materialize needs the model spec; use search_model")
        return build_plan(self, self.best[rank], **kw)


__all__ = ["SearchResult"]
