"""Training metrics per step from the runtime (runtime/measure/metrics.py): compile's module times each
``train_step`` and reports step time, tokens/s, Megatron's MFU against the cluster spec's peak, peak memory,
loss and gradient norm, through logger "autopar" (rank 0) and ``TrainConfig.on_metrics``. One process (a
1-rank gloo group), a tiny GPT-2, SGD: a few seconds."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.runtime.measure.metrics import StepMetrics, megatron_flops, transformer_shape
from tests.equivalence import tiny_gpt2


def test_megatron_formula_and_the_shape_it_reads():
    # 72 B s l h^2 (1 + s/6h + V/12lh): B=2, s=8, l=3, h=16, V=100
    assert megatron_flops(2, 8, 3, 16, 100) == pytest.approx(72 * 2 * 8 * 3 * 256 * (1 + 8 / 96 + 100 / 576))
    model, _ = tiny_gpt2(steps=1)
    assert transformer_shape(model.config) == (2, 64, 128)
    assert transformer_shape(object()) is None


def test_train_step_reports_its_metrics(one_rank, caplog):
    model, batches = tiny_gpt2(steps=2)
    reference = copy.deepcopy(model)
    seen: list[StepMetrics] = []
    compiled = autopar.compile(model, one_rank, kwargs=batches[0], on_metrics=seen.append, cluster="dgx-a100")
    compiled.make_optimizer(torch.optim.SGD, lr=0.1)
    with caplog.at_level(logging.INFO, logger="autopar"):
        losses = [compiled.train_step(**b) for b in batches]
    assert [m.step for m in seen] == [1, 2]
    m = seen[0]
    batch, seq = batches[0]["input_ids"].shape
    assert m.tokens == batch * seq and m.tokens_per_second == pytest.approx(m.tokens / m.seconds)
    assert m.flops == pytest.approx(megatron_flops(batch, seq, 2, 64, 128))
    # fp32 compute on dgx-a100: its fp32 peak, 19.5 TFLOP/s, one device
    assert m.mfu == pytest.approx(m.flops / (m.seconds * 19.5e12))
    assert m.peak_memory_bytes > 0 and m.loss == pytest.approx(losses[0].item())
    # the gradient norm of the first step equals the plain model's on the same batch
    reference(**batches[0]).loss.backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    assert m.grad_norm == pytest.approx(expected.item(), rel=1e-5)
    lines = [r.getMessage() for r in caplog.records if r.name == "autopar" and r.getMessage().startswith("step ")]
    assert len(lines) == 2 and "tokens/s" in lines[0] and "MFU" in lines[0] and "grad norm" in lines[0]


def test_metrics_config_is_checked_and_not_written_to_files():
    with pytest.raises(ConfigError, match="log_every"):
        autopar.TrainConfig(log_every=-1)
    with pytest.raises(ConfigError, match="on_metrics"):
        autopar.TrainConfig(on_metrics="print")
    assert autopar.TrainConfig(on_metrics=print).to_dict()["on_metrics"] is None


def test_writers_name_their_extra_when_the_package_is_missing():
    """The TensorBoard and W&B writers import their package lazily; neither is in the lock (optional extras), so
    here each says how to install it. A writer over an installed package is used as a plain callback."""
    import importlib.util

    from autopar.errors import MetricsWriterError
    from autopar.metrics import tensorboard_writer, wandb_writer

    for make, package, extra in ((tensorboard_writer, "tensorboard", "tensorboard"), (wandb_writer, "wandb", "wandb")):
        if importlib.util.find_spec(package) is not None:
            continue
        with pytest.raises(MetricsWriterError, match=rf"autopar\[{extra}\]"):
            make("out") if package == "tensorboard" else make()
