"""A rank's boxes of a global tensor (runtime/checkpoint/pieces.py) and states as JSON
(runtime/checkpoint/jsonstate.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import CheckpointError
from autopar.ir.core import Replicate, Shard
from autopar.runtime.build.codegen import shard_param
from autopar.runtime.checkpoint.jsonstate import decode, encode
from autopar.runtime.checkpoint.pieces import boxes, dim_runs, flat_boxes

NAMES, SIZES = ("dp", "tp"), (2, 3)


@st.composite
def _layouts(draw):
    """A global shape and placements over a 2 x 3 mesh: plain, strided and nested shards, uneven too."""
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    placements = []
    for _ in NAMES:
        if draw(st.booleans()):
            placements.append(Replicate())
        else:
            placements.append(Shard(draw(st.integers(0, len(shape) - 1)), draw(st.sampled_from([1, 1, 2, 3]))))
    return shape, placements


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.data())
def test_boxes_place_every_local_element_at_its_global_index(layout, data):
    """Each rank's boxes hold exactly its local shard's elements, at their global offsets; over the
    ranks of one replica the boxes cover the whole tensor once (and ZeRO's flat ranges of a shard too)."""
    shape, placements = layout
    whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for c in itertools.product(*(range(n) for n in SIZES)):
        coords = dict(zip(NAMES, c))
        local = shard_param(whole, placements, NAMES, SIZES, coords).contiguous()
        runs = dim_runs(shape, placements, NAMES, SIZES, coords)
        start = data.draw(st.integers(0, local.numel()))
        stop = data.draw(st.integers(start, local.numel()))
        buffer = local.reshape(-1)[start:stop].clone()  # a ZeRO slice of the shard: elements [start, stop)
        for b in boxes(local, local.shape, runs):
            index = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.view.shape))
            assert torch.equal(b.view, whole[index])
            covered[index] += 1
        for b in boxes(buffer, local.shape, runs, start, stop):
            index = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.view.shape))
            assert torch.equal(b.view, whole[index])
    replicas = math.prod(n for p, n in zip(placements, SIZES) if not isinstance(p, Shard))
    assert torch.equal(covered, torch.full(shape, replicas))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_boxes_are_the_flat_range(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    t = torch.arange(numel).reshape(shape)
    got = [
        t[tuple(slice(o, o + n) for o, n in zip(off, size))].reshape(-1) for off, size in flat_boxes(shape, start, stop)
    ]
    assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=t.dtype), torch.arange(start, stop))
    assert len(got) <= max(1, 2 * len(shape) - 1)


def test_states_round_trip_through_json_and_refuse_objects():
    state = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "inf": float("inf"),
        "none": None,
        "flags": [True, "amsgrad"],
        3: {"step": torch.tensor(7.0), "x": torch.randn(2, 3, dtype=torch.float64), "ids": torch.arange(3)},
        "dtype": torch.bfloat16,
    }
    back = decode(encode(state))
    assert back.keys() == state.keys() and back["betas"] == (0.9, 0.999) and back["inf"] == float("inf")
    assert back["dtype"] is torch.bfloat16 and back["flags"] == [True, "amsgrad"]
    for k, v in state[3].items():
        assert torch.equal(back[3][k], v) and back[3][k].dtype == v.dtype  # exact, float64 digits too
    with pytest.raises(CheckpointError, match=r"state\.fn is a function"):
        encode({"fn": lambda: 0})
