#!/usr/bin/env bash
# An EAGLE-3 drafter for Qwen3-8B on one node of 8 GPUs, from the target's own answers to a drafter served by vLLM:
#   1. regeneration: the corpus's prompts answered by Qwen3-8B in thinking mode, through vLLM (8 replicas)
#   2. extraction: the target's aux states and top-32 distribution, through vLLM, into a compact store
#   3. training: 8 processes, plain data parallel (Muon needs it; under ZeRO the optimizer falls back to AdamW)
#   4. export: the best checkpoint in the SGLang/vLLM EAGLE-3 format (the target comes from the checkpoint)
#   5. evaluation: τ and tokens/s inside vLLM on four prompt sets (the target comes from the export)
#
#   bash examples/qwen3_8b.sh             # on the GPU node; outputs under WORK (runs/qwen3_8b)
#   SMOKE=1 bash examples/qwen3_8b.sh     # the same commands and engines on the embedded target, CPU, tiny sizes
#   DRY_RUN=1 bash examples/qwen3_8b.sh   # print the commands only
#
# Timing and τ of a GPU run: not measured yet. SMOKE=1 needs `make vllm` (vLLM's CPU build), as the full run does.
source "$(dirname "$0")/common.sh"

MODEL=${MODEL:-Qwen/Qwen3-8B}
GPUS=${GPUS:-8}
if smoke; then
  WORK=${WORK:-runs/example-smoke/qwen3_8b}
  smoke_sizes   # TARGET, PREPARE, EXTRACT, TRAIN, EVAL: the embedded target at tiny sizes (common.sh)
  LAUNCH=(--config_file conf/accelerate/cpu_ddp.yaml --num_processes 1)
else
  WORK=${WORK:-runs/qwen3_8b}
  TARGET=(target=hf "target.path=$MODEL")
  # Qwen3's model card: thinking mode samples at temperature 0.6, top_p 0.95 (greedy decoding repeats itself)
  PREPARE=(corpus=reasoning_mix prepare.regen.temperature=0.6 prepare.regen.top_p=0.95
           "prepare.regen.server.args=['--data-parallel-size','$GPUS']")
  EXTRACT=()
  LAUNCH=(--config_file conf/accelerate/ddp.yaml --num_processes "$GPUS")
  TRAIN=(drafter.draft_vocab_size=32000)   # EAGLE-3's draft vocabulary size for ~150k-token vocabularies
  EVAL=()
fi

setup
run "$EYAS" prepare "${TARGET[@]}" prepare=gpu "prepare.out_dir=$WORK/prepare" "hydra.run.dir=$WORK/hydra/prepare" \
  "${PREPARE[@]}"
run "$EYAS" extract "${TARGET[@]}" extract=gpu "extract.samples=$WORK/prepare/train/samples.jsonl" \
  "extract.out_dir=$WORK/store" "hydra.run.dir=$WORK/hydra/extract" "${EXTRACT[@]}"
run "$ACCELERATE" launch "${LAUNCH[@]}" -m eyas.train "${TARGET[@]}" train=gpu \
  "train.data.store_dir=$WORK/store" "train.output_dir=$WORK/train" "hydra.run.dir=$WORK/hydra/train" "${TRAIN[@]}"
run "$EYAS" export "export.checkpoint=$WORK/train/best" "export.out_dir=$WORK/export" export.overwrite=true \
  "hydra.run.dir=$WORK/hydra/export"
run "$EYAS" eval eval=gpu "eval.export_dir=$WORK/export" "work_dir=$WORK" "hydra.run.dir=$WORK/hydra/eval" "${EVAL[@]}"
finish "$WORK/export (report under $WORK/eval)"
