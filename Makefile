# eyas — every target sets up its own virtual environment first (.venv), so a fresh clone needs only python3.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU wheel where no GPU exists (the PyTorch CPU index, or a local wheel pip already knows about);
# the ordinary PyPI (CUDA) build where one does. Override with `make TORCH_SPEC=... venv`.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: venv demo test lint format bench bench-train bench-extract clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "[venv] GPU found: installing $(TORCH_SPEC) from PyPI"; \
	  $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; \
	else \
	  echo "[venv] no GPU: installing the CPU build of $(TORCH_SPEC)"; \
	  $(BIN)/python -m pip install -q "$(TORCH_SPEC)" --extra-index-url $(TORCH_CPU_INDEX) --retries 1 --timeout 20; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

# The whole pipeline on the embedded default target (SmolLM2-135M-Instruct); prints the result table.
demo: venv
	$(BIN)/python -m eyas.pipeline

# Lint, format check, then the test suite.
test: venv lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean-venv:
	rm -rf $(VENV)
