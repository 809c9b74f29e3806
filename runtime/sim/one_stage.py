"""A sharded program without stages as a one-stage ``ParallelModule`` (the rank simulator's ``autopar check``,
and tests that train a program through ``forward``)."""

from __future__ import annotations

import torch

from autopar.ir.core import Program
from autopar.runtime.build.rng import DropoutRng
from autopar.runtime.build.stages import one_stage
from autopar.runtime.comm.context import Comm
from autopar.runtime.module import ParallelModule
from autopar.schedule.generators import make_schedule
from autopar.solver.sharding.cost import TrainingSetup


def one_stage_module(
    program: Program,
    in_spec,
    out_spec,
    comm: Comm,
    get_value,
    device: torch.device | str = "cpu",
    *,
    setup: TrainingSetup | None = None,
    rng: DropoutRng | None = None,
) -> ParallelModule:
    """The module of a sharded program without stages, run as one stage (forward only: the rank
    simulator's ``autopar check``, and tests that train a program through ``forward``)."""
    staged = one_stage(program)
    return ParallelModule(
        staged, None, make_schedule("1f1b", 1, 1), in_spec, out_spec, comm, get_value, device, setup, rng=rng
    )


__all__ = ["one_stage_module"]
