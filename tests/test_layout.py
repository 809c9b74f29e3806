"""Redistribution steps, checked by emulating every rank of a mesh in one process."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.ir.core import Partial, R, Shard
from autopar.ir.layout import Unreachable, redistribute_steps, valid
from autopar.runtime.comm.shards import shard_tensor, unshard_tensor


def _locals(x: torch.Tensor, placements, sizes, seed: int):
    """Each rank's local tensor for placements; partial sums are random splits of the value."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    coords = list(itertools.product(*(range(n) for n in sizes)))
    for c in coords:
        t = x
        for p, n, ci in zip(placements, sizes, c):
            if isinstance(p, Shard):
                t = shard_tensor(t, p.dim, p.chunks, n, ci)
        out[c] = t.clone()
    # partial axes: rank 0 of the axis keeps value + noise, others carry -noise / (n-1) shares
    for i, (p, n) in enumerate(zip(placements, sizes)):
        if isinstance(p, Partial):
            for c in coords:
                if c[i] == 0:
                    noise = [torch.randn(out[c].shape, generator=g) for _ in range(n - 1)]
                    for k in range(1, n):
                        peer = c[:i] + (k,) + c[i + 1 :]
                        out[peer] = out[peer] * 0 + noise[k - 1]
                    out[c] = out[c] - sum(noise)
    return out


def _apply(step, locals_, sizes):
    out = {}
    i, n = step.axis, sizes[step.axis]
    a, b = step.before[i], step.after[i]
    for c in locals_:
        group = [c[:i] + (k,) + c[i + 1 :] for k in range(n)]
        if step.kind == "all_reduce":
            out[c] = sum(locals_[g] for g in group)
        elif step.kind == "reduce_scatter":
            out[c] = shard_tensor(sum(locals_[g] for g in group), b.dim, b.chunks, n, c[i])
        elif step.kind == "all_gather":
            out[c] = unshard_tensor([locals_[g] for g in group], a.dim, a.chunks)
        elif step.kind == "local_shard":
            out[c] = shard_tensor(locals_[c], b.dim, b.chunks, n, c[i])
    return out


placement = st.one_of(st.just(R), st.builds(Shard, st.integers(0, 1)), st.just(Partial("sum")))


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 3), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_steps_produce_the_target_layout(sizes, data):
    shape = (math.prod(sizes) * 2, 6 * math.prod(sizes))
    src = tuple(data.draw(placement) for _ in sizes)
    dst = tuple(data.draw(placement) for _ in sizes)
    if not valid(src, shape, sizes) or not valid(dst, shape, sizes):
        return
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    try:
        steps = redistribute_steps(src, dst)
    except Unreachable:
        assert any(isinstance(q, Partial) and q != p for p, q in zip(src, dst))
        return
    cur = _locals(x, src, sizes, seed=1)
    for s in steps:
        assert s.before[s.axis] != s.after[s.axis]
        cur = _apply(s, cur, sizes)
    want = _locals(x, dst, sizes, seed=1)
    for c in cur:
        if not any(isinstance(p, Partial) for p in dst):
            torch.testing.assert_close(cur[c], want[c], msg=f"{src} -> {dst}: {steps}")


def test_nested_shard_is_peeled_inner_first():
    steps = redistribute_steps((Shard(0), Shard(0)), (R, Shard(0)))
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("all_gather", 0), ("local_shard", 1)]
