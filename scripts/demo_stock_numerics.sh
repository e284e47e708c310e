#!/usr/bin/env bash
# The demo's drafter with every method on stock numerics: the target in bf16 with sdpa attention for the
# speculative methods too, as a GPU engine serves them (no row-exact attention, so no bitwise lossless check: a
# multi-token verify rounds differently from one-token decoding and the greedy text can take another path at a
# near-tie; "greedy match" says how often). The demo's own report keeps the speculative methods on row-exact bf16,
# which its lossless check needs, and times plain decoding on sdpa; this run gives the other side, all methods
# interleaved per prompt with plain decoding on the same numerics. Out-of-distribution sets only (their report
# halves, as in the demo), the chain at the demo's recommended K = 2.
#
# Usage: EXPORT=<make demo's runs/export/<hash>> TEXT=<its runs/prepare/<hash>/train/conversations.jsonl> \
#        [PY=.venv/bin/python] scripts/demo_stock_numerics.sh [more overrides]
# ~2 min on 2 quiet cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${EXPORT:?EXPORT=<the demo's export dir>}"
: "${TEXT:?TEXT=<the demo's training conversations.jsonl, for decontamination>}"
logs=runs/scripts/demo_stock_numerics
mkdir -p "$logs"
"$PY" -m eyas.eval eval=demo eval.export_dir="$EXPORT" eval.training_text="$TEXT" eval.dtype=bfloat16 \
  eval.calibration_prompts=0 eval.profile=null eval.chain_length=2 \
  'eval.prompt_sets=[{name: ood_reasoning, source: ood_reasoning, n: 4, label: hard reasoning, max_new_tokens: 128, half: report}, {name: word_problems, source: word_problems, n: 4, label: word problems, max_new_tokens: 128, half: report}]' \
  "$@" | tee "$logs/eval.log"
