"""Checkpoints resume training exactly on every mesh; a dead rank stops the others with a clear error."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback

import pytest
import torch

from tests._dist import _free_port, run_distributed

pytestmark = pytest.mark.multiproc


def _resume(rank: int, world: int, path: str) -> dict:
    """3 steps straight vs 1 step, save, a fresh compile, load, 2 steps: on three meshes (dp x tp from a
    meta-device model with ZeRO-3, pp x dp with ZeRO-2, pp x tp) and two optimizers."""
    import autopar
    from autopar.models import build
    from autopar.passes.shard import ShardOptions
    from autopar.runtime import checkpoint
    from autopar.solver.cost import TrainingSetup
    from tests.equivalence import make_batches

    spec = build("tiny-gpt2:batch=8", device="cpu", seed=0)
    batches = make_batches(spec.model, spec.kwargs, 3)
    meta = build("tiny-gpt2:batch=8", device="meta").model  # initialized shard by shard from the seed
    out = {}
    cases = {
        # no pipeline: a one-stage module on dp x tp, from a meta-device model, ZeRO-3 over dp
        "dp2tp2-meta-zero3": ({"dp": 2, "tp": 2}, "1f1b", {}, ShardOptions(setup=TrainingSetup(zero=3)), True),
        # ZeRO-2 over dp: optimizer states are slices of a flat vector
        "pp2dp2-zero2": ({"pp": 2, "dp": 2}, "1f1b", {}, ShardOptions(setup=TrainingSetup(zero=2)), True),
        # the user's own AdamW over the local shards, interleaved stages, tensor parallel
        "pp2tp2-interleaved": ({"pp": 2, "tp": 2}, "interleaved", {"chunks": 2}, None, False),
    }
    for case, (axes, sched, sopts, options, zero) in cases.items():
        mesh = autopar.init_mesh("cpu", **axes)

        model = meta if "meta" in case else spec.model

        def fresh(mesh=mesh, sched=sched, sopts=sopts, options=options, zero=zero, model=model):
            pipe = autopar.compile(
                model,
                mesh,
                kwargs=batches[0],
                microbatches=4,
                schedule=sched,
                schedule_options=sopts,
                options=options,
            )
            if zero:
                return pipe, pipe.make_optimizer(torch.optim.AdamW, lr=1e-3), None
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
            return pipe, opt, opt

        def step(pipe, user_opt, b):
            loss = pipe.train_step(**b)
            if user_opt is not None:
                user_opt.step()
                user_opt.zero_grad()
            return loss.item()

        pipe, opt, user = fresh()
        straight = [step(pipe, user, b) for b in batches]
        final = {k: v.clone() for k, v in pipe.full_state_dict().items()}

        pipe, opt, user = fresh()
        first = step(pipe, user, batches[0])
        where = os.path.join(path, case)
        checkpoint.save(where, pipe, opt, extra={"step": 1})
        pipe, opt, user = fresh()  # a new process would start from here
        extra = checkpoint.load(where, pipe, opt)
        resumed = [first] + [step(pipe, user, b) for b in batches[extra["step"] :]]
        after = pipe.full_state_dict()
        out[case] = {
            "straight": torch.tensor(straight),
            "resumed": torch.tensor(resumed),
            "param_max_diff": torch.tensor(max((after[k] - final[k]).abs().max().item() for k in final)),
        }
    return out


def test_save_and_resume_gives_the_uninterrupted_losses(tmp_path):
    results = run_distributed(_resume, 4, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert torch.equal(r["resumed"], r["straight"]), (case, rank, r["resumed"], r["straight"])
            assert r["param_max_diff"] == 0, (case, rank)


def _dying(rank: int, world: int, port: int, result: str, timeout: float) -> None:
    """Rank 1 trains one step and exits abruptly; rank 0 reports how its second step ended."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(240, exit=True)  # the test's own guard: never hang CI
    from autopar.models import build
    from tests.equivalence import make_batches

    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autopar

    spec = build("tiny-gpt2:batch=8", device="cpu", seed=0)
    batches = make_batches(spec.model, spec.kwargs, 2)
    mesh = autopar.init_mesh("cpu", pp=2)
    # record=False: no barrier opens the step, so the failure surfaces in the point-to-point transfers
    pipe = autopar.compile(
        spec.model, mesh, kwargs=batches[0], microbatches=4, schedule="1f1b", timeout=timeout, record=False
    )
    pipe.train_step(**batches[0])
    if rank == 1:
        os._exit(3)  # dies without a word, as a killed process does
    t0 = time.perf_counter()
    try:
        pipe.train_step(**batches[1])
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        outcome = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(result, "w") as f:
        f.write(f"{time.perf_counter() - t0:.3f}\n{outcome}")
    os._exit(0)


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port, result, timeout = _free_port(), str(tmp_path / "rank0.txt"), 20.0
    procs = [ctx.Process(target=_dying, args=(r, 2, port, result, timeout)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert os.path.exists(result), "rank 0 neither finished nor failed: it hung"
    seconds, outcome = open(result).read().split("\n", 1)
    assert outcome.startswith("RuntimeCommError"), outcome
    assert "rank 0 (pipeline rank 0)" in outcome and "peer rank probably died" in outcome
    assert float(seconds) < 2 * timeout + 10  # bounded by the transfer timeout, not forever
