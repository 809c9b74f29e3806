"""The data position as a checkpoint object (autopar/data.py): a torch DataLoader over autopar's BatchSampler is
saved with the model on dp=2 x tp=2 after three of an epoch's six global batches, and resumed on dp=4: the
resumed run draws the next global batch, each rank its new rows of it, so every sample of the epoch is seen
exactly once (before, ``objects={"data": loader}`` failed: a DataLoader has no state_dict). One spawned group
of 4 gloo ranks, a small MLP with a local batch."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytestmark = pytest.mark.multiproc

SIZE, BATCH = 48, 8


class Items(torch.utils.data.Dataset):
    """Item i: its index and a fixed input and target."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"i": i, "x": torch.randn(16, generator=g), "target": torch.randn(16, generator=g)}


def _run(model, loader, sampler, epochs: int, steps: int | None = None) -> list[int]:
    seen: list[int] = []
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for n, batch in enumerate(loader):
            seen += batch["i"].tolist()
            model.train_step(x=batch["x"], target=batch["target"])
            if steps is not None and n + 1 == steps:
                return seen
    return seen


def resume_on_another_dp(rank: int, world: int, path: str) -> dict:
    import autopar
    from autopar import checkpoint
    from autopar.data import BatchSampler
    from tests.test_roles import MLP

    example = {"x": torch.randn(BATCH, 16), "target": torch.randn(BATCH, 16)}
    out = {}
    for phase, axes in (("a", {"dp": 2, "tp": 2}), ("b", {"dp": 4})):
        torch.manual_seed(0)
        mesh = autopar.init_mesh("cpu", **axes)
        model = autopar.compile(MLP(), mesh, kwargs=example, batch="local")
        model.make_optimizer(torch.optim.SGD, lr=0.1)
        sampler = BatchSampler(SIZE, BATCH, model, seed=5)
        loader = torch.utils.data.DataLoader(Items(), batch_sampler=sampler)
        if phase == "a":
            out["a"] = _run(model, loader, sampler, epochs=1, steps=3)
            checkpoint.save(path, model, objects={"data": loader})
        else:
            checkpoint.load(path, model, objects={"data": loader})
            out["epoch"], out["position"] = sampler.epoch, sampler.position
            out["b"] = _run(model, loader, sampler, epochs=1)
    return out


def test_the_data_position_reshards_when_dp_changes_on_resume(tmp_path):
    results = run_distributed(resume_on_another_dp, 4, str(tmp_path / "ckpt"))
    # dp=2 x tp=2: ranks 0 and 2 are the two dp ranks (tp replicas take the same rows); dp=4: all four
    assert results[0]["a"] == results[1]["a"] and results[2]["a"] == results[3]["a"]
    before = results[0]["a"] + results[2]["a"]
    after = [i for r in results for i in r["b"]]
    assert len(before) == 3 * BATCH and len(after) == 3 * BATCH
    assert all((r["epoch"], r["position"]) == (0, 3) for r in results)
    assert sorted(before + after) == list(range(SIZE))  # every sample once: none twice, none skipped


def test_a_loader_without_a_position_says_what_to_use():
    from autopar.data import BatchSampler, checkpointable
    from autopar.errors import BatchError, CheckpointError

    with pytest.raises(CheckpointError, match="keeps no position"):
        checkpointable(torch.utils.data.DataLoader(Items(), batch_size=4), "data")
    with pytest.raises(CheckpointError, match="StatefulDataLoader"):
        checkpointable(torch.utils.data.DataLoader(Items(), batch_sampler=BatchSampler(SIZE, 4), num_workers=2))
    sampler = BatchSampler(SIZE, 4, seed=1)
    with pytest.raises(BatchError, match="batch_size 8"):
        sampler.load_state_dict(BatchSampler(SIZE, 8, seed=1).state_dict())
