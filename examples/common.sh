# Shared by the examples (sourced): the repository root as working directory, the venv's tools, and `run`, which
# prints each command before running it (DRY_RUN=1: prints only; tests/cli/test_examples.py composes every printed
# eyas command with Hydra, so a renamed key fails there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SMOKE=${SMOKE:-0}
DRY_RUN=${DRY_RUN:-0}
VENV=${VENV:-.venv}
EYAS=${EYAS:-$VENV/bin/eyas}
ACCELERATE=${ACCELERATE:-$VENV/bin/accelerate}

run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$DRY_RUN" != 1 ]; then
    "$@"
  fi
}

smoke() { [ "$SMOKE" = 1 ]; }

# SMOKE=1: the embedded target (SmolLM2-135M-Instruct) and sizes a 2-core CPU gets through, for every stage.
smoke_sizes() {
  TARGET=(target=smollm2)
  PREPARE=(corpus=demo corpus.budget=6 corpus.eval_budget=2 prepare.max_len=512 prepare.regen.max_new_tokens=48
           prepare.regen.max_len=512 prepare.regen.concurrency=2 prepare.regen.server.max_model_len=1024
           prepare.threads=1)
  EXTRACT=(extract.concurrency=2 extract.threads=1 extract.server.max_model_len=1024)
  TRAIN=(drafter.draft_vocab_size=1024 train.max_steps=8 train.eval_every=4 train.save_every=4 train.threads=1
         train.data.eval_fraction=0.25 train.data.loader.batch_rows=1 train.data.loader.max_tokens=512)
  EVAL=("eval.prompt_sets=[{name: ood_reasoning, source: ood_reasoning, half: report, n: 2, label: 'hard reasoning (out of distribution)', max_new_tokens: 32}]"
        eval.max_prompt_tokens=1024 eval.server.max_model_len=2048 eval.threads=1)
}

# The environments: eyas's (.venv) and vLLM's (.venv-vllm; the CPU build where there is no GPU).
setup() {
  if [ "$DRY_RUN" != 1 ]; then
    make venv vllm
  fi
}

SECONDS=0
finish() { echo "done in $((SECONDS / 60)) min $((SECONDS % 60)) s: $1"; }
