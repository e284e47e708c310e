"""``python -m eyas.train target=smollm2 train=demo ...`` — train an EAGLE-3 drafter (Hydra entry point).

Single process: ``python -m eyas.train train.data.store_dir=runs/store``.
Data parallel / DeepSpeed: ``accelerate launch --config_file conf/accelerate/<ddp|zero2|zero3>.yaml -m eyas.train ...``.
Multi-node (every node runs the same command; ``train.output_dir`` on a filesystem all nodes see)::

    accelerate launch --config_file conf/accelerate/zero2.yaml --num_machines N --machine_rank R \\
        --main_process_ip HOST0 --main_process_port 29500 --num_processes $((N * GPUS_PER_NODE)) \\
        -m eyas.train target=hf target.path=Qwen/Qwen3-8B train.data.store_dir=/shared/store \\
        train.output_dir=/shared/runs/qwen3-8b

The DictConfig becomes a typed :class:`~train.config.TrainJob` here; only dataclasses go inward
(:func:`train.setup.run`).
"""

from __future__ import annotations

import logging
import sys

from omegaconf import DictConfig

from eyas.command import Command
from eyas.common import load_job
from eyas.train.config import TrainJob

log = logging.getLogger(__name__)


def train_job(cfg: DictConfig) -> TrainJob:
    """The typed config of ``python -m eyas.train`` (groups ``target``, ``drafter``, ``train``)."""
    return load_job(cfg, TrainJob)


def train(job: TrainJob) -> int | None:
    from eyas.train.guards import TrainingInterrupted
    from eyas.train.setup import run

    try:
        result = run(job)
    except TrainingInterrupted as e:  # a checkpoint is saved: one line, and the shell's status for the signal
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    log.info(
        "training done: %d steps, best %s=%s at step %s, %s",
        result.steps,
        job.train.best_metric,
        result.best_value,
        result.best_step,
        result.output_dir,
    )
    return None


COMMAND = Command("train", "eyas.train", "config", TrainJob, train)
main = COMMAND.main

if __name__ == "__main__":
    main()
