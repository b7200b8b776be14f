VENV := .venv
PYTHON := $(VENV)/bin/python
# Touched after a successful install. The editable install maps top-level
# packages when it runs, so a new package's __init__.py also reinstalls.
STAMP := $(VENV)/.installed

.PHONY: venv run test format lint test-newest

venv: $(STAMP)

$(PYTHON):
	python3 -m venv $(VENV)

$(STAMP): setup.py constraints.txt $(wildcard */__init__.py) | $(PYTHON)
	$(VENV)/bin/pip install -c constraints.txt -e '.[test,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PYTHON) examples/linen_to_nnx_flip.py

# --dist loadfile: each test file runs on one worker, so its module fixtures (compiled models,
# the 8-device subprocess) are built once, not once per worker. (xdist_group marks would do
# this per group, but xdist 3.8 loses them under pytest 9.2: it renames `item._nodeid`, which
# pytest 9.2 no longer reads.)
# --max-worker-restart=0: a worker that crashes fails the run at once; restarted under loadfile,
# xdist 3.8 can wait forever for the crashed file's tests.
# --no-loadscope-reorder: files go out in collection order. xdist's default sends the files with
# the most tests first, which left the one-test, four-minute 8-device family check to start last,
# with one worker idle while it ran (~2 minutes of a 35-minute run).
# Two passes: all but the tests marked fusion_emitters compiled with XLA CPU's elemental emitters, which halve
# compile time (MAXBRIDGE_FAST_COMPILE=1, see tests/conftest.py), then those few with the default emitters, from
# the files that mark any (collecting every file again, to select a handful, took ~20 s).
PYTEST := $(PYTHON) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0
test: $(STAMP)
	MAXBRIDGE_FAST_COMPILE=1 $(PYTEST) --durations=15 -m "not fusion_emitters" tests
	$(PYTEST) -m fusion_emitters $$(grep -l fusion_emitters tests/test_*.py)

format: $(STAMP)
	$(VENV)/bin/pyink .
	$(VENV)/bin/ruff check --fix .

# lint-imports: the layer, backend-independence and no-cycle contracts of pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/pyink --check --diff .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# The newest releases PyPI serves for Python 3.12 (MaxText's interpreter), installed
# first as a MaxText environment would hold them; maxbridge (with its tpu extra: the libtpu that jax pins) must install beside them
# without changing jax or flax, and pass the parity, bridge, train and converter tests,
# compiled as users compile them (LLVM at XLA's default -O3; `make test` runs -O0, see tests/conftest.py).
NEWEST := .venv-newest
# The first candidate that runs: a pyenv shim is on PATH even where no 3.12 is selected.
PY312 ?= $(shell for p in $$(command -v python3.12) $$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null); do \
	$$p -c 'import sys' >/dev/null 2>&1 && echo $$p && break; done)

test-newest:
	@test -n "$(PY312)" || { echo "test-newest: no python3.12 found (set PY312=/path/to/python3.12)"; exit 2; }
	rm -rf $(NEWEST) && $(PY312) -m venv $(NEWEST)
	$(NEWEST)/bin/pip install -q --upgrade pip
	$(NEWEST)/bin/pip install -q jax flax
	$(NEWEST)/bin/pip freeze | grep -iE '^(jax|jaxlib|flax)==' > $(NEWEST)/before.txt
	$(NEWEST)/bin/pip install -q -e '.[tpu]' 'pytest>=9.2.0' 'pytest-xdist>=3.8.0'
	$(NEWEST)/bin/pip freeze | grep -iE '^(jax|jaxlib|flax)==' > $(NEWEST)/after.txt
	@diff $(NEWEST)/before.txt $(NEWEST)/after.txt || { echo "installing maxbridge changed jax/flax"; exit 1; }
	@echo "newest leg:" $$(cat $(NEWEST)/after.txt)
	XLA_FLAGS=--xla_backend_optimization_level=3 $(NEWEST)/bin/python -m pytest -q -n 2 --dist loadfile tests/test_parity.py tests/test_bridge.py tests/test_train.py tests/test_converters.py
