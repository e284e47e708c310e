#!/usr/bin/env bash
# Issue 39, item 3: the long-context drafter served by vLLM's CPU build at 1k and 16k tokens of context, beside the
# bundled loop on the very same prompts (`eyas context` with context.engine=vllm). The drafter is the one
# scripts/long_context_issue39.sh trained on the YaRN-extended target, exported here with the 512-token window it is
# best served with (export.attention_window=512: the export declares `sliding_window` / `layer_types`, which vLLM
# 0.32 reads); the bundled loop also drafts with full attention (eagle3-chain-wfull), so a window the engine
# ignored would show as vLLM's τ following that method's instead of the windowed one's.
# Prompts: 4 MT-bench prompts after held-out ShareGPT prefixes, as the sweep of BENCH.md (SOURCE=<a conversations.jsonl>
# takes that file's prompts instead; the drafter's own training prompts do not make a stronger check here: after a
# few hundred tokens of unrelated prefix the target answers them otherwise, and the drafter accepted 0.08-0.17 of its first drafts).
#
# Usage: [WORK=runs/long_context] [SOURCE=mt_bench] scripts/vllm_long_context.sh [more context.* overrides]
#        (`make vllm` and scripts/long_context_issue39.sh first; ~25 min on 2 cores, most of it the 16k prefills)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/long_context}
logs=runs/scripts/vllm_long_context
mkdir -p "$logs"
source=${SOURCE:-mt_bench}
"$PY" -m eyas.serving.export target=smollm2_yarn export.checkpoint="$WORK/train/best" export.out_dir="$WORK/export_w512" \
  export.attention_window=512 export.speculative_tokens=6 export.overwrite=true | tee "$logs/export.log"
"$PY" -m eyas.eval.context_sweep target=smollm2_yarn context.export_dir="$WORK/export_w512" \
  'context.lengths=[1024,16384]' "context.prompts={name:long,source:\"$source\",n:4,max_new_tokens:64}" 'context.methods=[eagle3-chain,none]' \
  'context.windows=[null,0]' context.engine=vllm context.threads=2 context.out_dir="$WORK/context_vllm" \
  "$@" | tee "$logs/context_$(basename "$source" .jsonl).log"
