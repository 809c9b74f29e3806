"""Hugging Face families outside the other tests train exactly with autopar: T5 and OPT in float64.

Regressions of issue 14. T5 trained a different model on every mesh: its decoder inputs are built
by writes through views (``shifted[..., 1:] = labels[..., :-1]``), which sharding lost (fixed by
passes/functionalize.py). And a mean cross-entropy over rows split across ranks was a partial average,
wrong whenever ranks ignore different numbers of ``-100`` targets (lowered as sum / count now).
OPT (tied head, learned positions) on pp x tp was reported drifting; it is exact here.

One 4-rank gloo spawn (about 60 s on 2 shared cores) trains T5 on dp=2 x tp=2 (labels padded with
-100 in half the rows) and T5 and OPT on pp=2 x tp=2 (2 microbatches, no padding: a pipeline averages
per-microbatch means, which equals the batch's mean only when every microbatch counts as many
targets), each built small from its config, in float64, 3 SGD steps against one single-process run of
the same model and batches: every parameter and every loss within 1e-10 relative (a pipeline's
``train_step`` returns the loss in the model's dtype, float64 here; a float32 loss would be compared at
float32 resolution).
"""

from __future__ import annotations

import copy

import torch

import autopar
from tests._dist import run_distributed

STEPS = 3
LR = 0.1  # SGD: each step moves a parameter by lr * gradient, so a wrong gradient shows in the parameters
RTOL = 1e-10
# A tensor whose norm is below this fraction of the model's largest is compared against that floor:
# OPT's key biases start at zero and their gradient is mathematically zero (softmax ignores a constant
# added to a row of scores), so they hold float64 rounding noise (~1e-18) that differs with the
# summation order; against its own norm that noise would be a relative error of order 1.
FLOOR = 1e-6


class LossOf(torch.nn.Module):
    """The model's logits and a float64 cross-entropy of them (HF's own loss casts logits to float32)."""

    def __init__(self, model: torch.nn.Module, seq2seq: bool):
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.seq2seq:  # the decoder's inputs are the labels shifted right (HF's _shift_right)
            logits = self.model(input_ids=input_ids, labels=labels).logits
        else:  # next-token prediction: position i predicts token i + 1
            logits = self.model(input_ids=input_ids).logits[:, :-1]
            labels = labels[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class RMSNorm64(torch.nn.Module):
    """T5's RMS norm computed in the input's dtype (HF computes the variance in float32 even for a
    float64 model, which puts float32 rounding into any sharded reduction of it)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    cfg = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )
    model = T5ForConditionalGeneration(cfg)
    for name, module in list(model.named_modules()):
        if isinstance(module, T5LayerNorm):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, RMSNorm64(module))
    return LossOf(model, seq2seq=True)


def tiny_opt() -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        use_cache=False,
    )
    return LossOf(OPTForCausalLM(cfg), seq2seq=False)


FAMILIES = {"t5": tiny_t5, "opt": tiny_opt}


def batches(vocab: int, batch: int = 8, src: int = 8, tgt: int = 6, pad: bool = True) -> list[dict[str, torch.Tensor]]:
    """Token batches; with ``pad`` the last two label positions of half the rows are -100 (ignored)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        labels = torch.randint(2, vocab, (batch, tgt), generator=g)
        if pad:
            labels[: batch // 2, -2:] = -100
        out.append({"input_ids": torch.randint(2, vocab, (batch, src), generator=g), "labels": labels})
    return out


def _train(rank: int, world: int, family: str, axes: dict[str, int], pad: bool) -> dict[str, torch.Tensor]:
    """SGD steps with autopar on the mesh and in one process: losses and the largest parameter error."""
    torch.manual_seed(0)
    model = FAMILIES[family]().double()
    reference = copy.deepcopy(model)
    data = batches(64, tgt=6 if family == "t5" else 8, pad=pad)
    mesh = autopar.init_mesh("cpu", **axes)
    # a pipeline's loss is the mean of its microbatches' (equal to the batch's when no label is padded);
    # without one the whole batch runs at once, so the padded batch's loss is the model's own
    compiled = autopar.compile(model, mesh, kwargs=data[0], microbatches=2 if "pp" in axes else 1)
    opt = torch.optim.SGD(compiled.parameters(), lr=LR)
    losses = []
    for b in data:
        if "pp" in axes:
            loss = compiled.train_step(**b)
        else:
            loss = compiled(**b)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    for b in data:
        loss = reference(**b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    ref = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    floor = FLOOR * max(p.norm() for p in ref.values())
    worst, compared = 0.0, 0
    for name, value in compiled.full_state_dict().items():
        if name in ref:
            worst = max(worst, ((value - ref[name]).norm() / ref[name].norm().clamp_min(floor)).item())
            compared += 1
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.tensor(ref_losses, dtype=torch.float64),
        "param_rel": torch.tensor(worst),
        "compared": torch.tensor(compared),
    }


def _jobs(rank: int, world: int, jobs: list[tuple[str, dict[str, int], bool]]) -> dict[str, dict]:
    return {f"{family} {axes} pad={pad}": _train(rank, world, family, axes, pad) for family, axes, pad in jobs}


def test_t5_and_opt_train_exactly_on_4_ranks():
    jobs = [("t5", {"dp": 2, "tp": 2}, True), ("t5", {"pp": 2, "tp": 2}, False), ("opt", {"pp": 2, "tp": 2}, False)]
    for rank, res in enumerate(run_distributed(_jobs, 4, jobs, timeout=600)):
        assert len(res) == len(jobs)
        for job, r in res.items():
            at = f"{job}, rank {rank}"
            rtol = RTOL if r["losses"].dtype == torch.float64 else torch.finfo(r["losses"].dtype).eps
            torch.testing.assert_close(r["losses"].double(), r["ref_losses"], rtol=rtol, atol=0, msg=at)
            assert r["param_rel"] < RTOL, f"{at}: parameters differ by {r['param_rel']:.2e} (norm)"
            assert r["compared"] > 0, at
