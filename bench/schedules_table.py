"""Table of simulated bubble ratio and peak activations for every schedule, beside the papers' values.

Run from the repository root::

    .venv/bin/python bench/schedules_table.py > /tmp/table.md

Costs are per rank share (model / P): T_F = 1, T_B = 2, T_R = 1, T_C = 0, split evenly over a
rank's stages (``Costs.from_rank_share``); zero-bubble schedules split T_B into an input-gradient B
and a weight-gradient W of 1 each. "span bubble" is the idle time inside each rank's own span over
the busiest rank's compute (the bubble when steps overlap, the Zero Bubble paper's measure for ZB-H2
and ZB-V). Peak activations are in units of one microbatch's
activations of a rank's whole share, so schedules with more stages per rank compare directly;
recomputing stages keep only their input, counted as 0 here, plus one re-materialised stage.
The simulator is exact (Fractions); no timing is measured, so the numbers do not vary by machine.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from autopar.schedule.action_costs import Costs
from autopar.schedule.formulas import paper_bubble
from autopar.schedule.generators import make_schedule
from autopar.schedule.simulator import simulate

ROWS: list[tuple[str, str, dict[str, int | Fraction]]] = [
    ("gpipe", "gpipe", {}),
    ("1f1b", "1f1b", {}),
    ("interleaved v=2", "interleaved", {"chunks": 2}),
    ("interleaved v=4", "interleaved", {"chunks": 4}),
    ("wave W=1 (Chimera-wave)", "wave", {"waves": 1}),
    ("wave W=2", "wave", {"waves": 2}),
    ("1f1b + early recompute", "1f1b", {"recompute": 1}),
    ("scp (Merak)", "scp", {}),
    ("zb-h1", "zb-h1", {}),
    ("zb-h2", "zb-h2", {}),
    ("zbv", "zbv", {}),
    ("dualpipev", "dualpipev", {}),
]


def fmt(x: Fraction) -> str:
    return f"{float(x):.4f}"


def table(ranks: list[int], factors: list[int]) -> str:
    columns = ["schedule", "P", "M", "bubble ratio (sim)", "paper", "idle fraction (sim)", "span bubble (sim)"]
    columns.append("peak activations")
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for label, name, options in ROWS:
        for P in ranks:
            for M in (f * P for f in factors):
                if name == "dualpipev" and M < 2 * P:
                    continue  # it needs a microbatch per stage
                s = make_schedule(name, P, M, **options)
                r = simulate(s, Costs.from_rank_share(s, tf=1, tb=2, tr=1, act_bytes=1))
                paper = paper_bubble(name, P, M, **options)
                cite = "-" if paper is None else f"{fmt(paper[0])} {paper[2]} ({paper[1]})"
                peak = float(max(r.peak_activation_bytes or [0]))
                span = fmt(r.span_bubble / max(r.busy))
                cells = [label, P, M, fmt(r.bubble_ratio), cite, fmt(r.idle_fraction), span, f"{peak:g}"]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4], help="M = factor * P")
    args = parser.parse_args()
    print(table(args.ranks, args.factors))


if __name__ == "__main__":
    main()
