"""Issue 14's table, re-measured on the rank simulator: Hugging Face families trained by autopar on dp=2 x tp=2
and pp=2 x tp=2 against the same model in one process.

Run from the repository root::

    .venv/bin/python bench/families_table.py > /tmp/families.md

Each family (``autopar/models/small_families.py``: T5 and the decoders by default, ``--families all`` for every
one) is trained in float64 for ``--steps`` steps of AdamW and of SGD with momentum (``tests/exactness.py``'s
settings) on every simulated rank (``autopar/check/simtrain.py``: the ``ParallelModule`` each real rank builds,
its collectives and pipeline point-to-point computed over the simulated ranks) and in one process, every
float in float64 on both sides (``autopar/check/float64.py``: Hugging Face computes RMS norms and rotary tables in
float32 whatever the model's dtype, whose rounding a sharded reduction changes by ~1e-9). Each
cell is the largest relative difference over both optimizers and both objectives (the fastest plan priced
on a slow-compute cluster, so ops split; least memory) of the per-step losses, and of every state-dict
entry after the last step (max |x - x_ref| / max |x_ref| per tensor). Pipelines run 1F1B over 2
microbatches (1 for a model with batch norm, whose statistics are a microbatch's). Nothing is timed: the
numbers do not depend on the machine.
"""

from __future__ import annotations

import argparse
import copy

import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec
from autopar.models.small_families import FAMILIES
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec

DECODERS = ["t5", "gpt2", "opt", "llama", "bloom", "falcon", "mistral", "mixtral"]
MESHES = {"dp=2 x tp=2": MeshSpec((("dp", 2), ("tp", 2))), "pp=2 x tp=2": MeshSpec((("pp", 2), ("tp", 2)))}
SLOW = ClusterSpec.load("local-cpu:peak_flops.fp32=1MFLOP/s,memory_bandwidth=1MB/s").replace(
    nodes=1, devices_per_node=4
)
OBJECTIVES = {"time": ShardOptions(objective="time", cluster=SLOW), "memory": ShardOptions(objective="memory")}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
}


def _float64(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """The model in float64, all-zero parameters given small random values (as ``tests/exactness.py``)."""
    model = model.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not ref.is_floating_point() or not ref.abs().max() > 0:
        return 0.0 if torch.equal(x.to(ref.dtype), ref) else float("inf")
    return float((x.to(ref.dtype) - ref).abs().max() / ref.abs().max())


def run(family: str, mesh: MeshSpec, objective: str, optimizer: str, steps: int) -> tuple[float, float]:
    """(largest relative loss difference, largest relative state difference) of ``steps`` steps."""
    torch.manual_seed(0)
    model, batch = FAMILIES[family](torch.Generator().manual_seed(1))
    model = _float64(model)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    reference = copy.deepcopy(model)
    cls, kw = OPTIMIZERS[optimizer]
    # batch norm's statistics are a microbatch's, as on real ranks: one microbatch for such a model
    batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    micro = 2 if mesh.pipeline_size > 1 and not batch_norm else 1
    sim = SimCompiled.of(model, mesh, (), batch, options=OBJECTIVES[objective], microbatches=micro, float64=True)
    sim.make_optimizer(cls, **kw)
    opt = cls(reference.parameters(), **kw)
    loss_err = 0.0
    for _ in range(steps):
        losses = sim.train_step(**batch)
        with Float64Mode():  # the model's float32 upcasts in float64, as in the simulated programs
            ref = reference(**batch)
            ref.backward()
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, *(_rel(x.detach(), ref.detach()) for x in losses))
    full = sim.full_state_dict()
    state = reference.state_dict()
    # batch norm's step counter is not counted by autopar (tests/test_families_sim.py)
    state_err = max(_rel(full[k], v) for k, v in state.items() if not k.endswith("num_batches_tracked"))
    return loss_err, state_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(DECODERS), help="comma-separated, or 'all'")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    print("| family | " + " | ".join(MESHES) + " |")
    print("|---|" + "---|" * len(MESHES))
    for family in families:
        cells = []
        for mesh in MESHES.values():
            runs = [run(family, mesh, o, opt, args.steps) for o in OBJECTIVES for opt in OPTIMIZERS]
            loss, state = max(r[0] for r in runs), max(r[1] for r in runs)
            verdict = "exact" if max(loss, state) < 1e-10 else "**DIFFERS**"
            cells.append(f"{verdict} (loss {loss:.1e}, parameters {state:.1e})")
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
