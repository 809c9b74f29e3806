"""``torch_compile=True`` in ``make test``: the small case of tests/test_torch_compile.py's heavy matrix.

One spawn of 2 gloo ranks trains the tiny MLP (``tiny-mlp``) in float64 on tp=2 (its parameters split, the
all-reduces functional collectives inside the compiled graphs) and on dp=2 over two microbatches (gradient buckets
all-reduced inside the last microbatch's compiled backward, the accumulated gradients summed: functional
collectives, started early, waited late), each compiled
with Inductor's C++ back end and eagerly: losses and parameters equal one process to 1e-10 relative, and the
compiled run equals the eager one; dynamo's counters show graphs were compiled and the compile log shows the
training program ran through its compiled call with no failure and nothing eager, so a silent fallback to
eager fails the test. Cold (an empty Inductor cache) this is the suite's one compile: see the commit message
for its time.
"""

from __future__ import annotations

import pytest

from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.options import ShardOptions
from tests._compile_harness import compiled_jobs, compiled_runs
from tests._dist import run_distributed
from tests.exactness import TOL

EAGER, COMPILED = {"torch_compile": False}, {"torch_compile": True}
SMALL = ShardOptions(setup=TrainingSetup(bucket_cap_mb=4096 / 2**20))
RUNS = [("1f1b", {}, EAGER), ("1f1b", {}, COMPILED)]
JOBS = [
    # the memory objective splits the tiny MLP's parameters on tp (the time objective keeps them whole)
    {"name": "tp2", "axes": {"tp": 2}, "runs": RUNS, "compile_kwargs": {"options": ShardOptions(objective="memory")}},
    # buckets of about 4 KB: the tiny MLP's gradients in several, so some start while the backward computes; two
    # microbatches: the second's compiled backward sums the step's accumulated gradients in its buckets
    {
        "name": "dp2",
        "axes": {"dp": 2},
        "runs": RUNS,
        "check_forward": False,
        "microbatches": 2,
        "compile_kwargs": {"options": SMALL},
    },
]


def _ranks(rank: int, world: int, cache: str) -> dict:
    common = {"model_name": "tiny-mlp", "steps": 2, "microbatches": 1, "batch": 4}
    return compiled_jobs(rank, world, cache, common, JOBS)


@pytest.mark.multiproc
@pytest.mark.timeout(600)  # the suite's own guard: a cold Inductor cache took 302 s at load 12-15
def test_compiled_tiny_mlp_on_tp2_and_dp2_equals_one_process_and_eager(tmp_path):
    results = run_distributed(_ranks, 2, str(tmp_path / "inductor"), timeout=580)  # cold: a fresh cache
    for job, _key, r, at, compiled in compiled_runs(results, JOBS):
        assert r["forward_rel"] < TOL, (at, r["forward_rel"])
        if job["name"] == "tp2":  # the plan really splits parameters over tp
            assert r["local_numel"] < r["full_numel"], f"{at}: the plan keeps whole parameters"
        if not compiled:
            continue
        log = r["compile_log"]
        assert "stage0" in log["compiled"], (at, log["compiled"])  # the training program ran compiled
        if job["name"] == "dp2":
            _check_graph_buckets(log, at)


def _check_graph_buckets(log: dict, at: str) -> None:
    """dp=2 with two microbatches: the second one's compiled backward (``stage0``) all-reduces the gradient
    buckets itself, every parameter in one, the first microbatch's gradients added in (else the parameters would
    differ from one process's), and Inductor scheduled a bucket's start with compute kernels before its wait
    (the backward above the bucket computing while its sums are in flight); the first microbatch ran the program
    without buckets (``stage0.accumulate``); the eager hooks reduce none of them (else the gradients would be
    summed twice)."""
    assert "stage0.accumulate" in log["compiled"] and "stage0.accumulate" not in log["graph_buckets"], (at, log)
    buckets = log["graph_buckets"].get("stage0", [])
    assert len(buckets) > 1, f"{at}: no gradient buckets in the compiled backward: {log['graph_buckets']}"
    names = [n for b in buckets for n in b]
    assert len(names) == len(set(names)) == 10, (at, buckets)  # tiny-mlp's ten parameters, each once
    graphs = log["schedules"].get("stage0", [])
    assert graphs, f"{at}: Inductor scheduled no collective in stage0's graphs"
    kinds = max(graphs, key=lambda g: g.count("start"))  # the backward: a start per bucket
    assert kinds.count("start") == len(buckets), (at, kinds)
    first_start, first_wait = kinds.index("start"), kinds.index("wait")
    between = kinds[first_start:first_wait].count("compute")
    assert between > 0, f"{at}: the first bucket's wait follows its start with no compute between: {kinds}"
