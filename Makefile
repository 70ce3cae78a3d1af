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

# The whole job on the built-in target: vocabulary, training, conversion to
# both formats, MT-bench and Spec-Bench evaluation, report. Rerunning it skips
# every finished stage.
demo: setup
	$(VENV)/bin/eagletools pipeline recipes/smollm2-135m-cpu.yaml --output-dir runs/demo

test: setup
	$(PY) -m pytest tests

lint: setup
	$(VENV)/bin/ruff check eagletools tests benchmarks

# The real vLLM-side client: speculators 0.9.0 in its own venv (its declared
# dependencies pull CUDA wheels; docs/design.md 3.4), loading what we convert.
SPEC_VENV ?= .venv-speculators

$(SPEC_VENV)/.installed:
	$(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q torch==2.13.0
	$(SPEC_VENV)/bin/pip install -q "transformers>=5.0,<=5.19.0" "datasets>=4.0,<=5.1.0" \
		safetensors pydantic pydantic-settings loguru==0.7.3 typer rich tqdm "numpy<=2.5.4" \
		huggingface-hub click aiohttp httpx psutil protobuf openai
	$(SPEC_VENV)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	touch $@

.PHONY: interop
interop: setup $(SPEC_VENV)/.installed
	rm -rf runs/interop
	$(PY) tests/interop/make_case.py runs/interop
	HF_HUB_OFFLINE=1 $(SPEC_VENV)/bin/python tests/interop/check_speculators.py runs/interop
