"""``autopar plan --list-models``'s table, written by ``python -m autopar.models.preset_table`` from
``presets.list_presets()`` (which builds every preset's config, importing transformers and torch: seconds), so
that the list prints at once. tests/test_docs_examples.py fails when it differs from ``list_presets()``."""

# ruff: noqa: E501 (one preset a line)
from __future__ import annotations

PRESET_TABLE: dict[str, str] = {
    "gpt2": "GPT-2 small: 124,439,808 params (124M), 12 layers, hidden 768, 12 heads; batch 8 x seq 1024",
    "gpt2-medium": "GPT-2 medium: 354,823,168 params (355M), 24 layers, hidden 1024, 16 heads; batch 8 x seq 1024",
    "gpt2-xl": "GPT-2 XL: 1,557,611,200 params (1.56B), 48 layers, hidden 1600, 25 heads; batch 8 x seq 1024",
    "bert-large": "BERT-Large MLM: 335,174,458 params (335M), 24 layers, hidden 1024, 16 heads; batch 8 x seq 512",
    "llama-7b": "LLaMA-2 7B: 6,738,415,616 params (6.74B), 32 layers, hidden 4096, 32 heads (32 kv), intermediate 11008; batch 4 x seq 4096",
    "llama-70b": "LLaMA-2 70B (GQA, 8 kv heads): 68,976,648,192 params (69B), 80 layers, hidden 8192, 64 heads (8 kv), intermediate 28672; batch 4 x seq 4096",
    "llama3-405b": "Llama 3.1 405B (GQA, 8 kv heads): 405,853,388,800 params (406B), 126 layers, hidden 16384, 128 heads (8 kv), intermediate 53248; batch 1 x seq 8192",
    "gpt3-175b": "GPT-3 175B (GPT-2 architecture, Megatron PTD-P): 174,604,259,328 params (175B), 96 layers, hidden 12288, 96 heads; batch 8 x seq 2048",
    "mixtral-8x22b": "Mixtral 8x22B (8 experts, top-2; GQA, 8 kv heads): 140,620,634,112 params (141B), 56 layers, hidden 6144, 48 heads, 8 experts (top-2); batch 4 x seq 4096",
    "qwen3-235b-a22b": "Qwen3-235B-A22B (128 experts, top-8; GQA, 4 kv heads): 235,093,634,560 params (235B), 94 layers, hidden 4096, 64 heads, 128 experts (top-8); batch 4 x seq 4096",
    "deepseek-v3": "DeepSeek-V3 671B (MLA; 256 routed experts, top-8 in 4 of 8 groups, 1 shared; 3 dense layers): 671,026,404,352 params (671B), 61 layers, hidden 7168, 128 heads, 256 experts (top-8); batch 4 x seq 4096",
    "mmr-bert-large": "ILP paper Table 1 BERT-Large as ONE encoder layer (no embeddings/head, eager attention, as in its Sec. 4.2): 12,596,224 params (12.6M), 1 layer, hidden 1024, 16 heads; batch 2 x seq 512",
    "mmr-1.7b": "ILP paper Table 1 1.7B as ONE encoder layer (no embeddings/head, eager attention, as in its Sec. 4.2): 63,730,944 params (63.7M), 1 layer, hidden 2304, 24 heads; batch 16 x seq 2048",
    "mmr-3.6b": "ILP paper Table 1 3.6B as ONE encoder layer (no embeddings/head, eager attention, as in its Sec. 4.2): 113,286,144 params (113M), 1 layer, hidden 3072, 24 heads; batch 16 x seq 2048",
    "mmr-7.5b": "ILP paper Table 1 7.5B as ONE encoder layer (no embeddings/head, eager attention, as in its Sec. 4.2): 201,379,840 params (201M), 1 layer, hidden 4096, 32 heads; batch 16 x seq 2048",
    "merak-gpt-1.4b": "Merak GPT-1.4B (hidden from Sec. 6; Megatron-style heads, layers fitted to the size): 1,410,352,128 params (1.41B), 47 layers, hidden 1536, 16 heads; batch 8 x seq 1024",
    "merak-gpt-2.5b": "Merak GPT-2.5B (hidden from Sec. 6; Megatron-style heads, layers fitted to the size): 2,488,598,400 params (2.49B), 54 layers, hidden 1920, 20 heads; batch 8 x seq 1024",
    "merak-gpt-8.3b": "Merak GPT-8.3B (hidden from Sec. 6; Megatron-style heads, layers fitted to the size): 8,314,143,744 params (8.31B), 72 layers, hidden 3072, 32 heads; batch 8 x seq 1024",
    "merak-gpt-20b": "Merak GPT-20B (hidden from Sec. 6; Megatron-style heads, layers fitted to the size): 19,945,279,488 params (19.9B), 98 layers, hidden 4096, 32 heads; batch 8 x seq 1024",
    "tiny-gpt2": "tiny GPT-2 for tests: 112,384 params (112K), 2 layers, hidden 64, 4 heads; batch 4 x seq 16",
    "tiny-llama": "tiny LLaMA (GQA) for tests: 90,432 params (90.4K), 2 layers, hidden 64, 4 heads (2 kv), intermediate 128; batch 4 x seq 16",
    "tiny-bert": "tiny BERT MLM for tests: 83,904 params (83.9K), 2 layers, hidden 64, 4 heads; batch 4 x seq 16",
    "tiny-encoder": "tiny single encoder layer for tests: 49,984 params (50K), 1 layer, hidden 64, 4 heads; batch 4 x seq 16",
    "tiny-mlp": "MLP with two branches, residuals and an in-forward MSE loss (not HF): 3,248 params (3.25K), dim 16, hidden 32; batch 4 x seq 8",
}


def _refresh() -> None:
    import json
    from pathlib import Path

    from autopar.models.presets import list_presets

    rows = "".join(f"    {json.dumps(k)}: {json.dumps(v)},\n" for k, v in list_presets().items())
    path = Path(__file__)
    text = path.read_text()
    start = text.index("PRESET_TABLE: dict[str, str] = {\n") + len("PRESET_TABLE: dict[str, str] = {\n")
    end = text.index("}\n", start)
    path.write_text(text[:start] + rows + text[end:])


if __name__ == "__main__":
    _refresh()
