"""The optional extras in the lock, used as a user would: torchdata's ``StatefulDataLoader`` as a checkpoint
object (its position saved and restored with the model) and the TensorBoard metrics writer (its events read
back with TensorBoard's own reader). One process, one compile."""

from __future__ import annotations

import pytest
import torch

import autopar
from tests.equivalence import tiny_gpt2


def test_stateful_dataloader_resumes_and_tensorboard_writes_events(one_rank, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torchdata.stateful_dataloader import StatefulDataLoader

    from autopar import checkpoint
    from autopar.metrics import tensorboard_writer

    model, batches = tiny_gpt2(steps=1)
    logs = tmp_path / "tb"
    pipe = autopar.compile(model, one_rank, kwargs=batches[0], on_metrics=tensorboard_writer(str(logs)))
    pipe.make_optimizer(torch.optim.SGD, lr=0.1)
    ids = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": torch.roll(row, -1, 0)} for row in ids]

    def loader():
        return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))

    it_loader = loader()
    it = iter(it_loader)
    losses = [pipe.train_step(**next(it)).item() for _ in range(2)]
    checkpoint.save(tmp_path / "ckpt", pipe, objects={"data": it_loader})
    after = [next(it)["input_ids"] for _ in range(3)]  # the batches an uninterrupted run sees next
    resumed = loader()
    checkpoint.load(tmp_path / "ckpt", pipe, objects={"data": resumed})
    again = iter(resumed)
    got = [next(again)["input_ids"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(after, got)), "the resumed loader continues where the saved one was"
    assert not torch.equal(got[0], next(iter(loader()))["input_ids"]), "a fresh loader would start elsewhere"

    events = EventAccumulator(str(logs))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx(losses, rel=1e-6)  # float32 scalars in the event file
    assert {"train/tokens_per_second", "train/grad_norm"} <= set(events.Tags()["scalars"])
