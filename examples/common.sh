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

# The environments: eyas's (.venv) and vLLM's (.venv-vllm; the CPU build where there is no GPU).
setup() {
  if [ "$DRY_RUN" != 1 ]; then
    make venv vllm
  fi
}

SECONDS=0
finish() { echo "done in $((SECONDS / 60)) min $((SECONDS % 60)) s: $1"; }
