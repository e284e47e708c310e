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

# The benchmark budget (regeneration, a larger store, training, eval, the train/extract benches); writes BENCH.md.
bench: venv
	$(BIN)/python -m eyas.bench threads=2

# Drafter-training throughput and peak memory (the README's row).
bench-train: venv
	$(BIN)/python -m eyas.bench_train --vocab 8192 32768 --modes bf16 fp32 --threads 2

# Extraction speed against a bare forward, and store bytes per token (the README's rows).
bench-extract: venv
	$(BIN)/python -m eyas.bench_extract --samples 48 --threads 2 --repeats 2

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
