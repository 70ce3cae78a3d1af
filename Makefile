# Everything a fresh Linux machine needs: `make demo` runs the main job on the
# built-in defaults, `make test` runs the test suite. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/eagletools vocab build --target smollm2-135m --data sharegpt \
		--num-samples 2000 --size 16384 --output-dir runs/demo/vocab

test: setup
	$(PY) -m pytest tests

lint: setup
	$(VENV)/bin/ruff check eagletools tests benchmarks
