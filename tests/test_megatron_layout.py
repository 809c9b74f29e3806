"""Megatron's layout is read off the graph's structure, not off module names: names no preset uses, a fused
QKV cut by reshape + permute + unbind (per piece) and a per-head interleaved one (one contiguous block)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.ir.core import MeshSpec
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.solver.sharding.megatron_roles import megatron_layout

HEADS, HEAD_DIM = 2, 4
HIDDEN = HEADS * HEAD_DIM


class Block(nn.Module):
    def __init__(self, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.mix = nn.Linear(HIDDEN, 3 * HIDDEN)  # q, k and v fused
        self.back = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.widen = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.narrow = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.interleaved:  # GPT-NeoX: [b, t, heads, 3 * head_dim], each head's q, k, v side by side
            q, k, v = self.mix(x).view(b, t, HEADS, 3 * HEAD_DIM).transpose(1, 2).split(HEAD_DIM, dim=-1)
        else:  # [b, t, 3, heads, head_dim]: all q, then all k, then all v
            q, k, v = self.mix(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        x = x + self.back(att.transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.narrow(torch.relu(self.widen(x)))


def layout_of(interleaved: bool) -> dict:
    captured = capture(Block(interleaved), (torch.randn(2, 3, HIDDEN),), {})
    return megatron_layout(lower(captured, MeshSpec((("tp", 2),))))


def test_fused_qkv_is_split_per_piece_and_rows_on_their_input_features():
    assert layout_of(interleaved=False) == {
        "mix.weight": ("column", 0, 3),
        "mix.bias": ("column", 0, 3),
        "back.weight": ("row", 1, 1),
        "widen.weight": ("column", 0, 1),
        "widen.bias": ("column", 0, 1),
        "narrow.weight": ("row", 1, 1),
    }


def test_per_head_interleaved_qkv_is_one_contiguous_block():
    layout = layout_of(interleaved=True)
    assert layout["mix.weight"] == ("column", 0, 1) and layout["mix.bias"] == ("column", 0, 1)
