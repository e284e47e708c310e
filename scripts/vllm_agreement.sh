#!/usr/bin/env bash
# The engine agreement check with a drafter that can fail it (issue 35, item 8): an export served by vLLM's CPU
# build and by the bundled loop on the same prompts in one `eyas eval`, chain K = 6, greedy. The rule
# (eval/engine_eval.py, AgreementRule): vLLM's τ within 5% of the bundled loop's and acceptance per position within
# 0.05, judged on the prompts both decoded to the very same tokens (when 3 or more did; else on the whole set), and
# only where the bundled τ there is at least 1.8 (a wrongly served export runs at τ ≈ 1.0).
# Sets: out-of-distribution and in-distribution reasoning, and 8 of the drafter's own training prompts (TRAIN_TEXT:
# the store's training conversations): a fidelity check, not a quality figure (the drafter saw these answers, so it
# accepts most of its drafts there, and a serving error shows as a large gap).
#
# Usage: EXPORT=<export dir> TRAIN_TEXT=<runs/prepare/<hash>/train/conversations.jsonl> [THREADS=2] \
#        [LOGS=runs/scripts/vllm_agreement] scripts/vllm_agreement.sh
#        (`make vllm` first; ~5 min on 2 cores). Any export works the same way (EAGLE-3.1, P-EAGLE: the engine
#        reads the family from the export's config).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${EXPORT:?EXPORT=<export dir> (e.g. the runs/export/<hash> of make demo)}"
: "${TRAIN_TEXT:?TRAIN_TEXT=<the conversations.jsonl the drafter was trained on>}"
logs=${LOGS:-runs/scripts/vllm_agreement}
mkdir -p "$logs"
"$PY" -m eyas.eval eval.export_dir="$EXPORT" eval.engine=vllm 'eval.methods=[eagle3-chain]' eval.profile=null \
  eval.threads="${THREADS:-2}" eval.server.max_model_len=2048 eval.chain_length=6 work_dir="$logs" \
  'eval.prompt_sets=[{name:reasoning_in_dist,source:reasoning_gym,in_distribution:true,n:8,label:"hard reasoning (in distribution)",max_new_tokens:128},{name:ood_reasoning,source:ood_reasoning,half:report,n:8,label:"hard reasoning (out of distribution)",max_new_tokens:128},{name:train_in_dist,source:"'"$TRAIN_TEXT"'",in_distribution:true,n:8,label:"the drafter'"'"'s training prompts (fidelity only)",max_new_tokens:128}]' \
  | tee "$logs/eval.log"
