"""Hugging Face attention masks captured as HF's eager forward makes them (``passes/hf_masks.py``).

Each case captures a tiny transformers model (float64) and compares it with the model run eagerly on the same
inputs: every SDPA call of the captured program gets what eager SDPA gets (no mask and ``is_causal=True``
without an ``attention_mask``; a mask with a padded one), and the captured program's loss equals the model's.
Sliding windows below the sequence (Mistral's with SDPA, Gemma2's with its eager attention) keep their masks,
and position ids the user passes keep the packed-sequence mask they may need. A patch that cannot apply (an
internal torch API gone, a transformers function of another shape) leaves today's capture: a mask, no error.
A compile refuses a later call with an added ``attention_mask`` or another sequence length
(``tests/test_faults.py``). Cost: about 3 s.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from autopar.models.resolve import build
from autopar.passes import hf_masks
from autopar.passes.capture import capture
from autopar.passes.lower import _sdpa_args, lower

transformers = pytest.importorskip("transformers")

SEQ = 16
_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
_SMALL |= dict(num_key_value_heads=2, head_dim=8, use_cache=False, attention_dropout=0.0)


class EagerSdpa(TorchFunctionMode):
    """Each SDPA call of an eager forward as (has a mask, is_causal)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            mask, _, causal = _sdpa_args(args, kwargs)[3:6]
            self.calls.append((mask is not None, bool(causal)))
        return func(*args, **kwargs)


def captured_sdpa(model: torch.nn.Module, inputs: dict) -> tuple[list[tuple[bool, bool]], set[str], torch.Tensor]:
    """The captured program's SDPA calls as (has a mask, is_causal), its op targets, and its loss."""
    c = capture(model, (), inputs)
    prog = lower(c)
    calls = []
    for op in prog.ops:
        if op.target == "aten.scaled_dot_product_attention":
            mask, _, causal = _sdpa_args(op.args, op.kwargs)[3:6]
            calls.append((mask is not None, bool(causal)))
    return calls, {op.target for op in prog.ops}, c.exported.module()(**inputs).loss


def eager(model: torch.nn.Module, inputs: dict) -> tuple[list[tuple[bool, bool]], torch.Tensor]:
    with EagerSdpa() as mode:
        loss = model(**inputs).loss
    return mode.calls, loss


def tokens(batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (batch, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def padded(inputs: dict) -> dict:
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :5] = 0  # left padding in the first row
    return inputs | {"attention_mask": mask}


def model_of(preset: str) -> torch.nn.Module:
    """The preset with one layer, in float64."""
    layers = "n_layer" if preset == "tiny-gpt2" else "num_hidden_layers"
    return build(f"{preset}:{layers}=1", device="cpu", seed=0).model.double()


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_causal_lm_without_a_mask_calls_sdpa_with_is_causal_and_no_mask(preset):
    model, inputs = model_of(preset), tokens()
    assert model.config._attn_implementation == "sdpa"
    for given in (inputs, inputs | {"attention_mask": None}):
        calls, targets, loss = captured_sdpa(model, given)
        want, eager_loss = eager(model, given)
        assert calls == want == [(False, True)] * model.config.num_hidden_layers
        assert not targets & {"aten.cumsum", "aten.diff", "aten.le.Tensor"}  # no causal or packed mask built
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-12)
    calls, _, loss = captured_sdpa(model, padded(inputs))
    want, eager_loss = eager(model, padded(inputs))
    assert calls == want == [(True, False)] * model.config.num_hidden_layers
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-12)


def test_a_sliding_window_below_the_sequence_keeps_its_mask():
    """Mistral on SDPA: a window of 4 keeps the mask as in eager, one of 64 (above the sequence) is causal;
    Gemma2's eager attention adds its sliding-window mask to the scores."""
    inputs = tokens()
    for window, want in ((4, (True, False)), (64, (False, True))):
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**_SMALL, sliding_window=window)).double()
        calls, _, loss = captured_sdpa(model, inputs)
        eager_calls, eager_loss = eager(model, inputs)
        assert calls == eager_calls == [want], window
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-12)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_SMALL, sliding_window=4)).double()
    assert gemma.config._attn_implementation == "eager"
    _, targets, loss = captured_sdpa(gemma, inputs)
    assert "aten.le.Tensor" in targets and "aten.cumsum" not in targets  # causal and window, no packed mask
    torch.testing.assert_close(loss, gemma(**inputs).loss, rtol=0, atol=1e-12)


def test_position_ids_the_user_passes_keep_the_packed_sequence_mask():
    """Two sequences packed in each row: eager reads the position ids and masks across them; the capture cannot
    read an input's values, so it keeps HF's traced packed-sequence mask (exact for any position ids)."""
    model, inputs = model_of("tiny-llama"), tokens()
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).expand(2, -1)
    calls, targets, loss = captured_sdpa(model, inputs | {"position_ids": packed})
    want, eager_loss = eager(model, inputs | {"position_ids": packed})
    assert calls == want == [(True, False)] and "aten.cumsum" in targets
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-12)


def test_a_patch_that_cannot_apply_leaves_the_mask(monkeypatch):
    """No readable trace (torch's proxy API moved): the packed-sequence test and so the mask stay as transformers
    exports them, with no error. A masking function of another signature is left unpatched."""
    model, inputs = model_of("tiny-llama"), tokens()

    monkeypatch.setattr(hf_masks, "proxy_tensor", types.SimpleNamespace())  # no get_proxy_mode
    calls, targets, loss = captured_sdpa(model, inputs)
    assert calls == [(True, False)] and "aten.cumsum" in targets
    torch.testing.assert_close(loss, eager(model, inputs)[1], rtol=0, atol=1e-12)
    monkeypatch.undo()
    mu = transformers.masking_utils
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda mask, *a, **k: False)
    with hf_masks.eager_masks():
        assert hasattr(mu.find_packed_sequence_indices, "__wrapped__")  # patched
        assert not hasattr(mu._ignore_causal_mask_sdpa, "__wrapped__")  # first parameter not padding_mask
    assert not hasattr(mu.find_packed_sequence_indices, "__wrapped__")  # restored
    assert hf_masks.shape_constant(torch.arange(4)) is None  # not under capture: nothing to read
