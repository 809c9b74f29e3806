"""Capture: real HF models and plain modules, giant presets on meta, and errors that say what to do."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.api import parse_mesh
from autopar.errors import CaptureError, MeshError, PresetError
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-mlp"])
def test_tiny_presets_capture_and_lower_with_every_parameter(preset):
    spec = build(preset, device="meta")
    prog = lower(capture(spec.model, spec.args, spec.kwargs))
    unique = {id(p): p for p in spec.model.parameters()}.values()
    assert sum(v.type.numel for v in prog.params) == sum(p.numel() for p in unique)


@pytest.mark.slow
def test_gpt3_175b_captures_on_meta_with_its_parameter_count():
    spec = build("gpt3-175b", device="meta")
    prog = lower(capture(spec.model, spec.args, spec.kwargs))
    assert sum(v.type.numel for v in prog.params) == 174_604_259_328
    assert all(p.device.type == "meta" for p in spec.model.parameters())


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.a(x).relu() + self.b(x)).sum() + x.mean()


def test_plain_module_with_branches_and_residuals():
    prog = lower(capture(Branchy(), (torch.randn(4, 8),)))
    assert sum(op.target == "aten.linear" for op in prog.ops) == 2


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: torch.export cannot capture it
            return x * 2
        return x


def test_uncapturable_model_names_the_source_line():
    with pytest.raises(CaptureError, match=r"torch.export cannot capture DataDependent(.|\n)*test_capture.py:\d+"):
        capture(DataDependent(), (torch.randn(3),))


class MaskedSum(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def test_a_data_dependent_shape_is_a_clear_error():
    """torch.export captures x[mask] with an unbacked size; lowering raised a raw GuardOnDataDependentSymNode."""
    with pytest.raises(CaptureError, match=r"shape depends on the data .*aten.index.Tensor(.|\n)*torch.where"):
        lower(capture(MaskedSum(), (torch.randn(3, 4),)))


def test_inputs_that_do_not_fit_are_named():
    with pytest.raises(CaptureError, match="example inputs do not fit Branchy"):
        capture(Branchy(), (torch.randn(4, 5),))
    with pytest.raises(CaptureError, match="example inputs do not fit"):
        capture(Branchy(), (), {"y": torch.randn(4, 8)})


def test_mesh_size_must_equal_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MeshError, match="has 4 devices but the world has 2 processes"):
        autopar.init_mesh("cpu", dp=2, tp=2)


def test_bad_mesh_text_and_unknown_preset():
    with pytest.raises(MeshError, match="name=size"):
        parse_mesh("dp=two")
    with pytest.raises(PresetError, match="unknown model preset"):
        build("gtp2")
    with pytest.raises(PresetError):
        build("tiny-gpt2:n_layr=2")
