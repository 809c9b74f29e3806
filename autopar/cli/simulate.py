"""`autopar simulate`: build a pipeline schedule, simulate one training step, report, chart, print.

Examples::

    autopar simulate --schedule 1f1b --stages 4 --microbatches 8
    autopar simulate --schedule interleaved --stages 4 --microbatches 8 --chunks 2 --json
    autopar simulate --schedule wave --stages 4 --microbatches 4 --waves 2 --chart wave.png
    autopar simulate --schedule scp --stages 8 --microbatches 16 --tr 1 --print
    autopar simulate --schedule zbv --stages 4 --microbatches 8 --tb 2 --tw 1 --chart zbv.png

``--tf/--tb/--tr`` are the forward/backward/recompute time of one rank's share of the model
(model / P), ``--tw`` the part of ``--tb`` that computes weight gradients (what a zero-bubble
schedule's W costs; default half of it), split evenly over that rank's stages, so schedules with
more stages per rank do the same total work; ``--tc`` is the time of one point-to-point transfer.
The pair (Schedule, Costs) is all the simulator needs: ``_from_flags`` builds it from these flags,
and a plan file can feed the same pair later (P, M, schedule, per-stage costs) without touching
``_report``.
"""

from __future__ import annotations

import argparse
import inspect
import json
from fractions import Fraction

from autopar.errors import ScheduleError
from autopar.plan import Plan
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import Schedule
from autopar.schedule.chart import save_gantt
from autopar.schedule.generators import SCHEDULES, make_schedule
from autopar.schedule.simulator import simulate
from autopar.schedule.timeline import SimResult

# flag -> generator keyword; a flag is passed only to generators that take that keyword
_OPTION_FLAGS = {"chunks": "chunks", "waves": "waves", "recompute": "recompute", "alpha1": "alpha1"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline schedule: step time, bubble ratio, activation memory, Gantt chart",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--stages", "-P", type=int, default=4, metavar="P", help="pipeline ranks P (default 4)")
    parser.add_argument("--microbatches", "-M", type=int, default=8, metavar="M", help="microbatches M (default 8)")
    parser.add_argument("--chunks", type=int, help="interleaved: model chunks per rank v (default 2)")
    parser.add_argument("--waves", type=int, help="wave: number of waves W (default 1, Chimera-wave)")
    parser.add_argument("--recompute", type=int, choices=(0, 1), help="1f1b: 1 = full recomputation")
    parser.add_argument("--alpha1", type=Fraction, help="scp: Merak's alpha_1 (default 0)")
    parser.add_argument("--tf", type=Fraction, default=Fraction(1), help="forward time of a rank's share")
    parser.add_argument("--tb", type=Fraction, default=Fraction(2), help="backward time of a rank's share")
    parser.add_argument("--tr", type=Fraction, help="recompute time of a rank's share (default: tf)")
    parser.add_argument("--tw", type=Fraction, help="weight-gradient part of --tb, a W's time (default: tb/2)")
    parser.add_argument("--tc", type=Fraction, default=Fraction(0), help="time of one p2p transfer")
    parser.add_argument("--act-bytes", type=float, help="activation bytes one microbatch stashes per rank share")
    parser.add_argument("--p2p", choices=("eager", "batched"), default="eager", help="p2p semantics")
    parser.add_argument("--chart", metavar="PNG", help="write the Gantt chart to this file")
    parser.add_argument(
        "--plan", metavar="PLAN", help="simulate a plan file's pipeline (schedule, stages and per-stage times)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--print", action="store_true", dest="print_actions", help="print the action lists")
    parser.set_defaults(func=run)
    return parser


MAX_ACTIONS = 1_000_000  # P x M simulated at most: the simulator holds every action (-P 1e5 -M 1e8 grew unbounded)


def _from_flags(args: argparse.Namespace) -> tuple[Schedule, Costs]:
    """The (Schedule, Costs) pair the flags describe."""
    generator = SCHEDULES[args.schedule].generator
    accepted = inspect.signature(generator).parameters
    options = {}
    for flag, keyword in _OPTION_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if keyword not in accepted:
            raise ScheduleError(f"--{flag} does not apply to the {args.schedule} schedule")
        options[keyword] = value
    if args.stages < 1 or args.microbatches < 1 or args.stages * args.microbatches > MAX_ACTIONS:
        raise ScheduleError(
            f"-P {args.stages} -M {args.microbatches}: give at least one stage and microbatch, and at most "
            f"{MAX_ACTIONS:,} stage-microbatches (P x M) to simulate; the schedule's actions grow as P x M"
        )
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, **options)
    costs = Costs.from_rank_share(
        schedule, tf=args.tf, tb=args.tb, tr=args.tr, tc=args.tc, act_bytes=args.act_bytes, tw=args.tw
    )
    return schedule, costs


def _report(result: SimResult, args: argparse.Namespace) -> None:
    if args.print_actions:
        print(result.schedule.to_text(), end="")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    elif not args.print_actions:
        s = result.schedule
        opts = " ".join(f"{k}={v}" for k, v in s.options)
        print(f"{s.name} {opts}: {s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} microbatches")
        print(f"step time        {float(result.step_time):g}")
        print(f"bubble ratio     {float(result.bubble_ratio):.4f}   (bubble / ideal compute, Megatron)")
        print(f"idle fraction    {float(result.idle_fraction):.4f}   (bubble / total time, Hanayo/Chimera)")
        span = result.span_bubble / max(result.busy) if max(result.busy) else 0
        print(f"span bubble      {float(span):.4f}   (idle inside each rank's span / compute: overlapped steps)")
        for r in range(s.num_ranks):
            mem = "" if result.peak_activation_bytes is None else f"  {float(result.peak_activation_bytes[r]):g} B"
            print(
                f"  rank {r}: bubble {float(result.bubble_ratio_per_rank[r]):.4f}  "
                f"peak stashed activations {result.peak_activations[r]}{mem}"
            )
    if args.chart:
        save_gantt(result, args.chart)


def _from_plan(args: argparse.Namespace) -> tuple[Schedule, Costs]:
    """The (Schedule, Costs) of a plan file with a pipeline: its schedule and stage count, and per-stage
    forward / backward times from the stage assignment (backward = 2 x forward, TP communication
    split the same way); --microbatches overrides the plan's microbatch count."""
    plan = Plan.load(args.plan)
    if not plan.pipeline or "stage_plan" not in plan.pipeline:
        raise ScheduleError(f"{args.plan} has no pipeline: plan it with a pp axis (autopar plan MODEL --mesh pp=4,...)")
    pipe = plan.pipeline
    stages = pipe["stage_plan"]["stages"]
    options = {k: Fraction(v) if isinstance(v, str) else v for k, v in (pipe.get("schedule_options") or {}).items()}
    micro = pipe.get("microbatches") or args.microbatches
    schedule = make_schedule(pipe["schedule"], pipe["pp"], micro, **options)
    per_stage = [Fraction(st["compute_seconds"] + st["comm_seconds"]).limit_denominator(10**12) for st in stages]
    costs = Costs.uniform(
        len(stages),
        tf=[t / 3 for t in per_stage],
        tb=[2 * t / 3 for t in per_stage],
        act_bytes=[st["activation_bytes"] for st in stages],
    )
    return schedule, costs


def run(args: argparse.Namespace) -> int:
    schedule, costs = _from_plan(args) if args.plan else _from_flags(args)
    _report(simulate(schedule, costs, p2p=args.p2p), args)
    return 0
