"""Tests of autopar.models.resolve: presets build on meta, capture with torch.export, count right, take overrides."""

from __future__ import annotations

import functools
import re
import textwrap
from pathlib import Path

import pytest
import torch

from autopar.errors import PresetError
from autopar.models import resolve as models

REQUIRED = [
    "gpt2", "gpt2-medium", "gpt2-xl", "bert-large", "llama-7b", "llama-70b", "llama3-405b",
    "gpt3-175b", "mmr-bert-large", "mmr-1.7b", "mmr-3.6b", "mmr-7.5b",
    "merak-gpt-1.4b", "merak-gpt-2.5b", "merak-gpt-8.3b", "merak-gpt-20b",
    "tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-mlp",
    "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3",
]  # fmt: skip
TINY = ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-encoder", "tiny-mlp"]


@functools.cache
def _meta(name: str) -> models.ModelSpec:
    """One meta-device build per preset for the whole module (tests only read it)."""
    return models.build(name)


def _described_params(description: str) -> int:
    return int(re.search(r"([\d,]+) params", description).group(1).replace(",", ""))


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


def _loss(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@pytest.fixture(scope="module")
def presets() -> dict[str, str]:
    return models.list_presets()


def test_required_presets_are_listed_with_counts_and_shapes(presets: dict[str, str]) -> None:
    assert set(REQUIRED) <= set(presets)
    for name, desc in presets.items():
        assert "\n" not in desc
        assert _described_params(desc) > 0, name
        assert re.search(r"batch \d+ x seq \d+", desc), name


@pytest.mark.parametrize("name", REQUIRED + ["tiny-encoder"])
def test_described_count_equals_built_count(name: str, presets: dict[str, str]) -> None:
    spec = _meta(name)  # meta: no weights allocated, even for 175B
    assert all(p.is_meta for p in spec.model.parameters())
    assert _numel(spec.model) == _described_params(presets[name]) == _described_params(spec.description)


@pytest.mark.parametrize(
    "name, count",
    [
        ("gpt2", 124_439_808),  # with tied input/output embeddings
        ("gpt2-xl", 1_557_611_200),
        ("llama-7b", 6_738_415_616),
        ("llama-70b", 68_976_648_192),
        ("llama3-405b", 405_853_388_800),  # Meta's published 405B (the Hugging Face card's count)
        ("gpt3-175b", 174_604_259_328),
        ("mmr-bert-large", 12 * 1024**2 + 13 * 1024),  # one encoder layer: 12h^2 + 13h
        ("merak-gpt-2.5b", 2_488_598_400),
        ("merak-gpt-8.3b", 8_314_143_744),
        # the mixtures of experts at their published sizes: 141B, 235B, 671B
        ("mixtral-8x22b", 140_620_634_112),
        ("qwen3-235b-a22b", 235_093_634_560),
        ("deepseek-v3", 671_026_404_352),
    ],
)
def test_known_parameter_counts(name: str, count: int, presets: dict[str, str]) -> None:
    assert _described_params(presets[name]) == count


def test_merak_models_are_near_their_named_sizes(presets: dict[str, str]) -> None:
    for name, billions in [("1.4b", 1.4), ("2.5b", 2.5), ("8.3b", 8.3), ("20b", 20.0)]:
        n = _described_params(presets[f"merak-gpt-{name}"])
        assert abs(n / 1e9 - billions) / billions < 0.02, name


@pytest.mark.parametrize(
    "name, hidden, heads, batch, seq",
    [  # Table 1 of minimal-memory-redundancy-ilp.md
        ("mmr-bert-large", 1024, 16, 2, 512),
        ("mmr-1.7b", 2304, 24, 16, 2048),
        ("mmr-3.6b", 3072, 24, 16, 2048),
        ("mmr-7.5b", 4096, 32, 16, 2048),
    ],
)
def test_mmr_presets_match_paper_table(name: str, hidden: int, heads: int, batch: int, seq: int) -> None:
    spec = _meta(name)
    cfg = spec.model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (hidden, heads, 1)
    assert cfg._attn_implementation == "eager"
    assert tuple(spec.args[0].shape) == (batch, seq, hidden)
    assert tuple(spec.kwargs["target"].shape) == (batch, seq, hidden)


def test_large_configs_match_their_papers() -> None:
    llama = _meta("llama-70b").model.config
    assert (llama.num_hidden_layers, llama.hidden_size, llama.intermediate_size) == (80, 8192, 28672)
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (64, 8)
    assert llama._attn_implementation == "sdpa" and llama.use_cache is False
    gpt3 = _meta("gpt3-175b")
    cfg = gpt3.model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (96, 12288, 96, 50257)
    assert gpt3.kwargs["input_ids"].shape[1] == 2048
    for size, hidden in [("1.4b", 1536), ("2.5b", 1920), ("8.3b", 3072), ("20b", 4096)]:
        spec = _meta(f"merak-gpt-{size}")
        assert spec.model.config.n_embd == hidden and spec.kwargs["input_ids"].shape[1] == 1024


@pytest.mark.parametrize("name", TINY + ["gpt2", "mmr-bert-large"])
def test_presets_capture_with_torch_export_on_meta(name: str) -> None:
    spec = _meta(name)
    ep = torch.export.export(spec.model, spec.args, spec.kwargs, strict=False)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) >= len(ep.graph_signature.parameters) > 0
    assert all(n.meta["val"].device.type == "meta" for n in placeholders)
    outputs = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    loss = outputs[0].meta["val"]  # the first output leaf is the scalar loss
    assert loss.shape == () and loss.dtype == torch.float32
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert ops & {"aten.linear.default", "aten.addmm.default"}


def test_token_inputs_are_distinct_int64_tensors_in_vocab() -> None:
    meta = models.build("tiny-gpt2")
    ids, labels = meta.kwargs["input_ids"], meta.kwargs["labels"]
    assert meta.args == () and ids is not labels
    assert ids.is_meta and ids.dtype == torch.int64 and tuple(ids.shape) == (4, 16) == tuple(labels.shape)
    real = models.build("tiny-llama", device="cpu", seed=3)
    ids, labels = real.kwargs["input_ids"], real.kwargs["labels"]
    assert ids.device.type == "cpu" and not torch.equal(ids, labels)
    assert 0 <= int(ids.min()) and int(ids.max()) < real.model.config.vocab_size
    assert int(labels.max()) < real.model.config.vocab_size


@pytest.mark.parametrize("name", TINY)
def test_seeded_cpu_build_is_deterministic(name: str) -> None:
    a, b, c = (models.build(name, device="cpu", seed=s) for s in (0, 0, 1))
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    loss_a = _loss(a.model(*a.args, **a.kwargs))
    loss_b = _loss(b.model(*b.args, **b.kwargs))
    loss_c = _loss(c.model(*c.args, **c.kwargs))
    assert torch.isfinite(loss_a) and loss_a.item() == loss_b.item() != loss_c.item()
    loss_a.backward()
    assert all(p.grad is not None for p in a.model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_dropout_is_zero_by_default(name: str) -> None:
    model = models.build(name).model
    assert model.training
    probs = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert all(p == 0.0 for p in probs)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_dropout"):
        assert getattr(getattr(model, "config", None), key, 0.0) == 0.0


def test_overrides_apply() -> None:
    spec = models.build("gpt2:n_layer=2,n_embd=64,n_head=4,batch=2,seq=8")
    assert spec.name == "gpt2:n_layer=2,n_embd=64,n_head=4,batch=2,seq=8"
    assert len(spec.model.transformer.h) == 2 and spec.model.config.n_embd == 64
    assert tuple(spec.kwargs["input_ids"].shape) == (2, 8)
    assert "2 layers, hidden 64" in spec.description and "batch 2 x seq 8" in spec.description
    # HF attribute aliases, floats, strings and the attention kernel
    llama = models.build("tiny-llama:hidden_size=128,attention_dropout=0.1,attn_implementation=eager").model
    assert llama.config.hidden_size == 128 and llama.config.head_dim == 32  # derived again from the override
    assert llama.config.attention_dropout == 0.1 and llama.config._attn_implementation == "eager"
    gpt = models.build("tiny-gpt2:num_hidden_layers=3,resid_pdrop=0.25,activation_function=relu").model
    assert gpt.config.n_layer == 3 and gpt.config.activation_function == "relu"
    assert {m.p for m in gpt.modules() if isinstance(m, torch.nn.Dropout)} >= {0.25}
    mlp = models.build("tiny-mlp:dim=8,hidden=24,dropout=0.5,seq=3")
    assert mlp.model.fc_in.weight.shape == (24, 8) and mlp.model.dropout.p == 0.5
    assert tuple(mlp.args[0].shape) == (4, 3, 8)
    bf16 = models.build("tiny-gpt2:dtype=bfloat16").model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


def test_tiny_mlp_has_branches_and_residuals() -> None:
    spec = models.build("tiny-mlp")
    assert not hasattr(spec.model, "config") or not hasattr(spec.model.config, "to_dict")  # not HF
    ep = torch.export.export(spec.model, spec.args, spec.kwargs, strict=False)
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    fan_out = max(len(n.users) for n in ops)
    assert fan_out >= 3  # gelu(fc_in(x)) feeds both branches and the residual add
    x = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x"][0]
    assert len(x.users) == 2  # fc_in and the outer residual
    assert any("mse_loss" in str(n.target) for n in ops)


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("gtp2", ["unknown model preset 'gtp2'", "gpt2", "list_presets"]),
        ("tiny-gpt:n_layer=1", ["unknown model preset", "tiny-gpt2"]),
        ("tiny-gpt2:n_layers=1", ["unknown override key 'n_layers'", "GPT2Config", "n_layer"]),
        ("tiny-llama:num_kv_heads=1", ["LlamaConfig", "num_key_value_heads"]),
        ("tiny-mlp:hiden=4", ["TinyMLPConfig", "hidden"]),
        ("tiny-gpt2:n_layer=two", ["n_layer", "int"]),
        ("tiny-gpt2:n_layer", ["KEY=VALUE"]),
        ("tiny-gpt2:n_layer=", ["no value"]),
        ("tiny-gpt2:activation_function=a;b", ["cannot parse value"]),
        ("tiny-gpt2:batch=0", ["batch", "positive integer"]),
        ("tiny-gpt2:seq=65", ["exceeds", "n_positions"]),
        ("tiny-gpt2:n_embd=65", ["not a multiple of the 4 attention heads", "also override n_head"]),
        ("tiny-gpt2:attn_implementation=flash", ["sdpa or eager"]),
        ("tiny-gpt2:dtype=int8", ["floating dtype"]),
        ("no_such_module_xyz:fn", ["neither a preset nor an importable module"]),
        ("missing/dir/model.py:make", ["does not exist"]),
    ],
)
def test_bad_specs_name_the_problem(spec: str, fragments: list[str]) -> None:
    with pytest.raises(PresetError) as info:
        models.build(spec)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def _write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_user_function_from_file(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "mine.py",
        """
        import torch

        def make(device):
            model = torch.nn.Linear(3, 2)
            return model, (torch.empty(5, 3, device=device),)

        def make_kw():
            return torch.nn.Linear(4, 4), [torch.empty(2, 4)], {"unused": None}

        def bad_tuple():
            return torch.nn.Linear(1, 1)

        def bad_model():
            return "model", ()

        def boom():
            raise RuntimeError("kaput")
        """,
    )
    spec = models.build(f"{f}:make", device="meta")
    assert isinstance(spec.model, torch.nn.Linear) and spec.kwargs == {}
    assert spec.model.weight.is_meta and spec.args[0].is_meta  # device passed / used as default device
    assert "8 params" in spec.description
    kw = models.build(f"{f}:make_kw", device="cpu", seed=0)
    assert isinstance(kw.args, tuple) and kw.kwargs == {"unused": None}
    assert torch.equal(kw.model.weight, models.build(f"{f}:make_kw", device="cpu", seed=0).model.weight)
    for fn, fragment in [
        ("bad_tuple", "(model, args)"),
        ("bad_model", "as the model"),
        ("boom", "kaput"),
        ("mak", "did you mean make"),
    ]:
        with pytest.raises(PresetError, match=re.escape(fragment)):
            models.build(f"{f}:{fn}")
    broken = _write(tmp_path / "broken.py", "import not_a_real_module_qq\n")
    with pytest.raises(PresetError, match="importing model file"):
        models.build(f"{broken}:make")


def test_user_function_from_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "userpkg_autopar_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(
        pkg / "nets.py",
        """
        import torch

        def make():
            return torch.nn.Linear(2, 2), (torch.empty(1, 2),), {}
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = models.build("userpkg_autopar_test.nets:make")
    assert spec.model.weight.is_meta  # built under the meta device although make() takes no device
    assert spec.name == "userpkg_autopar_test.nets:make"
