"""``autopar.compile``'s modules of every rank of a mesh on the rank simulator: a plan trained in one process.

    sim = SimCompiled.of(model, MeshSpec((("pp", 2), ("tp", 2))), kwargs=batch, microbatches=2)
    sim.make_optimizer(torch.optim.SGD, lr=0.1)
    loss = sim.train_step(**batch)     # every rank's train_step, each in its own thread
    state = sim.full_state_dict()      # the user's state-dict keys, whole

The programs are planned as ``compile`` plans them (``autopar/build.py``) and each simulated rank
builds the same ``ParallelModule`` a real rank builds, over the simulator's process groups and
point-to-point (``runtime/sim/ranksim.py``); so pipelines (every schedule, recomputation, sub-pipelined
tensor parallelism, ZeRO) run as they do on gloo, without spawning processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from autopar.build import ModuleParts, build_module, plan_programs
from autopar.check.float64 import to_float64
from autopar.ir.core import MeshSpec, Program
from autopar.passes.capture import capture
from autopar.passes.dropout import has_keyed
from autopar.passes.shard import ShardOptions
from autopar.runtime.build.rng import DropoutRng
from autopar.runtime.call.batch import sub_microbatch
from autopar.runtime.module import ParallelModule, RuntimeOptions
from autopar.runtime.sim.ranksim import SimWorld
from autopar.schedule.generators import make_schedule

T = TypeVar("T")


class SimCompiled:
    """The ``ParallelModule`` of every simulated rank of one compile; each call runs on every rank."""

    def __init__(self, world: SimWorld, modules: list[ParallelModule], program: Program | None = None):
        self.world, self.modules = world, modules
        self.program = program  # the planned whole-mesh forward program the modules were built from

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        mesh: MeshSpec,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        options: ShardOptions | None = None,
        microbatches: int = 1,
        schedule: str = "1f1b",
        schedule_options: dict | None = None,
        sub_pipeline_tp: bool = False,
        sharded: Program | None = None,
        seed: int = 0,
        timeout: float = 120.0,
        float64: bool = False,
    ) -> SimCompiled:
        """Plan ``model(*args, **kwargs)`` (the global batch) on ``mesh`` as ``autopar.compile`` does (priced on
        ``options.cluster``: compile adds this machine's spec when it names none), or use
        the planned whole-mesh program ``sharded``, and build every rank's module (the arguments are
        ``compile``'s; dropout seeds come from ``torch.initial_seed()``). ``float64``: the programs with every
        float in float64 (``autopar/check/float64.py``; compare with the model run under ``Float64Mode``)."""
        kwargs = dict(kwargs or {})
        run = RuntimeOptions(microbatches, timeout, False, sub_pipeline_tp)
        example = sub_microbatch(args, kwargs, microbatches, run.sub_microbatches)
        captured = capture(model, *example)
        sched = make_schedule(schedule, mesh.pipeline_size, microbatches, **dict(schedule_options or {}))
        forward, train = plan_programs(captured, mesh, sched, options, sharded, sub_pipeline_tp=sub_pipeline_tp)
        if float64:
            forward, train = to_float64(forward), (to_float64(train) if train is not None else None)
        parts = ModuleParts(model, captured, example, forward, train, sched, options, run, seed)
        world = SimWorld(mesh, timeout=timeout)
        keyed = has_keyed(forward.ops)
        n = microbatches * run.sub_microbatches

        def build(rank: int) -> ParallelModule:
            rng = DropoutRng(torch.initial_seed(), microbatches=n) if keyed else None
            return build_module(parts, world.comm(rank), torch.device("cpu"), world.device_mesh(rank), rng)

        return cls(world, world.run(build), forward)

    def run(self, fn: Callable[[ParallelModule], T]) -> list[T]:
        """``fn(module)`` on every rank (each in its own thread); the results by rank."""
        return self.world.run(lambda rank: fn(self.modules[rank]))

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.run(lambda m: m.make_optimizer(optimizer_cls, **kwargs))

    def train_step(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """Every rank's ``train_step`` on the global batch; each rank's loss, by rank."""
        return self.run(lambda m: m.train_step(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self.run(lambda m: m(*args, **kwargs))

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every key of the user's ``model.state_dict()``, whole (rank 0's copy; every rank computes one)."""
        return self.run(lambda m: m.full_state_dict(grads))[0]


__all__ = ["SimCompiled"]
