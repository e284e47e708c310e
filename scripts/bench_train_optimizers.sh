#!/usr/bin/env bash
# Drafter-training throughput, Muon (the default, `auto`) against AdamW, alternated: the issue-9 bar's
# configuration (`bench_train`'s own: 512-token rows, TTT 7, 8k draft vocabulary, bf16, 2 threads). Backs
# BENCH.md, "Drafter-training throughput": Muon 489.1, 498.8, 478.4, 473.9, 479.7 tokens/s (mean 484.0), AdamW
# 603.9, 587.5, 552.5, 581.0, 589.1 (582.8), five rounds on a fresh clone at 4ffe2ae right after its `make test`,
# AMD EPYC (2 cores), otherwise idle, 2026-12-06; ~1 min a run. The same command gave the table before it
# (ROUNDS=2 at c420c44: AdamW 503.3, 472.4; Muon 414.5, 384.3) and the Intel machine's one run (738 against 658).
#
# Reconstructed from the command BENCH.md and the session's closing note record (the session's own script was not
# committed); module path and keys are today's.
#
# Usage: scripts/bench_train_optimizers.sh     (ROUNDS=5, PY=<python>)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
ROUNDS=${ROUNDS:-5}

for round in $(seq "$ROUNDS"); do
  for optimizer in muon adamw; do
    echo "== round $round, $optimizer"
    "$PY" -m eyas.lab.bench_train 'bench_train.vocab=[8192]' 'bench_train.modes=[bf16]' bench_train.threads=2 \
      bench_train.optimizer=$optimizer
  done
done
