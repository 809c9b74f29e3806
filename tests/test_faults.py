"""Faults and bad input (issue 34): no checkpoint lost to a killed save, ``latest`` past a damaged one,
out-of-vocabulary ids and labels, plan files that cannot run code, bounded waits, agreed errors,
non-finite steps, named errors instead of internal tracebacks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._dist import forkserver


@contextlib.contextmanager
def _one_process():
    """This process as a world of one (gloo), for a single-process ParallelModule."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp_run():
    """tiny-mlp compiled for one process, its optimizer, and its batch (one step trained)."""
    import autopar
    from autopar.models.resolve import build

    spec = build("tiny-mlp", device="cpu", seed=0)
    pipe = autopar.compile(spec.model, autopar.init_mesh("cpu", dp=1), args=spec.args, kwargs=spec.kwargs)
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-2)
    pipe.train_step(*spec.args, **spec.kwargs)
    return pipe, opt, spec


# -- checkpoints: a killed save loses nothing; latest passes over a damaged one --------------------------------

KILL_POINTS = ("committing", "replacing")  # after every file is written, before the manifest; between renames


def _save_then_block(root: str, where: str) -> None:
    """Save to ``root/last`` at step 1, train two steps (the reference losses), then save to the same folder
    again and block at the kill point ``where`` (a file says it got there) until the test kills this process."""
    from autopar.runtime.checkpoint import files
    from autopar.runtime.checkpoint import save_load as checkpoint

    root_path = Path(root)
    ready = root_path / f"ready-{where}"

    def block(*_args, **_kwargs):
        ready.write_text("blocked")
        time.sleep(600)

    with _one_process():
        pipe, opt, spec = _mlp_run()
        checkpoint.save(root_path / "last", pipe, opt, step=1)
        losses = [pipe.train_step(*spec.args, **spec.kwargs).item() for _ in range(2)]
        (root_path / "reference.json").write_text(json.dumps(losses))
        if where == "committing":  # DCP wrote every file into the staging folder; no manifest yet
            checkpoint.commit = block
        else:  # the old checkpoint moved aside, the new one not yet renamed into place
            rename, calls = os.rename, []

            def second_blocks(src, dst):
                calls.append(src)
                if len(calls) == 2:
                    block()
                rename(src, dst)

            files.os.rename = second_blocks
        checkpoint.save(root_path / "last", pipe, opt, step=3)
    os._exit(0)  # the save finished without reaching the kill point: the test sees no ready file


@pytest.mark.multiproc
@pytest.mark.parametrize("where", KILL_POINTS)
def test_a_save_killed_over_the_previous_checkpoint_leaves_it_loadable(tmp_path, where):
    """SIGKILL during a save into the folder of the previous checkpoint (``ckpt/last``): ``latest`` still
    finds the previous one and training resumed from it gives the uninterrupted run's losses exactly.
    Before staged saves the first save's manifest was deleted before writing, so ``latest`` returned None.
    Cost: one forked process and two compiles of tiny-mlp per kill point."""
    from autopar.runtime.checkpoint import save_load as checkpoint

    proc = forkserver().Process(target=_save_then_block, args=(str(tmp_path), where))
    proc.start()
    ready = tmp_path / f"ready-{where}"
    while not ready.exists() and proc.is_alive():
        time.sleep(0.05)
    assert ready.exists(), f"the save finished without reaching the kill point {where!r}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    reference = json.loads((tmp_path / "reference.json").read_text())

    found = checkpoint.latest(tmp_path)
    assert found is not None, "the killed save lost the previous checkpoint"
    with _one_process():
        pipe, opt, spec = _mlp_run()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "replacing": load says it reads the checkpoint moved aside
            checkpoint.load(tmp_path / "last", pipe, opt)
        resumed = [pipe.train_step(*spec.args, **spec.kwargs).item() for _ in range(2)]
        assert resumed == reference
        # the next save to the same folder recovers it and replaces it whole
        checkpoint.save(tmp_path / "last", pipe, opt, step=5)
        assert checkpoint.latest(tmp_path) == tmp_path / "last"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_latest_passes_over_a_damaged_checkpoint_and_load_of_none_is_named(tmp_path):
    """A committed newest checkpoint with a truncated shard is passed over (a warning names it) for the intact
    one before; ``load(None)`` and ``load(latest(empty))`` raise ``CheckpointError``. Before: latest returned
    the damaged one and load(None) raised a bare TypeError. Cost: one process, one compile of tiny-mlp."""
    from autopar.errors import CheckpointError
    from autopar.runtime.checkpoint import save_load as checkpoint

    with _one_process():
        pipe, opt, _ = _mlp_run()
        first = checkpoint.save(tmp_path / "step-1", pipe, opt, step=1)
        second = checkpoint.save(tmp_path / "step-2", pipe, opt, step=2)
        assert checkpoint.latest(tmp_path) == second
        shard = sorted(second.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:-7])
        with pytest.warns(UserWarning, match="damaged checkpoint .*step-2.*truncated"):
            assert checkpoint.latest(tmp_path) == first
        with pytest.warns(UserWarning, match="damaged checkpoint .*step-2.*truncated"):
            assert checkpoint.latest(tmp_path, checksums=False) == first
        checkpoint.load(first, pipe, opt)
        with pytest.raises(CheckpointError, match="got None"):
            checkpoint.load(None, pipe, opt)
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(CheckpointError, match="got None"):
            checkpoint.load(checkpoint.latest(empty), pipe, opt)
        # a folder holding other files is not replaced (that would delete them)
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
        with pytest.raises(CheckpointError, match="not a checkpoint's"):
            checkpoint.save(tmp_path / "notes", pipe, opt, step=3)
        assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
