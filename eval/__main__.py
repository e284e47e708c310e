"""``python -m eyas.eval eval.checkpoint=<exported drafter dir> [target=...] [eval.prompt_sets=...]``: the acceptance
evaluation of an exported EAGLE-3 checkpoint (the SGLang/vLLM directory a user ships): τ per prompt set and draft
position, tokens/s against prompt lookup and plain decoding, step time against context, report with plots
(:func:`eval.stage.run`)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from eyas.common import exit_on_config_error


@hydra.main(config_path="pkg://eyas.conf", config_name="config", version_base="1.3")
@exit_on_config_error
def main(cfg: DictConfig) -> None:
    from eyas.common import load_job
    from eyas.eval.stage import EvalJob, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = run(load_job(cfg, EvalJob), command="python -m eyas.eval " + " ".join(sys.argv[1:]))
    print(f"report: {res.report}")


if __name__ == "__main__":
    main()
