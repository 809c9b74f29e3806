"""The README's loop on a pp mesh: ``model(**batch).loss.backward()`` raises ``PipelineBackwardError`` saying
to call ``train_step`` (before: torch's "element 0 of tensors does not require grad"), while ``train_step``
trains and an evaluation call (``eval()`` / ``no_grad``) returns plain outputs. Two simulated ranks, one process."""

from __future__ import annotations

import pytest
import torch

from autopar.check.simtrain import SimCompiled
from autopar.errors import PipelineBackwardError
from autopar.ir.core import MeshSpec
from tests.equivalence import tiny_gpt2


def test_backward_through_a_pipelines_outputs_says_to_call_train_step():
    model, batches = tiny_gpt2(steps=1)
    sim = SimCompiled.of(model, MeshSpec((("pp", 2),)), kwargs=batches[0], microbatches=2)
    sim.make_optimizer(torch.optim.SGD, lr=0.1)

    def readme_loop(m):
        loss = m(**batches[0]).loss
        with pytest.raises(PipelineBackwardError, match=r"model\.train_step\(\*\*batch\)"):
            loss.backward()
        return loss.detach()

    losses = sim.run(readme_loop)
    assert torch.isfinite(losses[0])
    stepped = sim.train_step(**batches[0])
    assert all(torch.isfinite(x) for x in stepped)

    def evaluation(m):
        m.eval()
        out = m(**batches[0]).loss
        with torch.no_grad():
            m.train()
            plain = m(**batches[0]).loss
        return out.requires_grad, plain.requires_grad

    assert sim.run(evaluation) == [(False, False)] * 2
