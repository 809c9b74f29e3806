# autopar: the two commands. Both bootstrap .venv on a machine that has only python3.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Every direct and transitive dependency of `make demo` / `make test`, pinned for CI's Python (3.11,
# linux x86-64); torch itself is left out so TORCH can pick a build (its own dependencies are pinned).
LOCK := requirements.lock
PIP := pip==26.3
PIP_TOOLS := pip-tools==7.6.2

.PHONY: demo test test-heavy golden lint venv lock clean

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(PIP)"
	# torch first and pinned: a bare `torch` would pull several GB of CUDA wheels.
	$(PY) -m pip install -q "$(TORCH)" -c $(LOCK)
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt2.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -n 3 --dist worksteal --durations=15 -m "not heavy"

# The tests marked heavy (minutes of Inductor compilation on every rank: tests/test_torch_compile.py's 4-rank
# float64 run over every mesh), left out of `make test` to keep it within 15 minutes on 2 cores.
test-heavy: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15 -m heavy

# Rewrite tests/golden/ (the IR after every pass, checked by tests/test_golden_ir.py) after a change in what a
# pass emits; review `git diff tests/golden` and commit it with the change (tests/golden/README.md).
golden: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tests.test_golden_ir --refresh

# ruff, and import-linter's lint-imports on the layering contracts in pyproject.toml (through
# tests/lint_imports.py: a bare lint-imports cannot see ir/, passes/, solver/ and runtime/, which live
# outside autopar/). `make test` checks the same contracts (tests/test_layers.py).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m tests.lint_imports --no-cache

# Refresh the lock after changing pyproject.toml's dependencies (one command: `make lock`): new
# dependencies are added and every existing pin is kept; `make lock UPGRADE=--upgrade` moves every pin
# to the newest release. pip-compile resolves in a throw-away venv; torch is resolved as $(TORCH) so its
# dependencies are locked, and left out of the file.
UPGRADE ?=
lock:
	rm -rf .lockenv && $(PYTHON) -m venv .lockenv
	.lockenv/bin/python -m pip install -q "$(PIP)" "$(PIP_TOOLS)"
	echo "$(TORCH)" > .lockenv/torch.in
	CUSTOM_COMPILE_COMMAND="make lock" .lockenv/bin/pip-compile --quiet --strip-extras --extra test --extra hf --extra tensorboard --extra torchdata --unsafe-package torch \
	    --no-emit-index-url --no-emit-find-links $(UPGRADE) -o $(LOCK) pyproject.toml .lockenv/torch.in
	rm -rf .lockenv

clean:
	rm -rf $(VENV) build *.egg-info
