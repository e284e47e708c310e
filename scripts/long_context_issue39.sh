#!/usr/bin/env bash
# Issue 39's sweep: τ, step time and tokens/s from 1k to 32k tokens of context on the embedded target extended with
# YaRN x4 (target=smollm2_yarn), for the demo's drafter recipe trained on that target (full attention, and the same
# drafter served with a 512-token window as its own method) beside prompt lookup and plain decoding, with the
# target's own loss on real long text (first vs last 1k tokens). Every method shares one prefill per prompt and
# target copy; drafting methods run on row-exact bf16, plain decoding on bf16 sdpa (context.dtype=auto).
#
# Usage: SAMPLES=<make demo's runs/prepare/<hash>/train/samples.jsonl> [WORK=runs/long_context] \
#        scripts/long_context_issue39.sh [more context.* overrides]
# ~2 min extraction, ~10 min training (800 steps), then the sweep: ~1 h on 2 cores, most of it the 32k prefills.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${SAMPLES:?SAMPLES=<the samples.jsonl of the demo prepare stage>}"
WORK=${WORK:-runs/long_context}
logs=runs/scripts/long_context_issue39
mkdir -p "$logs"
"$PY" -m eyas.data.extract target=smollm2_yarn extract.samples="$SAMPLES" work_dir="$WORK" threads=2 \
  | tee "$logs/extract.log"
"$PY" -m eyas.train train=demo drafter=demo target=smollm2_yarn work_dir="$WORK" threads=2 | tee "$logs/train.log"
"$PY" -m eyas.serving.export target=smollm2_yarn export.checkpoint="$WORK/train/best" export.out_dir="$WORK/export" \
  export.overwrite=true | tee "$logs/export.log"
"$PY" -m eyas.eval.context_sweep target=smollm2_yarn context.export_dir="$WORK/export" \
  'context.lengths=[1024,4096,8192,16384,32000]' context.prompts.n=2 context.prompts.max_new_tokens=32 \
  'context.windows=[null,512]' context.threads=2 context.check_target=true context.out_dir="$WORK/context" \
  "$@" | tee "$logs/context.log"
