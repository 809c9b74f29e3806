"""What a ``torch_compile=True`` run leaves eager or unoverlapped, said before it runs (``autopar plan
--torch-compile``) and in its compile log: ``runtime/build/compiled.py`` ``eager_parts`` from the plan's
features. No compiling here (cheap: a few seconds of planning)."""

from __future__ import annotations

import json

from autopar.cli import main
from autopar.runtime.build.compiled import CompileLog, eager_parts, mesh_eager_parts
from autopar.runtime.build.compiled_split import SplitLog


def _has(lines: list[str], start: str) -> bool:
    return any(line.startswith(start) for line in lines)


def test_eager_parts_name_each_feature_that_stays_eager_and_why():
    assert eager_parts() == []  # one process, one stage: everything compiled, nothing to overlap
    z3 = eager_parts(zero=3, data_parallel=True)
    assert _has(z3, "ZeRO-3 unit gathers and releases") and "graph break" in z3[0]
    assert not _has(z3, "gradient buckets")  # ZeRO-3 reduce-scatters per unit, no buckets
    assert _has(eager_parts(zero=2, data_parallel=True), "gradient buckets")
    # a returned loss's all-reduce runs after the compiled forward, deferred to its first read as eager's is
    assert eager_parts(data_parallel=True, graph_buckets=True) == []
    assert eager_parts(split_backward=True) == []  # B and W compiled as two graphs each (compiled_split.py)
    sub = eager_parts(sub_pipeline_tp=True, split_backward=True, tensor_parallel=True)
    assert _has(sub, "the training programs: eager whole")
    assert _has(mesh_eager_parts({"pp": 2, "tp": 2}, 0, False, False), "Megatron f's gradient all-reduce")
    assert not _has(mesh_eager_parts({"pp": 2, "tp": 1, "dp": 1}, 0, False, False), "Megatron f's")  # size-1 axes


def test_the_compile_log_summary_states_the_plans_eager_parts():
    notes = eager_parts(zero=3, data_parallel=True)
    text = CompileLog(plan_notes=notes).summary()
    assert all(f"eager or not overlapped by the plan: {n}" in text for n in notes)
    split = SplitLog(graphs=[{"B": 2, "W": 5, "boundary": 3}])  # what a split backward's compile records
    text = CompileLog(split={"stage1": split}).summary()
    assert "stage1: backward compiled as B (2 input gradients) and W (5 weight gradients), 3 tensors" in text


def test_autopar_plan_torch_compile_lists_the_eager_parts(capsys):
    assert main(["plan", "gpt2:n_layer=2", "--mesh", "pp=2,tp=2", "--schedule", "zbv", "--no-baselines", "--json"]) == 0
    assert "torch_compile_eager" not in json.loads(capsys.readouterr().out)  # not asked: not said
    argv = ["plan", "gpt2:n_layer=2", "--mesh", "pp=2,tp=2", "--schedule", "zbv", "--no-baselines", "--torch-compile"]
    assert main([*argv, "--json"]) == 0
    eager = json.loads(capsys.readouterr().out)["torch_compile_eager"]
    assert _has(eager, "Megatron f's gradient all-reduce") and not _has(eager, "the zero-bubble")
    assert not _has(eager, "ZeRO-3")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "torch_compile=True: every program compiled with Inductor, but:" in text
    assert all(f"  - {line}" in text for line in eager)
    assert (
        main(["plan", "gpt2:n_layer=2", "--mesh", "dp=2", "--zero", "3", "--no-baselines", "--torch-compile", "--json"])
        == 0
    )
    eager = json.loads(capsys.readouterr().out)["torch_compile_eager"]
    assert _has(eager, "ZeRO-3 unit gathers and releases")
