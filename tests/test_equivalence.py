"""Parallel training equals single-process training in float64: losses and every parameter within 1e-10.

One process group per mesh runs every model and strategy on it (tests/equivalence.py): three SGD steps
from one seed, compared with a single-process run (tests/exactness.py says why float64, SGD and
non-zero starting parameters). AdamW runs once (ZeRO-2 on dp=2), and on tp=2 a run with one
row-parallel all-reduce dropped proves that the comparison sees a sharding bug. On dp=2 GPT-2 also
trains with its gradients zeroed in place: they are the gradient buckets' slices and accumulate there;
and with two batches accumulated per step, the first backward inside ``no_sync()``."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed
from tests.equivalence import compare_models
from tests.exactness import TOL

pytestmark = pytest.mark.multiproc

MESHES = [
    (
        {"dp": 2},
        ["mlp", "gpt2", "gpt2@keepgrads", "gpt2@accumulate", "cnn"]
        + ["gpt2@megatron+zero2+adamw", "gpt2x4@megatron+zero3"],
    ),
    ({"tp": 2}, ["mlp", "gpt2", "cnn", "gpt2@megatron", "lm@megatron", "gpt2@megatron+broken"]),
    ({"dp": 2, "tp": 2}, ["mlp", "gpt2", "gpt2@plan", "gpt2@megatron+zero2", "gpt2@megatron+zero3"]),
]


@pytest.mark.parametrize(
    "axes,models", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()) if isinstance(a, dict) else ""
)
def test_models_train_exactly(axes, models):
    world = 1
    for n in axes.values():
        world *= n
    results = run_distributed(compare_models, world, models, axes)
    for rank, res in enumerate(results):
        for model, r in res.items():
            where = f"{model} on {axes}, rank {rank}"
            loss_rel, param_rel = r["loss_rel"].item(), r["param_rel"].item()
            if model.endswith("broken"):  # the check must fail on a wrong program
                assert r["dropped"], where
                assert loss_rel > 1e3 * TOL and param_rel > 1e3 * TOL, f"{where}: the dropped all-reduce went unseen"
                continue
            assert loss_rel < TOL, f"{where}: losses differ by {loss_rel:.2e} relative"
            if "megatron" in model and "tp" in axes:  # f's all-reduce overlapped with the weight gradients
                assert r["fused_f"] > 0, where
            if model.endswith("accumulate"):  # without no_sync the first backward's gradients are summed twice
                assert r["unsynced_rel"] > 1e3 * TOL, f"{where}: syncing twice went unseen"
            if model.endswith("keepgrads"):  # the gradients are the buckets' slices: synced without a copy back
                assert 0 < r["grads_in_buckets"] == r["synced_params"], where
            assert param_rel < TOL, f"{where}: {r['worst_param']} differs by {param_rel:.2e} relative"
            if "@" not in model and "dp" in axes:  # roles by name (the default): dp splits the batch, weights whole
                assert r["batch_on_dp"] == r["inputs"] and r["sharded_on_dp"] == 0, where
            # and tp lays the weights out as Megatron (a CNN's convolutions have no such layout: placed by cost)
            if "@" not in model and "tp" in axes and model != "cnn":
                assert r["sharded_on_tp"] > 0 and r["batch_on_tp"] == 0, where
    largest = {m: max(res[m]["loss_rel"].item() for res in results) for m in models}
    largest_p = {m: max(res[m]["param_rel"].item() for res in results) for m in models}
    print(f"{axes}: largest relative differences (loss, parameters):", {m: (largest[m], largest_p[m]) for m in models})
    # every rank holds less than the whole model when anything is sharded
    for model in models:
        r = results[0][model]
        per_element = r["states_per_element"].item()  # optimizer states per trained element (momentum, Adam's two)
        assert r["local_numel"] <= r["full_numel"]
        # ZeRO-2: each rank keeps the optimizer's states for its 1/k slice of the data-parallel
        # parameters, and the slice is most of its parameters (the test would not show ZeRO otherwise)
        if "zero2" in model:
            assert r["optimizer_state_numel"] == r["zero_expected_numel"], model
            k = axes.get("dp", 1) if "megatron" in model else world
            assert r["optimizer_state_numel"] < (1 / k + 0.2) * per_element * r["local_numel"], model
        # ZeRO-3: each rank keeps its 1/k slice of the dp-replicated parameters (each padded to a
        # multiple of k), the rest as the plan shards them, and the optimizer's states for exactly
        # those; the whole parameters gathered for a forward are gone when it returns (saved ones are tokens)
        if "zero3" in model:
            for res in results:
                r3 = res[model]
                assert r3["local_numel"] == r3["zero3_expected_numel"], model
                assert r3["optimizer_state_numel"] == per_element * r3["local_numel"], model
                assert r3["gathered_alive"] == 0, model
                # gathered one unit at a time: at any moment of forward and backward at most the root unit
                # (embeddings, tied head, final norm) and two blocks are whole; with 4 blocks the whole
                # model is more, so gathering it at once (as before) fails here (shown by hand, commit message)
                blocks = sorted(r3["block_bytes"].tolist(), reverse=True)
                bound = r3["root_bytes"].item() + sum(blocks[:2])
                if "gpt2x4" in model:
                    assert len(blocks) == 4 and r3["root_bytes"] + sum(blocks) > bound, model
                assert 0 < r3["gathered_peak"].item() <= bound, (model, r3["gathered_peak"].item(), bound)
            k = axes.get("dp", 1)
            assert r["local_numel"] < (1 / k + 0.2) * r["full_numel"] / (world // k), model
