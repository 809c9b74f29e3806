"""Start one benchmark worker of N local gloo processes: one thread, a free port, bounded in time."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import socket

import torch
import torch.distributed as dist

from autopar.runtime.comm.teardown import shutdown_at_exit


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model flags the runtime benchmarks share: issue 13's GPT-2 / LLaMA (4 layers, hidden 256, vocab
    4096, batch 8 x 128), and how long a worker may run before it prints its stacks and exits."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900, help="seconds before a worker dumps its stacks and exits")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world: int, port: int, timeout: float) -> None:
    """Join the gloo group on ``port`` with one compute thread; print every stack and exit after
    ``timeout`` seconds, so a hung peer cannot hold the machine (shared/BENCHMARKING.md). At exit every
    process group is destroyed and freed before the interpreter finalizes (``autopar.runtime.comm.teardown``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(timeout, exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    # autopar's and the torch peers' groups alike destroyed and freed before the interpreter finalizes
    shutdown_at_exit()


def spawn_json(run_one, ranks: int, *args) -> dict:
    """Run ``run_one(rank, ranks, port, *args, out)`` on ``ranks`` fresh processes; the JSON that rank 0 wrote to
    ``out`` (a file in a temporary folder)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(run_one, args=(ranks, free_port(), *args, out), nprocs=ranks, join=True)
        with open(out) as f:
            return json.load(f)
