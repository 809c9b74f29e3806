"""The split pass: subgraph counts, crossings, exact sequential execution, annotations and caching."""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autopar.errors import AutoparError, PipelineError
from autopar.ir.core import Device, MeshSpec, Op, Program, Ref, TensorType, Value, resolve_target
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes import (
    flow,  # noqa: F401  (registers the standard passes PassManager runs by name)
    split_cache,
)
from autopar.passes import pipeline_split as ps
from autopar.passes.assign_stages import assign_stages_pass
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.manager import PassManager
from autopar.passes.subgraphs import annotate, extract

NOCACHE = ps.SplitOptions(cache=False)


# ---------------------------------------------------------------------------------------------
# A small interpreter: run a Program's ATen ops with torch


def run_program(prog: Program, tensors: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """Execute ``prog`` on CPU; ``tensors`` holds every graph input by name."""
    env = {v.name: tensors[v.name] for v in prog.inputs}

    def conv(x: Any) -> Any:
        if isinstance(x, Ref):
            return env[x.name]
        if isinstance(x, Device):
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        return x

    for op in prog.ops:
        out = resolve_target(op.target)(*conv(op.args), **{k: conv(v) for k, v in op.kwargs.items()})
        if len(op.results) == 1 and not isinstance(out, (tuple, list)):
            env[op.results[0]] = out
        else:
            env.update(zip(op.results, out))
    return tuple(env[o.name] if isinstance(o, Ref) else o for o in prog.outputs)


def run_split(prog: Program, split: ps.Split, tensors: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """Run the subgraphs one after another, each as its own Program, handing on what crosses."""
    passed: dict[str, torch.Tensor] = {}
    outs: tuple[Any, ...] = ()
    for sg in split.subgraphs:
        sub = extract(prog, split, sg.index)
        verify(sub)  # self-contained: every use is defined by its inputs or its own ops
        received = [v.name for v in sub.inputs if v.kind == "input" and v.name in passed]
        assert received == [*sg.inputs, *sg.commons]
        outs = run_program(sub, {v.name: passed.get(v.name, tensors.get(v.name)) for v in sub.inputs})
        passed = {o.name: t for o, t in zip(sub.outputs, outs) if isinstance(o, Ref)}
    return outs


def graph_tensors(model: nn.Module, captured: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    t = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    t |= dict(captured.exported.constants)
    t |= inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return t


@functools.cache
def preset(name: str) -> tuple[Any, Program, dict[str, torch.Tensor]]:
    """(ModelSpec with real weights, lowered program, graph input tensors) of a tiny preset."""
    spec = build(name, device="cpu", seed=0)
    cap = capture(spec.model, spec.args, spec.kwargs)
    return spec, lower(cap), graph_tensors(spec.model, cap, spec.args, spec.kwargs)


def model_outputs(spec: Any) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = spec.model(*spec.args, **spec.kwargs)
    return (out.loss, out.logits) if hasattr(out, "logits") else (out,)


# ---------------------------------------------------------------------------------------------
# Presets: counts and crossings


def test_gpt2_splits_into_2L_plus_2_subgraphs_with_one_tensor_per_cut():
    _, prog, _ = preset("tiny-gpt2")  # 2 layers
    split = ps.split_program(prog, NOCACHE)
    assert [s.label for s in split.subgraphs] == [
        "transformer",
        "transformer.h.0.attn",
        "transformer.h.0.mlp",
        "transformer.h.1.attn",
        "transformer.h.1.mlp",
        "lm_head",
    ]
    # one residual-stream tensor crosses every cut, and nothing rides along: SDPA is called causal, with no mask to
    # carry to its last user (passes/hf_masks.py; the LLaMA case below keeps its rotary tables)
    assert split.crossings() == [(1, 0)] * 5
    assert not any(s.commons_out for s in split.subgraphs)
    types = prog.types()
    for s in split.subgraphs[:-1]:
        (x,) = s.outputs
        assert types[x].shape == (4, 16, 64)  # [batch, seq, hidden]
    # parameters are read where they are used, the tied embedding in both the first and last subgraph
    assert "lm_head.weight" in split.subgraphs[0].graph_inputs
    assert "lm_head.weight" in split.subgraphs[-1].graph_inputs
    assert sum(s.params for s in split.subgraphs) == sum(v.type.numel for v in prog.params)
    assert [s.start for s in split.subgraphs[1:]] == [s.stop for s in split.subgraphs[:-1]]
    assert split.subgraphs[-1].stop == len(prog.ops)


def test_llama_passes_rotary_tables_as_common_nodes():
    _, prog, _ = preset("tiny-llama")
    split = ps.split_program(prog, NOCACHE)
    assert len(split) == 2 * 2 + 2
    assert [s.label for s in split.subgraphs][1:3] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert split.crossings() == [(1, 2), (1, 2), (1, 2), (1, 0), (1, 0)]
    types = prog.types()
    commons = split.subgraphs[0].commons_out
    assert sorted(types[c].dtype for c in commons) == ["f32", "f32"]  # cos, sin (SDPA is called causal, no mask)
    assert all(c in ps.common_nodes(prog) for c in commons)


def test_bert_head_has_two_matmuls_so_2L_plus_3():
    _, prog, _ = preset("tiny-bert")
    split = ps.split_program(prog, NOCACHE)
    labels = [s.label for s in split.subgraphs]
    assert labels[0] == "bert.embeddings"
    assert labels[-2:] == ["cls.predictions.transform.dense", "cls.predictions.decoder"]
    assert len(split) == 2 * 2 + 3
    assert all(x == 1 for x, _ in split.crossings())


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-bert"])
def test_subgraphs_in_order_compute_exactly_the_model(name):
    spec, prog, tensors = preset(name)
    split = ps.split_program(prog, NOCACHE)
    expected = model_outputs(spec)
    got = run_split(prog, split, tensors)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# A skip connection over several layers


class SkipMLP(nn.Module):
    """Six Linear+ReLU layers; layer 0's output is added back after layer 3 (a 3-layer skip)."""

    def __init__(self, d: int = 64, layers: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x0 = h = self.layers[0](x)
        for layer in self.layers[1:4]:
            h = layer(h)
        h = h + x0
        for layer in self.layers[4:]:
            h = layer(h)
        return nn.functional.mse_loss(self.head(h), y)


@functools.cache
def skip_program() -> tuple[nn.Module, Program, dict[str, torch.Tensor], tuple]:
    torch.manual_seed(0)
    model = SkipMLP()
    args = (torch.randn(8, 64), torch.randn(8, 1))
    cap = capture(model, args)
    return model, lower(cap), graph_tensors(model, cap, args, {}), args


def test_skip_connection_keeps_spanned_layers_together_by_default():
    model, prog, tensors, args = skip_program()
    split = ps.split_program(prog, NOCACHE)
    labels = [s.label for s in split.subgraphs]
    assert labels == ["layers.0.0", "layers", "layers.4.0", "layers.5.0"]  # layers 1-3 + the add: one
    span = split.subgraphs[1]
    x0 = split.subgraphs[0].outputs[0]
    assert span.inputs == (x0,) and x0 not in span.outputs
    assert all(x == 1 for x, _ in split.crossings())
    with torch.no_grad():
        assert torch.equal(run_split(prog, split, tensors)[0], model(*args))


def test_oversized_skip_span_is_recut_and_the_skip_tensor_crosses_its_cuts():
    model, prog, tensors, args = skip_program()
    split = ps.split_program(prog, ps.SplitOptions(cache=False, oversize=1.5))
    labels = [s.label for s in split.subgraphs]
    assert labels == ["layers.0.0", "layers.1.0", "layers.2.0", "layers.3.0", "layers.4.0", "layers.5.0"]
    x0 = split.subgraphs[0].outputs[0]
    assert [x0 in s.outputs for s in split.subgraphs[:-1]] == [True, True, True, False, False]
    assert split.crossings() == [(1, 0), (2, 0), (2, 0), (1, 0), (1, 0)]
    with torch.no_grad():
        assert torch.equal(run_split(prog, split, tensors)[0], model(*args))


def test_merak_rule_alone_never_cuts_where_two_tensors_cross():
    _, prog, _, _ = skip_program()
    split = ps.split_program(prog, ps.SplitOptions(cache=False, oversize=1.5, max_crossing=1))
    assert len(split) == 4 and all(x == 1 for x, _ in split.crossings())


# ---------------------------------------------------------------------------------------------
# Random programs: sequential execution equals whole execution, every cut within max_crossing

_T = TensorType("f32", (4, 4))
_UNARY = ("aten.relu", "aten.neg", "aten.sigmoid")
_BINARY = ("aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor", "aten.mm")
_PATHS = ("a.0", "a.0.x", "a.1", "a.1.y", "b", "")


@st.composite
def random_programs(draw: st.DrawFn) -> Program:
    inputs = [Value(f"w{i}", "param", _T) for i in range(3)]
    inputs += [Value("x", "input", _T), Value("m", "buffer", _T)]
    names = [v.name for v in inputs]
    ops = []
    for i in range(draw(st.integers(2, 24))):

        def pick() -> str:
            far = draw(st.booleans())  # half the operands come from anywhere: long skips
            lo = 0 if far else max(0, len(names) - 3)
            return names[draw(st.integers(lo, len(names) - 1))]

        if draw(st.booleans()):
            target, args = draw(st.sampled_from(_UNARY)), (Ref(pick()),)
        else:
            target, args = draw(st.sampled_from(_BINARY)), (Ref(pick()), Ref(pick()))
        flops = draw(st.integers(0, 1000))
        ops.append(Op((f"{i}",), (_T,), target, args, path=draw(st.sampled_from(_PATHS)), flops=flops))
        names.append(f"{i}")
    extra = draw(st.lists(st.sampled_from(names[5:]), max_size=2))
    return Program(MeshSpec(), tuple(inputs), tuple(ops), (Ref(names[-1]), *(Ref(e) for e in extra)))


@settings(max_examples=60, deadline=None)
@given(prog=random_programs(), max_crossing=st.integers(1, 3), oversize=st.sampled_from([1.0, 2.0, 4.0]))
def test_random_programs_split_exactly(prog, max_crossing, oversize):
    split = ps.split_program(prog, ps.SplitOptions(max_crossing=max_crossing, oversize=oversize, cache=False))
    assert split.subgraphs[0].start == 0 and split.subgraphs[-1].stop == len(prog.ops)
    assert all(a.stop == b.start and a.stop > a.start for a, b in zip(split.subgraphs, split.subgraphs[1:]))
    common = ps.common_nodes(prog)
    for s in split.subgraphs[:-1]:
        assert len(s.outputs) <= max_crossing
        assert not set(s.outputs) & common and set(s.commons_out) <= common
    g = torch.Generator().manual_seed(0)
    tensors = {v.name: 0.5 * torch.randn(4, 4, generator=g) for v in prog.inputs}
    whole = run_program(prog, tensors)
    for a, b in zip(run_split(prog, split, tensors), whole):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Annotations, the pass, the fingerprint and the caches


def test_annotations_round_trip_and_do_not_change_the_fingerprint():
    _, prog, _ = preset("tiny-gpt2")
    split = ps.split_program(prog, NOCACHE)
    out = annotate(prog, split)
    sg = [op.attrs["subgraph"] for op in out.ops]
    assert sg == sorted(sg) and sg[-1] == len(split) - 1
    first = {v.name: v.attrs["subgraph"] for v in out.inputs}
    assert first["transformer.h.1.mlp.c_fc.weight"] == 4
    assert first["lm_head.weight"] == 0 and first["labels"] == 5
    assert out.attrs["pipeline_subgraphs"] == 6
    assert "<subgraph=3>" in print_program(out)
    assert parse(print_program(out)) == out
    assert split_cache.program_fingerprint(out) == split_cache.program_fingerprint(prog) == split.fingerprint
    other = prog.with_(ops=prog.ops[:-1], outputs=(Ref(prog.ops[-2].result),))
    assert split_cache.program_fingerprint(other) != split.fingerprint


def test_pass_manager_runs_the_split_and_assign_stages_passes():
    _, prog, _ = preset("tiny-gpt2")
    out = PassManager(["split"]).run(prog)
    assert {op.attrs["subgraph"] for op in out.ops} == set(range(6))
    out, _ = assign_stages_pass(out, {"pp": 3})
    verify(out)
    stages = [op.attrs["stage"] for op in out.ops]
    assert stages == sorted(stages) and set(stages) == {0, 1, 2}
    assert out.attrs["pipeline_stages"] == 3
    with pytest.raises(AutoparError, match="belong to the assign-stages pass"):
        PassManager("split", options={"split": {"pp": 3, "chunks": 2}}).run(prog)
    with pytest.raises(AutoparError, match="unknown split option"):
        PassManager("split", options={"split": {"max_crosing": 2}}).run(prog)


def test_split_is_cached_in_memory_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    _, prog, _ = preset("tiny-llama")
    split_cache.clear_memory_cache()
    computed = ps.split_program(prog)
    assert computed.source == "computed"
    files = list(tmp_path.glob("split-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["fingerprint"] == computed.fingerprint
    assert ps.split_program(prog).source == "memory"
    split_cache.clear_memory_cache()
    from_disk = ps.split_program(prog)
    assert from_disk.source == "disk" and from_disk.subgraphs == computed.subgraphs
    # other options are another cache entry; a damaged file is recomputed
    assert ps.split_program(prog, ps.SplitOptions(max_crossing=1)).source == "computed"
    split_cache.clear_memory_cache()
    files[0].write_text("{not json")
    assert ps.split_program(prog).source == "computed"
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    split_cache.clear_memory_cache()
    assert ps.split_program(prog).source == "computed"
    assert split_cache.cache_dir() is None


def test_empty_program_is_an_error():
    with pytest.raises(PipelineError, match="no ops"):
        ps.split_program(Program(MeshSpec(), (), (), ()))


# ---------------------------------------------------------------------------------------------
# Encoder-decoder: T5 is not a preset (autopar/models/families.py has no T5 family); built here directly


@functools.cache
def t5() -> tuple[nn.Module, Program, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=3,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(2, 128, (4, 16), generator=g)}
    kwargs["labels"] = torch.randint(2, 128, (4, 12), generator=g)
    cap = capture(model, (), kwargs)
    return model, lower(cap), graph_tensors(model, cap, (), kwargs), kwargs


def test_t5_blocks_are_cut_where_the_shared_position_bias_and_encoder_output_cross():
    model, prog, tensors, kwargs = t5()
    split = ps.split_program(prog, NOCACHE)
    labels = [s.label for s in split.subgraphs]
    # Merak's one-tensor rule alone finds no cut inside the encoder (every layer reads the relative
    # position bias, a parameter's output) nor the decoder (+ the encoder output): 3 subgraphs
    assert len(ps.split_program(prog, ps.SplitOptions(max_crossing=1, cache=False))) <= 3
    for i in range(2):  # the first blocks: one subgraph per attention / feed-forward half
        assert f"encoder.block.{i}.layer.0.SelfAttention" in labels
        assert f"encoder.block.{i}.layer.1.DenseReluDense" in labels
        assert f"decoder.block.{i}.layer.1.EncDecAttention" in labels
    crossing = dict(zip(labels, split.crossings()))
    assert crossing["encoder.block.0.layer.0.SelfAttention"][0] == 2  # hidden state + position bias
    assert crossing["decoder.block.0.layer.1.EncDecAttention"][0] == 3  # + the encoder output
    assert max(x for x, _ in split.crossings()) <= 3
    with torch.no_grad():  # both in the same grad mode: T5's attention picks kernels by it
        out = model(**kwargs)
        got = run_split(prog, split, tensors)
    assert torch.equal(got[0], out.loss) and torch.equal(got[1], out.logits)
