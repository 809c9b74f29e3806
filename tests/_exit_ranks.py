"""Pairs of gloo ranks that leave through the interpreter's own teardown, as a script run by torchrun does.

``python -m tests._exit_ranks RUNS``: the parent imports torch and autopar once, then for each run forks two
ranks. A rank joins a gloo group, makes its mesh with ``autopar.init_mesh``, a ``Comm`` from it and the
checkpoint's group (importing the checkpoint module then, as ``examples/train_lm.py`` does), broadcasts on
each, keeps mesh and ``Comm`` in globals (as a user's script keeps its mesh and module), calls
``dist.destroy_process_group()`` as users do, and returns through ``sys.exit`` into ``Py_FinalizeEx``.
The race of pytorch#179291 (a gloo worker taking the GIL to drop a finished work's tensors after
finalization began: SIGABRT, "terminate called without an active exception") is widened: the switch
interval is 1 s, so the main thread keeps the GIL from its last collective into finalization instead of
handing it over within 5 ms. An ``atexit`` check registered before autopar's shutdown (so it runs after
it) exits 3 when a gloo worker thread is still alive (``--aborts-only`` leaves it out, to count the
aborts themselves). Prints one line per failed rank; exits 1 if any rank of any run died by a signal or
exited non-zero.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys

import torch
import torch.distributed as dist

import autopar
from autopar.runtime.comm.context import Comm
from autopar.runtime.comm.teardown import gloo_threads
from tests._dist import _free_port

KEPT: list = []


def _no_gloo_threads_left() -> None:
    if gloo_threads():
        print(f"rank {dist.get_rank() if dist.is_initialized() else '?'}: {gloo_threads()} gloo threads at exit")
        sys.stdout.flush()
        os._exit(3)


def rank_main(rank: int, port: int, check: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    sys.setswitchinterval(1.0)  # widens the race (module docstring); autopar's teardown must not depend on it
    if check:
        atexit.register(_no_gloo_threads_left)  # registered first: runs after autopar's shutdown
    dist.init_process_group("gloo")
    mesh = autopar.init_mesh("cpu", dp=2)
    comm = Comm.from_device_mesh(mesh)
    # imported once the group exists, as examples/train_lm.py does: DCP imports torch.distributed.nn.functional,
    # whose defaults (group=group.WORLD) then hold the default group
    checkpoint = importlib.import_module("autopar.runtime.checkpoint.save_load")
    groups = [comm.groups["dp"], checkpoint._checkpoint_group(), None]  # None: the default group
    for _ in range(10):
        for g in groups:
            t = torch.randn(64)
            dist.broadcast(t, 0, group=g)
    KEPT.extend([mesh, comm])
    dist.destroy_process_group()


def main(runs: int, check: bool = True) -> int:
    bad = 0
    for run in range(runs):
        port = _free_port()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                rank_main(rank, port, check)
                sys.exit(0)  # through Py_FinalizeEx, where the abort happens
            pids.append(pid)
        for rank, pid in enumerate(pids):
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
                bad += 1
                how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
                print(f"run {run} rank {rank}: {how}", flush=True)
    print(f"{bad} of {2 * runs} ranks failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), check="--aborts-only" not in sys.argv))
