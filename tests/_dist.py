"""Helpers to run a function on N gloo processes from a test (one thread each, bounded in time).

The ranks are forked from a forkserver that imported torch, transformers and autopar once per test
session (``PRELOAD``), not spawned: a spawned rank spends seconds of CPU importing them again, times
four ranks, times every process group the suite starts. A forked rank starts from the server's state
(the modules imported, nothing run), takes the caller's environment (``os.environ`` at the call, as a
spawned one would) and runs with one thread.
"""

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


# what nearly every distributed test imports; a module missing here is imported by the rank itself
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "autopar",
    "autopar.models.resolve",
    "tests.equivalence",
    "tests.exactness",
]
_started = False


def _worker(rank: int, world: int, port: int, fn, args, result_dir: str, timeout: float, env: dict[str, str]):
    os.environ.clear()
    os.environ.update(env)
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


def forkserver():
    """The multiprocessing context whose processes fork from the preloaded server (``PRELOAD``)."""
    global _started
    if not _started:  # the preload list is read when the forkserver starts, at the first use
        mp.set_forkserver_preload(PRELOAD)
        _started = True
    return mp.get_context("forkserver")


def run_distributed(fn, world: int, *args, timeout: float = 580.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return each rank's result."""
    forkserver()
    with tempfile.TemporaryDirectory() as d:
        try:
            args = (world, _free_port(), fn, args, d, timeout, dict(os.environ))
            mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="forkserver")
        except Exception as e:
            errs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(errs)) from e
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=True) for r in range(world)]
