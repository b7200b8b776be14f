VENV := .venv
PYTHON := $(VENV)/bin/python
# Touched after a successful install. The editable install maps top-level
# packages when it runs, so a new package's __init__.py also reinstalls.
STAMP := $(VENV)/.installed

.PHONY: venv run test format lint

venv: $(STAMP)

$(PYTHON):
	python3 -m venv $(VENV)

$(STAMP): setup.py constraints.txt $(wildcard */__init__.py) | $(PYTHON)
	$(VENV)/bin/pip install -c constraints.txt -e '.[test,dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PYTHON) examples/linen_to_nnx_flip.py

test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup tests

format: $(STAMP)
	$(VENV)/bin/pyink .
	$(VENV)/bin/ruff check --fix .

lint: $(STAMP)
	$(VENV)/bin/pyink --check --diff .
	$(VENV)/bin/ruff check .
