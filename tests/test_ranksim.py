"""The rank simulator (runtime/ranksim.py) after a failed run: the next run of the same world starts clean."""

from __future__ import annotations

import time

import pytest
import torch

from autopar.errors import SimulationError
from autopar.ir.core import MeshSpec
from autopar.runtime import collectives as coll
from autopar.runtime.ranksim import SimWorld


def test_a_collective_left_half_met_by_a_failed_run_does_not_leak_into_the_next():
    """Rank 1 waits in an all-reduce when rank 0 fails; the next run's all-reduces must meet afresh. Without the
    reset, rank 1's stale contribution stays in the meeting point and the next run fails (shown once), which made
    test_check's failure reports depend on thread timing. Cost: ~0.1 s."""
    world = SimWorld(MeshSpec((("tp", 2),)), timeout=10.0)
    rv = world.group("tp", 0).rv  # the tp group's meeting point

    def fail_once_joined(rank: int) -> None:
        if rank == 0:
            while rv.arrived == 0:  # rank 1 is inside the all-reduce: now fail
                time.sleep(0.001)
            raise ValueError("boom")
        with coll.use_comm(world.comm(rank)):
            coll.all_reduce(torch.full((1,), 100.0), "tp")

    with pytest.raises(SimulationError, match="rank 0 .*boom"):
        world.run(fail_once_joined)

    def reduce(rank: int) -> float:
        with coll.use_comm(world.comm(rank)):
            return float(coll.all_reduce(torch.full((1,), float(rank + 1)), "tp"))

    assert world.run(reduce) == [3.0, 3.0]
