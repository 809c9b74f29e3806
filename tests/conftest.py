"""Test-session settings: one thread per process, one shared on-disk cache of solved plans; one-rank groups."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.comm.context import Comm


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory):
    # The planning cache is keyed by the printed IR and the options, so sharing it across tests is
    # safe; it saves re-solving the same ILP in every spawned process group.
    os.environ.setdefault("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("plans")))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield


@pytest.fixture
def one_rank_tp():
    """A gloo group of one process as the ``tp`` axis: every collective runs (asynchronously too)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Comm(groups={"tp": dist.group.WORLD}, coords={"tp": 0}, sizes={"tp": 1})
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """A gloo world of one process (joined where a test already made one) and its ``dp=1`` mesh."""
    import autopar

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield autopar.init_mesh("cpu", dp=1)
    if started:
        dist.destroy_process_group()
