#!/usr/bin/env bash
# Issue 40's table: today's demo drafter against each objective and drafter family at equal data, on the demo's
# store, evaluated on out-of-distribution reasoning (ood_reasoning, report half) at K = 6 and 3, with 95% intervals,
# paired Δτ against the default and prompt lookup on the same prompts (eyas/lab/recipe.py, conf/recipe.yaml).
#
# Usage: STORE=<make demo's runs/store/<hash>> TEXT=<its runs/prepare/<hash>/train/conversations.jsonl> \
#        [WORK=<work dir, default runs>] [ONLY=default,specforge,loss-lk-hybrid,eagle3.1,p-eagle] [N=12] \
#        scripts/recipe_issue40.sh [more overrides, e.g. train.max_steps=400]
# A variant already trained under WORK with the same settings is reused, not retrained; a rerun only evaluates.
# ~9 min of training (800 steps) and ~4 min of evaluation per variant on 2 quiet cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${STORE:?STORE=<feature store dir>}"
: "${TEXT:?TEXT=<the training conversations.jsonl of the store, for decontamination>}"
WORK=${WORK:-runs}
logs=runs/scripts/recipe_issue40
mkdir -p "$logs"
"$PY" -m eyas.lab.recipe threads=2 work_dir="$WORK" recipe.store_dir="$STORE" recipe.training_text="$TEXT" \
  recipe.eval_dtype=auto recipe.prompts.n="${N:-12}" "recipe.only=[${ONLY:-default,specforge,loss-lk-hybrid,eagle3.1,p-eagle}]" \
  "$@" | tee "$logs/recipe.log"
