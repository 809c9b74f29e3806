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


# A custom op outside ATen (as transformers' grouped_mm_fallback is): twice its input, with its own backward.
@torch.library.custom_op("autopar_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_twice.register_fake(lambda x: torch.empty_like(x))
_twice.register_autograd(lambda ctx, g: g * 2)


class CustomOpModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.autopar_test.twice(self.fc(x)).tanh().sum()


def test_a_custom_op_keeps_its_namespace_and_trains_exactly():
    """Issue 31: an op of another namespace was lowered as ``aten.<name>`` (transformers' default MoE kernel as
    ``aten.grouped_mm_fallback``), an AttributeError on every rank; its IR name is its own now, and a model calling
    it trains on dp=2 simulated ranks exactly as in one process (float64)."""
    from autopar.check.simtrain import SimCompiled
    from autopar.ir.core import MeshSpec

    torch.manual_seed(0)
    model = CustomOpModel().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    prog = lower(capture(model, (x,)))
    assert "autopar_test.twice" in {op.target for op in prog.ops}
    sim = SimCompiled.of(model, MeshSpec((("dp", 2),)), (x,))
    losses = sim(x)
    model(x).backward()
    for loss in losses:
        loss.backward()
    grads = sim.full_state_dict(grads=True)
    assert all(torch.allclose(loss, model(x), rtol=1e-12, atol=0) for loss in losses)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=0)


def test_an_op_whose_ir_name_resolves_to_no_op_is_refused_at_lowering(monkeypatch):
    """The general check behind the one above: lowering refuses an op whose IR name does not give back the op
    torch.export traced (here the namespace is dropped again, as it was), naming it, before any rank runs."""
    from autopar.errors import UnsupportedOpError
    from autopar.passes import lower as lowering

    def without_namespace(op):  # autopar's target_name before issue 31
        return "aten." + op._schema.name.split("::")[1]

    monkeypatch.setattr(lowering, "target_name", without_namespace)
    with pytest.raises(UnsupportedOpError, match="autopar_test::twice.*'aten.twice'"):
        lower(capture(CustomOpModel(), (torch.randn(4, 8),)))


def test_codegen_refuses_a_program_naming_no_op():
    """A program read from a plan file naming an op this process has no library for: a named error, not an
    AttributeError in the middle of building a rank's module."""
    from autopar.errors import UnsupportedOpError
    from autopar.runtime.build.codegen import codegen

    model = CustomOpModel()
    prog = lower(capture(model, (torch.randn(4, 8),)))
    ops = tuple(op.with_(target="nosuchlib.twice") if op.target == "autopar_test.twice" else op for op in prog.ops)
    state = dict(model.state_dict())
    with pytest.raises(UnsupportedOpError, match="nosuchlib.twice"):
        codegen(prog.with_(ops=ops), {}, state.__getitem__)
