"""torchrun runs examples/train_elastic.py on two launchers (two "nodes" on this machine) through a lost rank.

One job checks both launches the issue asks for: ``torchrun --nnodes 2`` twice, a c10d rendezvous on
localhost, one process per node, the pipeline (pp=2) spanning the two; with ``--max-restarts 1`` a rank
kills itself (SIGKILL) in the middle of step 4 of the first attempt, torchrun restarts both nodes, the
job resumes from the checkpoint of step 2 and finishes. Float64 throughout (the loss computed from the
logits in float64, ``tests/exactness.py``), so the whole curve, first attempt and resumed one, and the
final model equal one uninterrupted process within ``TOL``, and the step run twice (3: done before the
kill, again after the resume) is bit for bit the same.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._dist import _free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_elastic.py"
LAUNCH_TIMEOUT = 300  # seconds for the whole job, a hang guard far above the ~50 s it takes on 2 loaded cores


def float64_tiny_gpt2():
    """Tiny GPT-2 in float64 with its cross-entropy computed in float64: a MODEL for ``--model``
    (``tests.test_launch:float64_tiny_gpt2``)."""
    from autopar.models.resolve import build
    from tests.exactness import float64_model

    spec = build("tiny-gpt2:batch=8", device="cpu")  # weights from the seed the caller set
    return float64_model(spec.model), (), dict(spec.kwargs)


def _example():
    """examples/train_elastic.py as a module (its single-process reference, its arguments)."""
    spec = importlib.util.spec_from_file_location("train_elastic", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(
    argv: list[str],
    nodes: int,
    env: dict[str, str],
    cwd: Path,
    script: Path = EXAMPLE,
    nproc: int = 1,
    restarts: int = 1,
) -> list[tuple[int, str]]:
    """``nodes`` torchrun launchers of ``script`` (``nproc`` processes each) joining one c10d rendezvous on
    localhost; each one's exit status and output (written to a file: a full pipe would stall a launcher)."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-launch",
        "--local-addr=127.0.0.1", f"--max-restarts={restarts}", str(script), *argv,
    ]  # fmt: skip
    outs = [cwd / f"launcher{n}.log" for n in range(nodes)]
    procs = []
    try:
        for out in outs:
            with open(out, "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:  # past the timeout: torchrun stops its rank processes (their own sessions) on SIGTERM
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(code, out.read_text()) for code, out in zip(codes, outs)]


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_launchers_survive_a_killed_rank_and_equal_one_process(tmp_path):
    """Two torchrun launchers (c10d rendezvous on localhost), pp=2 spanning them, checkpoints every 2
    steps; rank 1 is SIGKILLed in the middle of step 4 of the first attempt, torchrun restarts both and
    the job resumes from step 2. The losses of both attempts and the final model (exported to
    safetensors) equal the uninterrupted single-process run within TOL (largest seen: losses 1.8e-16,
    model 1.2e-13, the tied embedding); step 3, run in both attempts, is bit for bit the same. A resume
    that drops the learning-rate schedule fails it (checked by hand: losses 5e-4, model 3e-2 off).
    Cost: 32-45 s wall on the shared 2 cores (two launchers, four rank processes over the two
    attempts, each importing torch, transformers and autopar), plus the single-process reference."""
    from autopar.runtime.checkpoint.safetensors_io import load_safetensors
    from tests.exactness import TOL, state_error

    example = _example()
    argv = [
        "--model", "tests.test_launch:float64_tiny_gpt2", "--mesh", "pp=2", "--microbatches", "2",
        "--steps", "6", "--every", "2", "--keep", "2", "--timeout", "60", "--fail-at", "1:4",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--losses", str(tmp_path / "losses.jsonl"),
        "--export", str(tmp_path / "final.safetensors"),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    results = _launch(argv, 2, env, tmp_path)
    logs = "\n".join(text for _, text in results)
    assert all(rc == 0 for rc, _ in results), logs[-6000:]
    assert "rank 1: SIGKILL in step 4 (--fail-at)" in logs and "exitcode: -9" in logs, logs[-6000:]  # seen by torchrun

    runs: dict[int, dict[int, float]] = {}  # the step a run started from -> its losses by step
    for line in (tmp_path / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        runs.setdefault(entry["start"], {})[entry["step"]] = entry["loss"]
    assert list(runs) == [0, 2], runs  # the first attempt, and the one resumed from the checkpoint of step 2
    assert list(runs[0]) == [1, 2, 3] and list(runs[2]) == [3, 4, 5, 6], runs  # killed in step 4
    assert runs[0][3] == runs[2][3]  # the resumed run takes the lost run's step 3 bit for bit
    assert sorted(d.name for d in (tmp_path / "ckpt").iterdir()) == ["step-4", "step-6"]  # --keep 2

    losses, model = example.reference(example.parse_args(argv))
    curve = {**runs[0], **runs[2]}
    worst_loss = max(abs(curve[s] - ref) / abs(ref) for s, ref in enumerate(losses, 1))
    worst_state, where, missing = state_error(load_safetensors(tmp_path / "final.safetensors"), model)
    assert not missing, missing
    print(f"largest relative difference: losses {worst_loss:.1e}, final model {worst_state:.1e} ({where})")
    assert worst_loss < TOL and worst_state < TOL, (worst_loss, worst_state, where)


def test_restarts_on_a_shared_store_are_refused(monkeypatch):
    """Under --max-restarts, torchrun's default store shared by every attempt would make the restarted
    group read the lost one's addresses: autopar (init_mesh, and the example before anything) refuses to
    start and says what to set."""
    from autopar.api import check_restartable
    from autopar.errors import MeshError

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(MeshError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restart: nothing to refuse
    check_restartable()
