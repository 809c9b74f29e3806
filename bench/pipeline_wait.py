"""What watching a pipeline transfer for a peer's failure costs (runtime/comm/watch.py ``wait_watching``).

tiny-gpt2 on pp=2 (2 gloo ranks, 1f1b, 4 microbatches): train_step's time with each way of waiting for a
transfer, switched in lockstep on both ranks block by block (A B C A B C ...), so load drift hits all alike:
the thread started per wait (before session 15), the watcher thread (now), and a plain wait (no watching).

    OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline_wait.py [BLOCKS=10] [STEPS=5]
"""

import datetime
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def old_wait(work, timeout, step, *_):  # the thread-per-wait version (HEAD before this change)
    from autopar.runtime.comm import watch

    if step is None or watch._store() is None:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
        return
    box = []

    def run():
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
            box.append(None)
        except BaseException as e:
            box.append(e)

    helper = threading.Thread(target=run, name="autopar-wait", daemon=True)
    helper.start()
    while True:
        helper.join(watch.POLL)
        if box:
            if box[0] is not None:
                raise box[0]
            return
        err = watch.peer_failure(step)
        if err is not None:
            raise err


def off_wait(work, timeout, step, *_):
    work.wait(timeout=datetime.timedelta(seconds=timeout))


def run(rank, port, blocks, steps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    import autopar
    from autopar.models.resolve import build
    from autopar.runtime.comm import watch

    new_wait = watch.wait_watching
    spec = build("tiny-gpt2", device="cpu", seed=0)
    mesh = autopar.init_mesh("cpu", pp=2)
    pipe = autopar.compile(spec.model, mesh, kwargs=spec.kwargs, microbatches=4, schedule="1f1b")
    pipe.make_optimizer(torch.optim.SGD, lr=0.01)
    for _ in range(3):
        pipe.train_step(**spec.kwargs)
    variants = {"old (thread per wait)": old_wait, "new (watcher thread)": new_wait, "off (plain wait)": off_wait}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}  # this process's CPU time (every thread): less hit by the machine's load
    for _ in range(blocks):
        for name, fn in variants.items():
            watch.wait_watching = fn
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                pipe.train_step(**spec.kwargs)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
            cpu[name].append((time.process_time() - c0) / steps * 1e3)
    watch.wait_watching = new_wait
    if rank == 0:
        base, cbase = statistics.median(times["off (plain wait)"]), statistics.median(cpu["off (plain wait)"])
        for name, v in times.items():
            m, c = statistics.median(v), statistics.median(cpu[name])
            print(
                f"{name}: wall {m:.2f} ms/step (x{m / base:.3f} of off), rank 0's CPU {c:.2f} ms/step "
                f"(x{c / cbase:.3f}); medians of {len(v)} blocks of {steps} steps",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    mp.spawn(run, args=(29651, blocks, steps), nprocs=2)
