#!/usr/bin/env bash
# The GPU path in one command, on any CUDA machine (issue 17): the checks that apply on CUDA, then a bf16
# training run of gpt2-xl on one GPU through autopar.compile beside eager and torch.compile'd eager.
#
#   bash bench/gpu/run.sh                     # from the repository root; results also in bench/gpu/results.jsonl
#   MODEL=gpt2-medium BATCH=4 bash bench/gpu/run.sh
#
# Fails (exit status != 0) without CUDA, and when any check fails. `make test` never runs it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu/run.sh: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PYEOF
status=0  # both parts run; the exit status says whether either failed
OMP_NUM_THREADS=1 "$PY" bench/gpu/cuda_checks.py || status=$?
"$PY" bench/gpu/train_gpt2.py --model "${MODEL:-gpt2-xl}" --batch "${BATCH:-8}" --seq "${SEQ:-1024}" \
    --steps "${STEPS:-10}" --json bench/gpu/results.jsonl || status=$?
exit $status
