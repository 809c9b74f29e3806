"""An autopar module's parameters as DTensors (``runtime/checkpoint/dtensors.py``): torch's own
``get_model_state_dict``, DCP and ``clip_grad_norm_`` on it, float64 and exact against the plain model
(4 gloo ranks, one spawn)."""

from __future__ import annotations

import copy
import os

import torch

from tests._dist import run_distributed


def _model(seed: int = 0):
    from tests.equivalence import tiny_gpt2
    from tests.exactness import float64_batch, float64_model

    model, batches = tiny_gpt2(seed=seed)
    return float64_model(model, seed=seed + 7), float64_batch(batches[0])


def _run(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import autopar

    model, batch = _model()
    ref = copy.deepcopy(model)
    whole = {k: v.clone() for k, v in ref.state_dict().items()}
    pipe = autopar.compile(model, autopar.init_mesh("cpu", dp=2, tp=2), kwargs=batch)
    view = pipe.as_dtensors()
    sd = view.state_dict()
    out: dict = {"keys_match": torch.tensor(sorted(sd) == sorted(whole))}
    # the plan really splits parameters over tp, and the DTensors say so
    tp = sd[next(iter(sd))].device_mesh.mesh_dim_names.index("tp")
    out["split_on_tp"] = torch.tensor(sum(isinstance(v.placements[tp], (Shard, _StridedShard)) for v in sd.values()))
    params = list(view.parameters())  # an interleaved shard (fused QKV) is a _StridedShard parameter
    out["strided"] = torch.tensor(sum(any(isinstance(p, _StridedShard) for p in v.placements) for v in params))
    out["strided_whole_err"] = torch.stack(
        [(v.full_tensor() - whole[k]).abs().max() for k, v in view.named_parameters()]
    ).max()
    out["whole_err"] = torch.stack([(v.full_tensor() - whole[k]).abs().max() for k, v in sd.items()]).max()
    out["same_storage"] = torch.tensor(
        all(d.to_local().untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for d, t in view._pairs)
    )
    # torch's clip_grad_norm_ over the DTensor parameters clips the module's own gradients
    pipe(**batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(view.grads_from_shards().parameters(), 0.01)
    out["norm"] = norm.full_tensor() if isinstance(norm, DTensor) else norm
    ref(**batch).backward()
    out["ref_norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    grads = pipe.full_state_dict(grads=True)
    refg = dict(ref.named_parameters())
    out["grad_err"] = torch.stack([(grads[k] - p.grad).abs().max() for k, p in refg.items()]).max()
    # torch's get_model_state_dict + DCP: written on dp2 x tp2 ...
    path = f"{root}/dcp"
    dcp.save(get_model_state_dict(view), checkpoint_id=path)
    # ... read into a differently initialized autopar model on pp2 x tp2 (each pipeline rank its stages), the bare
    # transformers model this time (keys without LogitsLoss's "model." prefix: DCP loads by the renamed keys)
    other = _model(seed=3)[0].model
    pipe2 = autopar.compile(other, autopar.init_mesh("cpu", pp=2, tp=2), kwargs=batch, microbatches=2)
    view2 = pipe2.as_dtensors()
    sd2 = get_model_state_dict(view2)
    out["pp_keys_held"] = torch.tensor(len(sd2))
    dcp.load({f"model.{k}": v for k, v in sd2.items()}, checkpoint_id=path)  # in place, into sd2's tensors
    set_model_state_dict(view2, sd2)
    full2 = pipe2.full_state_dict()
    out["other_mesh_err"] = torch.stack([(full2[k] - whole[f"model.{k}"]).abs().max() for k in full2]).max()
    # export from pp2 x tp2: sharded safetensors + index + config.json, gathered to rank 0 one tensor at a time
    hf = f"{root}/hf"
    pipe2.save_pretrained(hf, max_shard_size="40KB")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
        out["hf_files"] = torch.tensor(len([f for f in os.listdir(hf) if f.endswith(".safetensors")]))
        with torch.no_grad():
            want = ref.model(input_ids=batch["input_ids"]).logits
            out["logits_err"] = (loaded(input_ids=batch["input_ids"]).logits - want).abs().max()
    # load_weights reads the sharded directory back, each rank its pieces
    with torch.no_grad():
        for t in pipe2.local_tensors().values():
            t.zero_()
    autopar.checkpoint.load_weights(pipe2, hf)
    full3 = pipe2.full_state_dict()
    out["load_weights_err"] = torch.stack([(full3[k] - whole[f"model.{k}"]).abs().max() for k in full3]).max()
    # ... and into the plain model
    plain, _ = _model(seed=5)
    psd = plain.state_dict()
    dcp.load(psd, checkpoint_id=path)
    plain.load_state_dict(psd)
    out["plain_err"] = torch.stack([(v - whole[k]).abs().max() for k, v in plain.state_dict().items()]).max()
    out["plain_differed"] = torch.stack(
        [(v - whole[k]).abs().max() for k, v in _model(seed=5)[0].state_dict().items()]
    ).max()
    return out


def test_dtensor_view_speaks_torch_checkpoint_and_clipping(tmp_path):
    """dp2 x tp2: every key a DTensor whose full_tensor is the plain model's value and whose local tensor is
    the module's shard; torch's clip_grad_norm_ on it gives the plain model's norm and clipped gradients
    (1e-10 relative); a DCP checkpoint of torch's get_model_state_dict loads exactly into pp2 x tp2 and into
    the plain model; pp2 x tp2's save_pretrained (sharded, gathered to rank 0) loads with transformers'
    from_pretrained giving the plain model's logits exactly, and load_weights reads that directory back.
    Cost: one spawn of 4 processes, two compiles."""
    results = run_distributed(_run, 4, str(tmp_path))
    for r in results:
        assert r["keys_match"], "the view holds every key of the user's state dict"
        assert r["split_on_tp"] > 0 and r["strided"] > 0, "the plan splits parameters on tp (the fused QKV interleaved)"
        assert r["whole_err"] == 0 and r["strided_whole_err"] == 0
        assert r["same_storage"], "the DTensors' local tensors are the module's own shards"
        rel = abs(r["norm"].item() - r["ref_norm"].item()) / r["ref_norm"].item()
        assert rel < 1e-10, (r["norm"], r["ref_norm"])
        assert r["grad_err"] < 1e-12 * r["ref_norm"].item()
        assert r["pp_keys_held"] > 0
        assert r["other_mesh_err"] == 0
        assert r["plain_differed"] > 0 and r["plain_err"] == 0
        assert r["load_weights_err"] == 0
    assert results[0]["hf_files"] > 1 and results[0]["logits_err"] == 0, "the export loads with from_pretrained"
