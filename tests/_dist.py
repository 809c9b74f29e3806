"""Helpers to run a function on N gloo processes from a test (one thread each, bounded in time)."""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, result_dir: str, timeout: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        torch.save(out, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(result_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return each rank's result."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_worker, args=(world, _free_port(), fn, args, d, timeout), nprocs=world, join=True)
        except Exception as e:
            errs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(errs)) from e
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(world)]
