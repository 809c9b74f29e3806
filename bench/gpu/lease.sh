#!/usr/bin/env bash
# One GPU lease's checks in one command (the device tool's machine: torch preinstalled, no network): install
# autopar and the two wheels it needs that the image lacks (PuLP, highspy: carried in .whl), then the CUDA checks,
# the gpt2-xl bf16 run, then the compile pairs on one GPU. Everything
# lands in $OUT (default bench/gpu/out). Each part has its own time limit, so one that hangs leaves the others.
#
#   bash bench/gpu/lease.sh            # on the GPU machine, from the repository root
#
# The wheels, fetched here first (pip reaches an index on the CPU machine, not on the GPU one) into .whl/, which
# .git/info/exclude keeps out of git (echo /.whl/ >> .git/info/exclude) and the device tool's `carry` sends:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pulp==3.3.2 highspy==1.16.0
# (the versions requirements.lock pins). PARTS=checks,train,pairs picks the parts; T_CHECKS / T_TRAIN / T_PAIRS
# their time limits; MODEL, STEPS and PAIRS as in the scripts. The 2026-12-04 lease: the three parts took about
# 8 minutes of its 15, the machine's start another 1-2 (BENCHMARKS 18).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/gpu/out}"; mkdir -p "$OUT"
# PYTHONSAFEPATH: no cwd first on sys.path, so the forkserver's ranks (tests/_dist.py) import the laid-out autopar in
# $SITE, not the bare autopar/ of this checkout (which lacks autopar.ir: the 2026-12-04 lease's gloo checks failed so)
export PYTHONUNBUFFERED=1 PYTHON=python3 PYTHONSAFEPATH=1
SITE=/tmp/autopar-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
# autopar as pyproject's package-dir lays it out (autopar.ir from ir/, ...), without a build
rm -rf "$SITE/autopar" && cp -r autopar "$SITE/autopar" && for d in ir passes runtime schedule solver; do cp -r "$d" "$SITE/autopar/$d"; done
export PYTHONPATH="$SITE"
nvidia-smi -L; python3 -c "import torch, autopar; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
[[ "${PARTS:-checks,train,pairs}" == *checks* ]] && OMP_NUM_THREADS=1 timeout "${T_CHECKS:-110}" python3 bench/gpu/cuda_checks.py > "$OUT/checks.log" 2>&1; echo "checks exit $?" >> "$OUT/checks.log"
grep -E "PASS|FAIL|exit|Error" "$OUT/checks.log" | cut -c1-600
[[ "${PARTS:-checks,train,pairs}" == *train* ]] && timeout "${T_TRAIN:-190}" python3 bench/gpu/train_gpt2.py --model "${MODEL:-gpt2-xl}" --batch 8 --seq 1024 \
  --warmup 2 --steps "${STEPS:-6}" --json "$OUT/train.jsonl" > "$OUT/train.log" 2>&1; echo "train exit $?" >> "$OUT/train.log"
tail -12 "$OUT/train.log"
[[ "${PARTS:-checks,train,pairs}" == *pairs* ]] && timeout "${T_PAIRS:-130}" torchrun --nproc-per-node 1 bench/gpu/torch_compile_pairs.py --pairs "${PAIRS:-self,dp}" \
  --model gpt2-medium --batch 8 --seq 1024 --warmup 2 --steps 5 --repeats 3 --json "$OUT/pairs.jsonl" > "$OUT/pairs.log" 2>&1
echo "pairs exit $?" >> "$OUT/pairs.log"; grep -v Warning "$OUT/pairs.log" | tail -8
