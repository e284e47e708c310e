#!/usr/bin/env bash
# An EAGLE-3 drafter for DeepSeek-V3 (671B, MLA + MoE; Kimi-K2 is the same architecture) over several nodes of 8 GPUs:
#   1. regeneration (node 0): the corpus's prompts answered by the target through the servers at REGEN_URLS (your
#      deployment, e.g. `vllm serve deepseek-ai/DeepSeek-V3 --tensor-parallel-size 8` per node of 8 H200s), or, with
#      REGEN_URLS unset, one vLLM server eyas starts on this node with tensor parallel 8
#   2. extraction (node 0): aux states + top-32 through vLLM (tensor parallel 8) into a compact store on a filesystem
#      every node sees
#   3. training: NNODES nodes x 8 processes, plain data parallel (run this script on every node with its NODE_RANK;
#      steps 1, 2, 4 and 5 run on node 0 only, the other nodes wait for the store)
#   4. export, 5. evaluation inside vLLM (tensor parallel 8) or at EVAL_URL, the target taken from the checkpoint
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 WORK=/shared/runs/dsv3 bash examples/deepseek_v3.sh    # node 0
#   NNODES=4 NODE_RANK=1 MASTER_ADDR=node0 WORK=/shared/runs/dsv3 bash examples/deepseek_v3.sh    # node 1, ...
#   SMOKE=1 bash examples/deepseek_v3.sh      # the same commands and engines on the embedded target, CPU, tiny sizes
#   DRY_RUN=1 bash examples/deepseek_v3.sh    # print the commands only
#
# Training loads the target in every process (train/setup.py) for its embedding, LM head and the layer the drafter
# starts from: for a 671B target that needs a node's memory per process, which is not yet solved here (see the
# closing note of issue 38). Timing and τ of a GPU run: not measured yet.
source "$(dirname "$0")/common.sh"

MODEL=${MODEL:-deepseek-ai/DeepSeek-V3}
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
REGEN_URLS=${REGEN_URLS:-}     # comma-separated http://host:port of running servers of the target (data parallel)
EVAL_URL=${EVAL_URL:-}         # a running vLLM server of the target with the export as its drafter
if smoke; then
  WORK=${WORK:-runs/example-smoke/deepseek_v3}
  NNODES=1 GPUS_PER_NODE=1
  smoke_sizes   # TARGET, PREPARE, EXTRACT, TRAIN, EVAL: the embedded target at tiny sizes (common.sh)
  LAUNCH=(--config_file conf/accelerate/cpu_ddp.yaml)
else
  WORK=${WORK:-runs/deepseek_v3}
  TARGET=(target=hf "target.path=$MODEL")
  TP="['--tensor-parallel-size','$GPUS_PER_NODE']"
  # the sampling your deployment serves with (TEMPERATURE, TOP_P)
  PREPARE=(corpus=reasoning_mix "prepare.regen.temperature=${TEMPERATURE:-0.6}" "prepare.regen.top_p=${TOP_P:-0.95}"
           "prepare.regen.server.args=$TP")
  if [ -n "$REGEN_URLS" ]; then
    PREPARE+=("prepare.regen.server_url=[${REGEN_URLS}]")
  fi
  EXTRACT=("extract.server.args=$TP" extract.concurrency=32)
  LAUNCH=(--config_file conf/accelerate/ddp.yaml)
  TRAIN=(drafter.draft_vocab_size=32000)
  EVAL=("eval.server.args=$TP")
  if [ -n "$EVAL_URL" ]; then
    EVAL+=("eval.server_url=$EVAL_URL")
  fi
fi
LAUNCH+=(--num_machines "$NNODES" --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR"
         --main_process_port "$MASTER_PORT" --num_processes "$((NNODES * GPUS_PER_NODE))")

setup
if [ "$NODE_RANK" = 0 ]; then
  run "$EYAS" prepare "${TARGET[@]}" prepare=gpu "prepare.out_dir=$WORK/prepare" "hydra.run.dir=$WORK/hydra/prepare" \
    "${PREPARE[@]}"
  run "$EYAS" extract "${TARGET[@]}" extract=gpu "extract.samples=$WORK/prepare/train/samples.jsonl" \
    "extract.out_dir=$WORK/store" "hydra.run.dir=$WORK/hydra/extract" "${EXTRACT[@]}"
  [ "$DRY_RUN" = 1 ] || touch "$WORK/store.ready"
elif [ "$DRY_RUN" != 1 ]; then
  echo "node $NODE_RANK: waiting for node 0's store ($WORK/store.ready)"
  while [ ! -e "$WORK/store.ready" ]; do sleep 30; done
fi
run "$ACCELERATE" launch "${LAUNCH[@]}" -m eyas.train "${TARGET[@]}" train=gpu \
  "train.data.store_dir=$WORK/store" "train.output_dir=$WORK/train" "hydra.run.dir=$WORK/hydra/train-$NODE_RANK" \
  "${TRAIN[@]}"
if [ "$NODE_RANK" = 0 ]; then
  run "$EYAS" export "export.checkpoint=$WORK/train/best" "export.out_dir=$WORK/export" export.overwrite=true \
    "hydra.run.dir=$WORK/hydra/export"
  run "$EYAS" eval eval=gpu "eval.export_dir=$WORK/export" "work_dir=$WORK" "hydra.run.dir=$WORK/hydra/eval" \
    "${EVAL[@]}"
  finish "$WORK/export (report under $WORK/eval)"
fi
