"""`autopar check MODEL --mesh ... [--plan plan.json]`: one float64 training step of the plan on simulated
ranks against the unsharded model; prints agreement or the first op that differs."""

from __future__ import annotations

import argparse

from autopar.api import parse_mesh
from autopar.check.step import check_model
from autopar.errors import AutoparError
from autopar.models.resolve import build
from autopar.passes.shard import ShardOptions


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="run one training step of the plan on simulated ranks (one process, float64) against the model",
        description=(
            "Build MODEL with real weights, plan it on --mesh (or load --plan), run one forward and backward of "
            "every rank's program on the single-process rank simulator in float64, and compare every op's output "
            "and gradient with the unsharded program and the model. Prints the largest difference, or the first "
            "op (IR line, module path, source line, placements) whose output or gradient differs. A mesh with pp "
            "runs one microbatch through the stages (boundaries sent point to point). A model with dropout is "
            "compared with autopar's keyed dropout on one device. Scale a large preset down with overrides "
            "(gpt3-175b:n_layer=2,n_embd=256)."
        ),
        epilog="example: autopar check gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,batch=4,seq=32 "
        "--mesh dp=2,tp=2",
    )
    p.add_argument("model", metavar="MODEL", help="preset[:overrides] or file.py:fn (see autopar plan --list-models)")
    p.add_argument("--mesh", required=True, help="mesh axes, e.g. dp=2,tp=2 or pp=2,tp=2")
    p.add_argument("--plan", default=None, help="check this plan file instead of planning")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument(
        "--objective",
        choices=["time", "memory"],
        default="time",
        help="what the plan minimizes when no --plan is given (as autopar plan; default time, compile's default)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mesh = parse_mesh(args.mesh)
    if mesh.size > 64:
        raise AutoparError(f"mesh {mesh} has {mesh.size} ranks; the simulator runs every rank: check at most 64")
    spec = build(args.model, device="cpu", seed=args.seed)
    options = ShardOptions(objective=args.objective)
    report = check_model(spec.model, spec.args, spec.kwargs, mesh, plan=args.plan, options=options)
    print(f"{spec.description}")
    print(report.summary())
    return 0 if report.agrees else 1
