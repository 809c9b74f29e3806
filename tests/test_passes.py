"""PassManager (dumps, timings, reproducers), the shard pass and collective insertion on small graphs."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.ir.core import MeshSpec, Partial, R, Shard
from autopar.ir.parser import parse
from autopar.ir.verify import verify
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.lower import lower
from autopar.passes.manager import PASSES, PassManager, register_pass
from autopar.passes.shard import ShardOptions, shard


class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64, bias=False)
        self.fc2 = torch.nn.Linear(64, 16, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _prog(mesh):
    with torch.device("meta"):
        m = TwoLinear()
    return lower(capture(m, (torch.empty(8, 16, device="meta"),)), mesh)


def test_pass_manager_dumps_each_pass_and_times_it(tmp_path):
    prog = _prog(MeshSpec((("tp", 2),)))
    pm = PassManager("shard,insert-collectives", dump_dir=tmp_path)
    out = pm.run(prog)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "00-input.ir",
        "01-shard.ir",
        "02-insert-collectives.ir",
    ]
    assert parse((tmp_path / "02-insert-collectives.ir").read_text()) == out
    assert set(pm.timings) == {"shard", "insert-collectives"} and all(t >= 0 for t in pm.timings.values())


def test_pass_manager_honours_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DUMP_DIR", str(tmp_path / "env"))
    PassManager(["shard"]).run(_prog(MeshSpec((("dp", 2),))))
    assert (tmp_path / "env" / "01-shard.ir").exists()


def test_failing_pass_writes_a_reproducer(tmp_path):
    @register_pass("explode-for-test")
    def _explode(prog, opts):
        raise ValueError("boom")

    try:
        with pytest.raises(AutoparError, match="explode-for-test.*boom"):
            PassManager(["explode-for-test"], dump_dir=tmp_path).run(_prog(MeshSpec()))
        assert "failed pass: explode-for-test" in (tmp_path / "reproducer.txt").read_text()
        parse((tmp_path / "reproducer.ir").read_text())
    finally:
        PASSES.pop("explode-for-test")


def test_unknown_pass_is_named():
    with pytest.raises(AutoparError, match="unknown pass.*nope"):
        PassManager(["nope"])


def test_megatron_mlp_is_the_optimum_on_a_tensor_parallel_axis():
    """With communication expensive, the ILP finds Megatron's column-then-row split: one all-reduce."""
    prog = shard(_prog(MeshSpec((("tp", 2),))), ShardOptions(objective="memory", alpha=10.0)).program
    params = {v.name: v.type.placements for v in prog.params}
    assert params["fc1.weight"] == (Shard(0),) and params["fc2.weight"] == (Shard(1),)
    linears = [op for op in prog.ops if op.target == "aten.linear"]
    assert linears[1].type.placements == (Partial("sum"),)
    final = insert_collectives(prog)
    verify(final)
    collectives = [op.target for op in final.ops if op.target in ("all_reduce", "all_gather", "grad_all_reduce")]
    assert collectives.count("all_reduce") == 1  # the row-parallel partial sum
    assert "all_gather" not in collectives


def _annotate(prog, inputs: dict, ops: list):
    """Set placements by hand: inputs by name, ops in order as (result placements, input placements)."""
    from autopar.ir.core import Value
    from autopar.passes.shard import format_placements

    new_inputs = tuple(Value(v.name, v.kind, v.type.with_placements(inputs[v.name]), v.attrs) for v in prog.inputs)
    new_ops = []
    for op, (out, ins) in zip(prog.ops, ops, strict=True):
        attrs = dict(op.attrs, **{"in": [format_placements(p) for p in ins]})
        new_ops.append(op.with_(types=(op.type.with_placements(out),), attrs=attrs))
    return prog.with_(inputs=new_inputs, ops=tuple(new_ops))


def test_data_parallel_grads_are_synced_after_backward_not_per_use():
    s0, r, p = (Shard(0),), (R,), (Partial("sum"),)
    prog = _annotate(
        _prog(MeshSpec((("dp", 2),))),
        {"x": s0, "fc1.weight": r, "fc2.weight": r},
        [(s0, [s0, r]), (s0, [s0]), (s0, [s0, r]), (p, [s0])],  # linear, relu, linear, sum
    )
    final = insert_collectives(prog)
    verify(final)
    assert [p.attrs.get("grad_sync") for p in final.params] == [["dp"], ["dp"]]
    assert [op.target for op in final.ops if not op.target.startswith("aten.")] == ["all_reduce"]  # the loss


class PosAdd(torch.nn.Module):
    """A batch-split activation plus a replicated lookup in a position table (GPT-2's ``wpe``)."""

    def __init__(self, rows: int = 4, extra: bool = False):
        super().__init__()
        self.pos = torch.nn.Embedding(rows, 16)
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.extra = extra

    def forward(self, x, ids):
        e = self.pos(ids)
        out = self.fc(x + e).sum()
        return out + e.sum() if self.extra else out  # extra: e also used where every rank computes alike


def _pos_add(rows: int = 4, extra: bool = False):
    with torch.device("meta"):
        m = PosAdd(rows, extra)
    args = (torch.empty(8, 4, 16, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
    prog = lower(capture(m, args), MeshSpec((("dp", 2),)))
    s0, r, p = (Shard(0),), (R,), (Partial("sum"),)
    ops = [(r, [r, r]), (s0, [s0, r]), (s0, [s0, r]), (p, [s0])]  # embedding, add, linear, sum
    if extra:
        ops += [(r, [r]), (r, [r, r])]  # e.sum(), + (after the loss's all-reduce)
    return insert_collectives(_annotate(prog, {"x": s0, "ids": r, "pos.weight": r, "fc.weight": r}, ops))


def test_gradient_reduction_of_a_replicated_lookup_moves_to_its_table():
    """The lookup's gradient is a partial sum over dp; its f moves up to the table, synced with the
    others after backward (the sum commutes with the embedding's backward), when the table is no
    larger than the lookup and no other use of the lookup would receive a whole gradient."""
    final = _pos_add()
    verify(final)
    assert [p.attrs.get("grad_sync") for p in final.params] == [["dp"], ["dp"]]
    assert "grad_all_reduce" not in [op.target for op in final.ops]
    larger = _pos_add(rows=64)  # a table 16x its lookup: the lookup's gradient is all-reduced instead
    assert [p.attrs.get("grad_sync") for p in larger.params] == [None, ["dp"]]
    assert [op.target for op in larger.ops].count("grad_all_reduce") == 1
    shared = _pos_add(extra=True)  # e.sum() would receive a whole gradient: the f stays where it is
    verify(shared)
    assert [p.attrs.get("grad_sync") for p in shared.params] == [None, ["dp"]]
    assert [op.target for op in shared.ops].count("grad_all_reduce") == 1


def test_replicated_computation_needs_no_gradient_reduction():
    """fc1 runs batch-split (its gradient is partial: synced), fc2 replicated (whole gradient: not)."""
    s0, r = (Shard(0),), (R,)
    prog = _annotate(
        _prog(MeshSpec((("dp", 2),))),
        {"x": r, "fc1.weight": r, "fc2.weight": r},
        [(s0, [s0, r]), (s0, [s0]), (r, [r, r]), (r, [r])],
    )
    final = insert_collectives(prog)
    verify(final)
    assert [p.attrs.get("grad_sync") for p in final.params] == [["dp"], None]
    assert [op.target for op in final.ops if not op.target.startswith("aten.")] == [
        "local_shard",
        "all_gather",
    ]
