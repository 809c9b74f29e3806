"""Issue 31's table, re-measured on the rank simulator: mixtures of experts with each of transformers' experts
kernels, trained by autopar on dp=2 x tp=2 and pp=2 x tp=2 against the same model in one process.

Run from the repository root::

    .venv/bin/python bench/moe_table.py > /tmp/moe.md

Each family (``autopar/models/small_families.py``'s ``moe``: Mixtral, Qwen3-MoE, OLMoE by default, one layer,
hidden 32, 4 experts, top-2; ``--families`` adds ``deepseek_v3``) is built with each kernel (``grouped_mm``, the
default; ``batched_mm``; ``eager``, the loop over the experts hit) and trained in float64 for ``--steps`` AdamW
steps on every simulated rank (``autopar/check/simtrain.py``) and in one process with the same kernel, every float
in float64 on both sides (``autopar/check/float64.py``, which also computes torch._grouped_mm in float64, a dtype
its kernels lack). On dp=2 x tp=2 the loss includes the router's load-balancing loss (coefficient 0.01); on
pp=2 x tp=2 it does not (a pipeline computes it per microbatch, which is not the batch's). Each cell is the
largest relative difference over both objectives (the fastest plan priced on a slow-compute cluster, so ops
split; least memory) of the per-step losses and of every state-dict entry after the last step
(max |x - x_ref| / max |x_ref| per tensor). Nothing is timed: the numbers do not depend on the machine.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec
from autopar.models.small_families import KERNELS, moe
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's bench package
from bench.families_table import _float64, _rel  # noqa: E402 (the same float64 model and relative difference)

FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]
AUX_LOSS = 0.01
# as bench/families_table.py
MESHES = {"dp=2 x tp=2": MeshSpec((("dp", 2), ("tp", 2))), "pp=2 x tp=2": MeshSpec((("pp", 2), ("tp", 2)))}
SLOW = ClusterSpec.load("local-cpu:peak_flops.fp32=1MFLOP/s,memory_bandwidth=1MB/s").replace(
    nodes=1, devices_per_node=4
)
OBJECTIVES = {"time": ShardOptions(objective="time", cluster=SLOW), "memory": ShardOptions(objective="memory")}


def run(family: str, kernel: str, mesh, objective: str, steps: int) -> tuple[float, float]:
    """(largest relative loss difference, largest relative state difference) of ``steps`` AdamW steps."""
    torch.manual_seed(0)
    pipeline = mesh.pipeline_size > 1
    model, batch = moe(family, kernel, aux_loss=0.0 if pipeline else AUX_LOSS)(torch.Generator().manual_seed(1))
    model = _float64(model)
    reference = copy.deepcopy(model)
    micro = 2 if pipeline else 1
    sim = SimCompiled.of(model, mesh, (), batch, options=OBJECTIVES[objective], microbatches=micro, float64=True)
    sim.make_optimizer(torch.optim.AdamW, lr=1e-3)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    loss_err = 0.0
    for _ in range(steps):
        losses = sim.train_step(**batch)
        with Float64Mode():
            ref = reference(**batch)
            ref.backward()
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, *(_rel(x.detach(), ref.detach()) for x in losses))
    full = sim.full_state_dict()
    state_err = max(_rel(full[k], v) for k, v in reference.state_dict().items())
    return loss_err, state_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print("| family | kernel | " + " | ".join(MESHES) + " |")
    print("|---|---|" + "---|" * len(MESHES))
    for family in args.families.split(","):
        for kernel in KERNELS:
            cells = []
            for mesh in MESHES.values():
                runs = [run(family, kernel, mesh, o, args.steps) for o in OBJECTIVES]
                loss, state = max(r[0] for r in runs), max(r[1] for r in runs)
                verdict = "exact" if max(loss, state) < 1e-10 else "**DIFFERS**"
                cells.append(f"{verdict} (loss {loss:.1e}, parameters {state:.1e})")
            print(f"| {family} | {kernel} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
