# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A local CPU build of torch installs in seconds; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= demo-out
# Extra pytest arguments: .ci/run passes --require-nvcc so that CI must compile every kernel.
PYTEST_ARGS ?=

.PHONY: demo test lint clean

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

demo: $(VENV)/.installed
	bash scripts/demo.sh "$(BIN)" "$(DEMO_OUT)"

test: $(VENV)/.installed-test
	$(BIN)/ruff check metrale_cli tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check metrale_cli tests

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .ruff_cache .hypothesis
