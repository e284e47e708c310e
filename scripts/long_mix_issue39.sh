#!/usr/bin/env bash
# Issue 39, item 2: the demo's drafter recipe trained on a length mixture up to 32k tokens on the YaRN-extended target,
# then the same sweep as scripts/long_context_issue39.sh (1k to 32k, full attention and a 512-token window, prompt
# lookup and plain decoding on the same 2 MT-bench prompts after the same held-out prefixes), so its τ(context) sits
# beside the 512-token-row drafter's prompt by prompt.
# Data: the demo's samples plus 3 long conversations of up to 32,000 tokens made of whole ShareGPT turn pairs of the
# demo mixture's training split (scripts/long_samples.py; the corpus's answers, not the target's), extracted with the
# YaRN target. Training: loader.length_mix {512: 0.75, 32768: 0.25} (a quarter of the tokens in rows up to 32k),
# 500 steps = 340k tokens, the 512-row drafter's 331k (800 steps); everything else the demo's recipe.
#
# Usage: SAMPLES=<make demo's runs/prepare/<hash>/train/samples.jsonl> [WORK=runs/long_mix] \
#        scripts/long_mix_issue39.sh [more context.* overrides]
# ~35 min extraction (three 32k-token forwards of the target), ~25 min training, ~30 min sweep on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${SAMPLES:?SAMPLES=<the samples.jsonl of the demo prepare stage>}"
WORK=${WORK:-runs/long_mix}
logs=runs/scripts/long_mix
mkdir -p "$logs"
"$PY" scripts/long_samples.py --samples "$SAMPLES" --out "$WORK/samples.jsonl" --long 32000 --n 3 | tee "$logs/samples.log"
"$PY" -m eyas.data.extract target=smollm2_yarn extract.samples="$WORK/samples.jsonl" work_dir="$WORK" threads=2 \
  | tee "$logs/extract.log"
"$PY" -m eyas.train train=demo drafter=demo target=smollm2_yarn work_dir="$WORK" threads=2 \
  train.data.store_dir="$WORK/store" '+train.data.loader.length_mix={512:0.75,32768:0.25}' train.max_steps=500 \
  train.output_dir="$WORK/train" | tee "$logs/train.log"
"$PY" -m eyas.serving.export target=smollm2_yarn export.checkpoint="$WORK/train/best" export.out_dir="$WORK/export" \
  export.overwrite=true | tee "$logs/export.log"
"$PY" -m eyas.eval.context_sweep target=smollm2_yarn context.export_dir="$WORK/export" \
  'context.lengths=[1024,4096,8192,16384,32000]' context.prompts.n=2 context.prompts.max_new_tokens=32 \
  'context.windows=[null,512]' context.threads=2 context.out_dir="$WORK/context" "$@" | tee "$logs/context.log"
