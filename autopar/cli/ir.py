"""`autopar ir MODEL`: print a model's IR after all passes, or up to one named with --upto."""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from autopar.api import DEFAULT_PIPELINE, dump_rank_code, parse_mesh
from autopar.errors import AutoparError
from autopar.ir.core import Program
from autopar.ir.printer import print_program
from autopar.models.resolve import build
from autopar.passes.flow import FLOW
from autopar.passes.manager import PassManager, Variants
from autopar.passes.shard import ShardOptions
from autopar.runtime.build.codegen import CodegenOptions


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ir",
        help="print a model's IR between passes",
        description=(
            "Capture MODEL on the meta device (no weights allocated), lower it to autopar's IR and run the "
            f"pass pipeline ({', '.join(DEFAULT_PIPELINE)}) for the given mesh. Prints the IR after the last "
            "pass, or after --upto PASS (--upto capture: the lowered IR before any pass)."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="a preset with overrides (tiny-gpt2, gpt2:n_layer=2) or file.py:fn")
    p.add_argument("--mesh", default="", help="mesh axes, e.g. dp=2,tp=2 (default: a single device)")
    p.add_argument("--upto", default=None, help=f"stop after this pass: capture, {', '.join(DEFAULT_PIPELINE)}")
    p.add_argument("--dump-dir", default=None, help="write NN-pass.ir after every pass into this directory")
    p.add_argument("--local", action="store_true", help="show each rank's local shapes instead of global ones")
    p.add_argument(
        "--roles", choices=("name", "auto"), default="name",
        help="name (default): each axis does what its name says (dp* data parallel, tp* tensor parallel); "
        "auto: the ILP chooses every placement by cost",
    )  # fmt: skip
    p.add_argument("--alpha", type=float, default=1.0, help="weight of communication bytes in the ILP (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    stages = ["capture", *DEFAULT_PIPELINE]
    upto = args.upto or stages[-1]
    if upto not in stages:
        raise AutoparError(f"--upto {upto!r} is not a pass; choose one of {', '.join(stages)}")
    spec = build(args.model, device="meta")
    options = {"lower": parse_mesh(args.mesh), "shard": ShardOptions(alpha=args.alpha, roles=args.roles)}
    pm = PassManager(FLOW, dump_dir=args.dump_dir, options=options)  # the flow's passes, dumped by its numbers
    call = (spec.model, spec.args, spec.kwargs)
    prog = pm.run(call, stop="lower" if upto == "capture" else upto)  # --upto capture: the IR as lowered
    if pm.dump_dir and upto == stages[-1]:
        _dump_ranks(pm, prog, spec.model)
    sys.stdout.write(print_program(prog, local=args.local))
    return 0


def _dump_ranks(pm: PassManager, prog: Program, model: torch.nn.Module) -> None:
    """Each rank's generated code by the flow's codegen (``09-codegen.rankN.py``), built from the meta model
    (shapes only, no weights), and its IR with local shapes."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    names, sizes = prog.mesh.names, prog.mesh.sizes
    for rank, coord in enumerate(itertools.product(*(range(n) for n in sizes))):
        codegen = CodegenOptions(dict(zip(names, coord)), named.__getitem__, device="meta")
        pm.run(Variants({f"rank{rank}": prog}), start="codegen", options={"codegen": codegen})
        dump_rank_code(pm.dump_dir, rank, prog)
