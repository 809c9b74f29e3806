"""Test-session settings: one thread per process, and one shared on-disk cache of solved plans."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory):
    # The planning cache is keyed by the printed IR and the options, so sharing it across tests is
    # safe; it saves re-solving the same ILP in every spawned process group.
    os.environ.setdefault("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("plans")))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
