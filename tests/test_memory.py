"""The cost model's per-device memory against what a training step really allocates on each rank."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.memory import optimizer_state_tensors, peak_step_bytes, tensor_bytes
from autopar.solver.cost import program_memory
from tests._dist import run_distributed

pytestmark = pytest.mark.multiproc


class Wide(torch.nn.Module):
    """A small model whose memory is mostly weights, gradients and Adam states (activations ~1%)."""

    def __init__(self, d: int = 128, h: int = 512):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.gate = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x, target):
        y = self.down(torch.nn.functional.gelu(self.up(x)) * self.gate(x))
        return torch.nn.functional.mse_loss(y, target)


def _measure(rank: int, world: int, axes: dict) -> dict:
    torch.manual_seed(0)
    model = Wide()
    batch = {"x": torch.randn(8, 128), "target": torch.randn(8, 128)}
    compiled = autopar.compile(model, autopar.init_mesh("cpu", **axes), kwargs=batch)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)

    def step():
        compiled(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the first step allocates the Adam states
    live = tensor_bytes(list(compiled.parameters()) + optimizer_state_tensors(opt))
    measured = peak_step_bytes(step, live)
    predicted = program_memory(compiled.program)
    return {"measured": torch.tensor(float(measured)), "predicted": torch.tensor(predicted)}


@pytest.mark.parametrize("axes", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["2 ranks", "4 ranks"])
def test_predicted_memory_is_within_ten_percent_of_the_measured_peak(axes):
    world = 1
    for n in axes.values():
        world *= n
    for rank, r in enumerate(run_distributed(_measure, world, axes)):
        measured, predicted = r["measured"].item(), r["predicted"].item()
        assert abs(predicted - measured) <= 0.10 * measured, (
            f"rank {rank}: predicted {predicted:,.0f}, measured {measured:,.0f}"
        )
