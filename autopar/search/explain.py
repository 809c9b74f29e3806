"""``autopar plan --explain-step``: a priced plan's step broken into the parts that make it.

On the rank that ends the step last (the critical rank), with the very terms ``stage_terms.py`` priced:

    step = compute (per stage the rank holds: forward + backward FLOPs at the flop rate)
         + recompute (the recomputed layers' forward FLOPs)
         + exposed communication per axis:
             tp  the tensor-parallel all-reduces the compute stream waits for (f's less what runs
                 beside its readers' weight gradients, g's, and those of the recomputation); with sequence
                 parallelism its reduce-scatters and all-gathers (``StageTerms.tp_seconds``)
             dp  ZeRO-3's gathers / scatters in every forward and backward, plus the data-parallel
                 gradient synchronization after the rank's last backward (with context parallelism also
                 the gradients' all-reduce over cp)
             cp  context parallelism's communication in the plan's form (``StageTerms.cp_seconds``): the
                 all-gathers of the keys and values and the reduce-scatters of their gradients, ring
                 attention's exposed steps, hops and exchange, or Ulysses' all-to-alls; present when cp > 1
             pp  the pipeline transfers on the critical path: the step less the step simulated with
                 free transfers
         + bubble (the critical rank idle, waiting on other stages, with free transfers)
         + optimizer (the critical rank's optimizer step after its gradient sync: its parameters, gradients
                      and Adam's moments streamed at the device's bandwidth, divided by ZeRO's sharding)

The parts sum to the predicted step (``tests/test_search.py`` checks it on each kind of plan).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.search.evaluation import Evaluation
from autopar.search.price import Analytic
from autopar.search.score import Scorer
from autopar.search.space import ZERO_BUBBLE


def explain_step(an: Analytic, ev: Evaluation, scorer: Scorer | None = None) -> dict[str, Any]:
    """The parts of ``ev``'s predicted step (``ev`` scored); see the module docstring."""
    if ev.step_time is None:
        raise ValueError("explain a scored evaluation (Scorer.score) only")
    c = ev.candidate
    scorer = scorer or Scorer()
    m, b, tp = c.microbatches, c.micro_batch, c.tp
    bt = b / c.cp  # a rank's share of the microbatch's tokens (StageTerms._base)
    split = c.schedule in ZERO_BUBBLE
    per_stage = []
    for s, (a, e) in enumerate(ev.stages):
        fwd = an._sec("fwd", a, e, bt, tp)  # the one compute model (solver/cluster/compute.py), as StageTerms prices
        bwd = an._sec("bwd", a, e, bt, tp)
        rfwd = an._sec("lfwd", a, e, bt, tp)
        tp_f, tp_b, tp_r = an.tp_seconds(a, e, bt, tp, c.sp, split)
        cp_f, cp_b = an.cp_seconds(a, e, b, c)
        cp_r = an.cp_seconds(a, e, b, c, True)[0]
        x = ev.recompute_fraction[s]
        # what the stage's times hold beyond compute, tp and cp: ZeRO-3's gathers and scatters (dp)
        z3 = (ev.tf[s] - fwd - tp_f - cp_f) + (ev.tb[s] - bwd - tp_b - cp_b) + x * (ev.tr[s] - rfwd - tp_r - cp_r)
        per_stage.append({
            "compute": m * (fwd + bwd), "recompute": m * x * rfwd, "tp": m * (tp_f + tp_b + x * tp_r), "dp": m * z3,
            "cp": m * (cp_f + cp_b + x * cp_r),
        })  # fmt: skip
    if c.pp == 1:
        rank, bubble, pp = 0, 0.0, 0.0
        busy_sum = m * (ev.tf[0] + ev.tb[0] + ev.recompute_fraction[0] * ev.tr[0])
        mine = [0]
        sync = ev.reduce[0]
        opt = ev.tail(0) - sync
        step = ev.step_time
    else:
        free = dataclasses.replace(ev, tc=tuple(0.0 for _ in ev.tc))
        finish, busy, _ = scorer.finish_busy(free)
        ends = [f + ev.tail(r) for r, f in enumerate(finish)]
        rank = max(range(c.pp), key=lambda r: (ends[r], -r))
        mine = [s for s, r in enumerate(ev.stage_rank) if r == rank]
        sync = ev.reduce[rank]
        opt = ev.tail(rank) - sync
        busy_sum = busy[rank]
        bubble = finish[rank] - busy[rank]
        step = ev.step_time
        pp = step - ends[rank]  # transfers on the critical path (and the bound, where it exceeds the simulation)
    parts = {k: sum(per_stage[s][k] for s in mine) for k in ("compute", "recompute", "tp", "dp", "cp")}
    # the simulator's busy time is the same sum taken action by action; their difference is rounding
    rounding = busy_sum - sum(parts.values())
    out = {
        "step_seconds": step,
        "critical_rank": rank,
        "compute_per_stage": {s: per_stage[s]["compute"] for s in mine},
        "compute": parts["compute"] + rounding,
        "recompute": parts["recompute"],
        "exposed_comm": {"tp": parts["tp"], "dp": parts["dp"] + sync, "pp": pp}
        | ({"cp": parts["cp"]} if c.cp > 1 else {}),
        "bubble": bubble,
        "optimizer": opt,
        "stage_compute_seconds": [p["compute"] for p in per_stage],
        "rounding": rounding,  # folded into compute
        "notes": [
            "optimizer: the states streamed once at the device's bandwidth (price.Analytic.optimizer_seconds)",
            f"critical rank {rank}: the pipeline rank whose last compute plus gradient sync ends the step",
        ],
    }
    return out


def parts_sum(x: dict[str, Any]) -> float:
    """The sum of an ``explain_step`` breakdown's parts (equal to its ``step_seconds``)."""
    return x["compute"] + x["recompute"] + sum(x["exposed_comm"].values()) + x["bubble"] + x["optimizer"]


def format_explain(x: dict[str, Any]) -> str:
    T = x["step_seconds"]

    def row(name: str, v: float) -> str:
        return f"  {name:<28} {v:>11.4g} s  {v / T:>6.1%}" if T else f"  {name:<28} {v:>11.4g} s"

    lines = [row("step", T), row(f"compute (rank {x['critical_rank']})", x["compute"])]
    for s, v in x["compute_per_stage"].items():
        lines.append(row(f"  stage {s}", v))
    lines.append(row("recompute", x["recompute"]))
    for axis, v in x["exposed_comm"].items():
        lines.append(row(f"exposed comm {axis}", v))
    lines += [row("bubble", x["bubble"]), row("optimizer", x["optimizer"])]
    return "\n".join(lines)


__all__ = ["explain_step", "format_explain", "parts_sum"]
