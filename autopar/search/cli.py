"""The search's command line: ``autopar plan MODEL --cluster SPEC --global-batch B`` without ``--mesh``.

``autopar/cli/plan.py`` owns the parser (its "search hook" options) and hands such a call to ``run_cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from autopar.errors import AutoparError, PlanError
from autopar.search.materialize import sequence_parallel_unwritable
from autopar.search.pin import Pin
from autopar.search.result import GiB
from autopar.search.score import Scorer
from autopar.search.search import search_model
from autopar.search.space import SearchSpace
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.experts import DEFAULT_IMBALANCE


def run_cli(args: argparse.Namespace) -> int:
    """``autopar plan MODEL --cluster SPEC --global-batch B [--budget-gb G] [--top K] [-o plan.json] [--json]``."""
    if not args.model:
        raise AutoparError("give MODEL, e.g. autopar plan gpt2-xl --cluster dgx-a100 --global-batch 64")
    if args.global_batch < 1 or args.top < 1:
        raise AutoparError("--global-batch and --top must be positive")
    cluster = args.cluster if isinstance(args.cluster, ClusterSpec) else ClusterSpec.load(args.cluster)
    precision = args.precision or cluster.default_precision()  # as autopar plan --mesh (cli/plan.py:plan_config)
    pin = _pin(args)
    sp = bool(getattr(args, "sequence_parallel", None))
    if sp and args.output:  # refused before searching: such a plan cannot be written (materialize.build_plan)
        raise PlanError(sequence_parallel_unwritable("--sequence-parallel"))
    if pin is not None:
        pin.check(cluster.world_size, args.global_batch)
        space = pin.space()
        # a pinned configuration is priced as published, fitting or not (its memory is printed beside the budget)
        budget = args.budget_gb * GiB if args.budget_gb is not None else math.inf
    else:
        space = SearchSpace() if args.zero is None else SearchSpace(zero=(args.zero,), mics=args.mics_group is not None)
        if getattr(args, "recompute", None) or getattr(args, "microbatch_size", None) or getattr(args, "layout", None):
            space = Pin({}, args.microbatch_size, args.recompute, layout=args.layout).space(space)
            space = dataclasses.replace(space, pp=None, dp=None, tp=None, schedules=SearchSpace().schedules)
        if sp:  # wherever tp > 1
            space = dataclasses.replace(space, sequence_parallel=(True,))
        budget = args.budget_gb * GiB if args.budget_gb is not None else None
    result = search_model(
        args.model, cluster, args.global_batch, budget, space, top=args.top, precision=precision, progress=True,
        attention=getattr(args, "attention", None) or "fused", compiled=bool(getattr(args, "torch_compile", None)),
        scorer=Scorer(recompute_at=getattr(args, "recompute_at", None) or "early"),
        router_imbalance=getattr(args, "router_imbalance", None) or DEFAULT_IMBALANCE,
        capacity_factor=getattr(args, "capacity_factor", None),
    )  # fmt: skip
    plan = None
    if args.output:
        plan = result.materialize(time_limit=args.time_limit, backend=args.solver)
        plan.save(args.output)
    explain = getattr(args, "explain_step", False)
    if args.json:
        out = result.to_dict(args.top)
        if pin is not None:
            out["pinned"] = _pinned_fit(result)
        if explain:
            for row, ev in zip(out["best"], result.best):
                row["explain_step"] = result.explain_step(ev)
        if plan is not None:
            out["plan_file"] = args.output
            out["shard"] = plan.stats["shard"]
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(result.format(args.top))
    if pin is not None:
        fit = _pinned_fit(result)
        verdict = "fits" if fit["fits"] else "does NOT fit (the search would reject it)"
        print(
            f"\npinned configuration priced as given: {fit['memory_bytes'] / GiB:.2f} GiB on the busiest rank, "
            f"device budget {fit['device_budget_bytes'] / GiB:.2f} GiB: {verdict}"
        )
    if explain:
        for i, ev in enumerate(result.best[: args.top], 1):
            print(f"\n#{i} step explained:\n" + result.format_explain(ev))
    if plan is not None:
        sh = plan.stats["shard"]
        print(
            f"\nplan written to {args.output}: mesh {plan.pipeline['mesh']}, intra-op ILP {sh['status']} "
            f"({sh['how']}, {sh['layers_solved_once']} repeated layers solved once) in {sh['solve_seconds']:.1f} s"
        )
    else:
        print("\n(add -o plan.json to write the best plan: the flow then plans it as autopar plan --mesh does)")
    return 0


def _pin(args: argparse.Namespace) -> Pin | None:
    mesh = getattr(args, "pin_mesh", None)
    if not mesh:
        return None
    sched = args.schedule
    return Pin(
        mesh,
        micro_batch=args.microbatch_size,
        recompute=args.recompute,
        schedule=sched,
        chunks=args.chunks,
        waves=args.waves,
        zero=args.zero,
        mics_group=args.mics_group,
        layout=args.layout,
        sequence_parallel=True if getattr(args, "sequence_parallel", None) else None,
    )


def _pinned_fit(result) -> dict:
    ev = result.best[0]
    device = result.cluster.plan_memory
    return {"memory_bytes": ev.memory, "device_budget_bytes": device, "fits": ev.memory <= device}


__all__ = ["run_cli"]
