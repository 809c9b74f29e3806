"""What every ``torch_compile=True`` equivalence test (tests/test_torch_compile_*.py) runs and checks of each run.

Its ranks run ``compare_jobs`` (tests/equivalence.py) with an Inductor cache of the test's own
(``compiled_jobs``), each job once eagerly (a run keyed ``torch_compile=False``) and compiled.
``compiled_runs`` walks the results and asserts what holds of every run: equal to one process (losses and
parameters, 1e-10 relative in float64), the whole state dict gathered; the eager run compiled nothing and
has no compile log; a compiled run compiled graphs (dynamo's counters), its log shows no failure and no
eager call, and its losses equal the eager run's. It yields each run for the test's own checks, so a
silent fallback to eager, or a compiled program computing something else, fails every one of these tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from tests.equivalence import compare_jobs
from tests.exactness import TOL


def compiled_jobs(rank: int, world: int, cache: str, common: dict[str, Any], jobs: list[dict]) -> dict[str, Any]:
    """``compare_jobs`` of ``jobs`` (each with the keywords ``common``) on this rank, Inductor caching in ``cache``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return compare_jobs(rank, world, [{**common, **job} for job in jobs])


def compiled_runs(results: list[dict], jobs: list[dict]) -> Iterator[tuple[dict, str, dict, str, bool]]:
    """Each run of each job on each rank, checked as the module docstring says: ``(job, run key, the run's
    result, where (for messages), whether it ran compiled)``."""
    for rank, res in enumerate(results):
        for job in jobs:
            out = res[job["name"]]
            eager_key = next(k for k in out if "torch_compile=False" in k)
            for key, r in out.items():
                at = f"{job['name']} {key}, rank {rank}"
                assert r["loss_rel"] < TOL, (at, "losses vs one process", r["loss_rel"])
                assert r["param_rel"] < TOL, (at, r["worst_param"], r["param_rel"])
                assert not r["missing"], (at, r["missing"])
                log = r["compile_log"]
                if key == eager_key:
                    assert log is None and r["graphs"] == 0, at
                    yield job, key, r, at, False
                    continue
                assert r["graphs"] > 0, f"{at}: dynamo compiled no graph"
                assert not log["failed"] and not log["eager"], (at, log)
                e = out[eager_key]["losses"]
                rel = ((r["losses"] - e).abs() / e.abs()).max().item()
                assert rel < TOL, f"{at}: compiled and eager losses differ by {rel:.2e}"
                yield job, key, r, at, True


__all__ = ["compiled_jobs", "compiled_runs"]
