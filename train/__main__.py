"""``python -m eyas.train target=smollm2 train=demo ...`` — train an EAGLE-3 drafter (Hydra entry point).

Single process: ``python -m eyas.train train.data.store_dir=runs/store``.
Data parallel / DeepSpeed: ``accelerate launch --config_file conf/accelerate/<ddp|zero2|zero3>.yaml -m eyas.train ...``.
Multi-node (every node runs the same command; ``train.output_dir`` on a filesystem all nodes see)::

    accelerate launch --config_file conf/accelerate/zero2.yaml --num_machines N --machine_rank R \\
        --main_process_ip HOST0 --main_process_port 29500 --num_processes $((N * GPUS_PER_NODE)) \\
        -m eyas.train target=hf target.path=Qwen/Qwen3-8B train.data.store_dir=/shared/store \\
        train.output_dir=/shared/runs/qwen3-8b

The DictConfig becomes typed dataclasses here; only dataclasses go inward (:func:`train.setup.run`).
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from eyas.serving.target import TargetConfig
from eyas.train.config import DraftModelConfig, TrainConfig, from_dict

log = logging.getLogger(__name__)


def configs(cfg: DictConfig) -> tuple[TargetConfig, DraftModelConfig, TrainConfig]:
    d = OmegaConf.to_container(cfg, resolve=True)
    if "train" not in d or "drafter" not in d:
        raise ValueError("the config has no `train`/`drafter` group: add them to conf/config.yaml's defaults")
    return (
        from_dict(TargetConfig, d["target"]),
        from_dict(DraftModelConfig, d["drafter"]),
        from_dict(TrainConfig, d["train"]),
    )


@hydra.main(config_path="pkg://eyas.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eyas.train.setup import run

    target_cfg, drafter_cfg, train_cfg = configs(cfg)
    result = run(target_cfg, drafter_cfg, train_cfg)
    log.info(
        "training done: %d steps, best %s=%s at step %s, %s",
        result.steps,
        train_cfg.best_metric,
        result.best_value,
        result.best_step,
        result.output_dir,
    )


if __name__ == "__main__":
    main()
