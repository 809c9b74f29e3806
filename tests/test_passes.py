"""PassManager (dumps numbered by the pipeline, slices of it, forks into variants, the shard cache, timings,
reproducers, codegen registered by the runtime), the shard pass and collective insertion on small graphs."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.ir.core import MeshSpec, Partial, R, Shard
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.flow import FLOW, flow_index
from autopar.passes.lower import lower
from autopar.passes.manager import MAIN, PASSES, PassManager, Variants, register_pass
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


@pytest.fixture
def toy_pass():
    """A pass registered for one test: it counts the ops of what it gets and passes it on unchanged."""
    seen: list[int] = []

    @register_pass("count-ops-for-test")
    def _count(prog, opts):
        seen.append(len(prog.ops))
        return prog, len(prog.ops)

    yield seen
    PASSES.pop("count-ops-for-test")


def test_adding_a_pass_is_one_registration_and_one_pipeline_entry(tmp_path, toy_pass):
    """Registered once, named in a pipeline: the manager runs it in its place, on what the pass before made,
    dumps it under its position (the passes after it renumbered), times it and keeps its report."""
    prog = _prog(MeshSpec((("tp", 2),)))
    megatron = {"shard": ShardOptions(objective="memory", alpha=10.0)}  # one all-reduce to insert
    pm = PassManager(["shard", "count-ops-for-test", "insert-collectives"], dump_dir=tmp_path, options=megatron)
    out = pm.run(prog)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-input.ir", "01-shard.ir", "02-count-ops-for-test.ir", "03-insert-collectives.ir"]
    assert toy_pass == [len(pm.outputs["shard"].ops)] and pm.info["count-ops-for-test"] == toy_pass[0]
    assert parse((tmp_path / "02-count-ops-for-test.ir").read_text()) == pm.outputs["shard"]
    assert len(out.ops) > toy_pass[0]  # insert-collectives ran after it, on its output
    assert set(pm.timings) == {"shard", "count-ops-for-test", "insert-collectives"}


def test_a_run_from_a_later_pass_keeps_the_pipelines_numbers(tmp_path):
    """A slice of FLOW (a plan file's program taken up at split) is numbered as in the whole flow; nothing
    before ``start`` runs and the input is not dumped again (the pass before made it)."""
    prog = _prog(MeshSpec((("dp", 2),)))
    pm = PassManager(FLOW, dump_dir=tmp_path, options={"split": {"pp": 1}, "assign-stages": {"pp": 1}})
    out = pm.run(prog, start="split", stop="assign-stages")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["05-split.ir", "06-assign-stages.ir"]
    assert {op.attrs["stage"] for op in out.ops} == {0} and set(pm.outputs) == {"split", "assign-stages"}
    assert flow_index("split") == 5 and pm.number("split") == 5
    with pytest.raises(AutoparError, match="not in the pipeline"):
        pm.run(prog, start="nope")


class LossAndActivations(torch.nn.Module):
    def __init__(self, loss_first: bool = True):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.loss_first = loss_first

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return (h.sum(), h) if self.loss_first else (h, h.sum())


def _staged(loss_first: bool = True):
    with torch.device("meta"):
        m = LossAndActivations(loss_first)
    prog = lower(capture(m, (torch.empty(8, 16, device="meta"),)), MeshSpec((("dp", 2),)))
    return PassManager(["assign-stages"], options={"assign-stages": {"pp": 1}}).run(prog)


def test_a_fork_runs_the_passes_after_it_on_each_variant(tmp_path):
    """prune-outputs forks the program: the training one (pruned to the loss, the main variant) and the
    forward one (every output, ``forward``); insert-transfers runs on both, the forward one's dump named
    ``.forward``; the carried-over forward program is not dumped again at the fork. Without a scalar loss
    first there is no training variant (and no dump of one)."""
    pm = PassManager(FLOW, dump_dir=tmp_path / "loss", options={"insert-transfers": {}})
    out = pm.run(_staged(), start="prune-outputs", stop="insert-transfers")
    assert isinstance(out, Variants) and list(out) == [MAIN, "forward"]
    assert len(out[MAIN].outputs) == 1 and len(out["forward"].outputs) == 2
    names = sorted(p.name for p in (tmp_path / "loss").iterdir())
    assert names == ["07-prune-outputs.ir", "08-insert-transfers.forward.ir", "08-insert-transfers.ir"]
    assert parse((tmp_path / "loss" / "08-insert-transfers.forward.ir").read_text()) == out["forward"]
    # broken input: activations first, no loss to train
    pm = PassManager(FLOW, dump_dir=tmp_path / "none")
    out = pm.run(_staged(loss_first=False), start="prune-outputs", stop="insert-transfers")
    assert list(out) == ["forward"] and len(out["forward"].outputs) == 2
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["08-insert-transfers.forward.ir"]


def test_the_shard_pass_output_is_cached_by_content(tmp_path, monkeypatch):
    """With the manager's cache on and nothing dumped, the shard pass's output is kept on disk: a second
    manager reads it back (no solve: no report, no time) and the flow goes on from the same program. A
    manager with the cache off, or dumping, solves again."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    prog = _prog(MeshSpec((("tp", 2),)))
    first = PassManager(["shard", "insert-collectives"], cache=True)
    solved = first.run(prog)
    assert "shard" in first.info and len(list((tmp_path / "cache").iterdir())) == 1
    again = PassManager(["shard", "insert-collectives"], cache=True)
    assert print_program(again.run(prog)) == print_program(solved)
    assert "shard" not in again.info and set(again.timings) == {"insert-collectives"}
    for pm in (PassManager(["shard"]), PassManager(["shard"], cache=True, dump_dir=tmp_path / "dump")):
        pm.run(prog)
        assert "shard" in pm.info and "shard" in pm.timings
    assert PASSES["shard"].cached and not PASSES["insert-collectives"].cached


def test_every_pass_of_the_flow_is_registered_codegen_by_the_runtime(tmp_path):
    """capture and lower are registered passes beside the others; codegen is the runtime's, run and dumped by
    the manager (its dump is the generated module's code, named by the rank's variant)."""
    from autopar.runtime.build import codegen as runtime_codegen

    assert set(FLOW) <= set(PASSES) and {"capture", "lower", "codegen"} <= set(PASSES)
    assert PASSES["codegen"].fn is runtime_codegen.codegen_pass and PASSES["codegen"].suffix == ".py"
    with torch.device("meta"):
        m = TwoLinear()
    pm = PassManager(FLOW, dump_dir=tmp_path, options={"lower": MeshSpec((("tp", 2),))})
    prog = pm.run((m, (torch.empty(8, 16, device="meta"),), {}), stop="insert-collectives")
    named = dict(m.named_parameters())
    for rank in range(2):
        options = runtime_codegen.CodegenOptions({"tp": rank}, named.__getitem__, device="meta")
        gm = pm.run(Variants({f"rank{rank}": prog}), start="codegen", options={"codegen": options})[f"rank{rank}"]
        assert (tmp_path / f"09-codegen.rank{rank}.py").read_text() == gm.code
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "01-capture.py",
        "02-lower.ir",
        "03-shard.ir",
        "04-insert-collectives.ir",
        "09-codegen.rank0.py",
        "09-codegen.rank1.py",
    ]
    assert (tmp_path / "01-capture.py").read_text() == pm.outputs["capture"].exported.graph_module.code


def test_a_manager_told_its_directory_later_writes_what_it_made(tmp_path):
    """``dump_into``: a manager that ran without a dump directory (a rank's module built before its caller
    dumps it) writes its dumps, as they would have been written, when given one."""
    prog = _prog(MeshSpec((("tp", 2),)))
    pm = PassManager(["shard", "insert-collectives"], dump_env=False)
    out = pm.run(prog)
    assert pm.dump_dir is None and not list(tmp_path.iterdir())
    pm.dump_into(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-input.ir", "01-shard.ir", "02-insert-collectives.ir"]
    assert parse((tmp_path / "02-insert-collectives.ir").read_text()) == out


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
