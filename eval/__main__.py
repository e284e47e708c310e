"""``python -m eyas.eval eval.checkpoint=<exported drafter dir> [target=...] [eval.prompt_sets=...]``: the acceptance
evaluation of an exported EAGLE-3 checkpoint (the SGLang/vLLM directory a user ships): τ per prompt set and draft
position, tokens/s against prompt lookup and plain decoding, step time against context, report with plots."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="pkg://eyas.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eyas.pipeline import EvalStageConfig, stage_eval
    from eyas.serving.target import TargetConfig, load_target

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    d = OmegaConf.to_container(cfg, resolve=True)
    ecfg = EvalStageConfig(**d["eval"])
    if not ecfg.checkpoint:
        raise SystemExit("give the exported drafter to evaluate: python -m eyas.eval eval.checkpoint=<dir>")
    if d.get("threads"):
        import torch

        torch.set_num_threads(int(d["threads"]))
    target = load_target(TargetConfig(**d["target"]))
    command = "python -m eyas.eval " + " ".join(sys.argv[1:])
    _, _, report, _ = stage_eval(Path(ecfg.checkpoint), ecfg, target, Path(d["work_dir"]), {}, command)
    print(f"report: {report}")


if __name__ == "__main__":
    main()
