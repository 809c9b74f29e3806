"""The search's command line: ``autopar plan MODEL --cluster SPEC --global-batch B`` without ``--mesh``.

``autopar/cli/plan.py`` owns the parser (its "search hook" options) and hands such a call to ``run_cli``.
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar.errors import AutoparError
from autopar.search.result import GiB
from autopar.search.search import search_model
from autopar.search.space import SearchSpace
from autopar.solver.cluster.spec import ClusterSpec


def run_cli(args: argparse.Namespace) -> int:
    """``autopar plan MODEL --cluster SPEC --global-batch B [--budget-gb G] [--top K] [-o plan.json] [--json]``."""
    if not args.model:
        raise AutoparError("give MODEL, e.g. autopar plan gpt2-xl --cluster dgx-a100 --global-batch 64")
    if args.global_batch < 1 or args.top < 1:
        raise AutoparError("--global-batch and --top must be positive")
    cluster = args.cluster if isinstance(args.cluster, ClusterSpec) else ClusterSpec.load(args.cluster)
    precision = args.precision or cluster.default_precision()  # as autopar plan --mesh (cli/plan.py:plan_config)
    space = SearchSpace() if args.zero is None else SearchSpace(zero=(args.zero,), mics=args.mics_group is not None)
    budget = args.budget_gb * GiB if args.budget_gb is not None else None
    result = search_model(
        args.model, cluster, args.global_batch, budget, space, top=args.top, precision=precision, progress=True
    )
    plan = None
    if args.output:
        plan = result.materialize(time_limit=args.time_limit, backend=args.solver)
        plan.save(args.output)
    if args.json:
        out = result.to_dict(args.top)
        if plan is not None:
            out["plan_file"] = args.output
            out["shard"] = plan.stats["shard"]
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(result.format(args.top))
    if plan is not None:
        sh = plan.stats["shard"]
        print(
            f"\nplan written to {args.output}: mesh {plan.pipeline['mesh']}, intra-op ILP {sh['status']} "
            f"({sh['how']}, {sh['layers_solved_once']} repeated layers solved once) in {sh['solve_seconds']:.1f} s"
        )
    else:
        print("\n(add -o plan.json to write the best plan: the flow then plans it as autopar plan --mesh does)")
    return 0


__all__ = ["run_cli"]
