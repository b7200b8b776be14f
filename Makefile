VENV := .venv
PYTHON := $(VENV)/bin/python
# Touched after a successful install. The editable install maps top-level
# packages when it runs, so a new package's __init__.py also reinstalls.
STAMP := $(VENV)/.installed

.PHONY: venv run test

venv: $(STAMP)

$(PYTHON):
	python3 -m venv $(VENV)

$(STAMP): setup.py $(wildcard */__init__.py) | $(PYTHON)
	$(VENV)/bin/pip install -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PYTHON) examples/linen_to_nnx_flip.py

test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup tests
