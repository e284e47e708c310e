"""``python -m eyas.eval.diagnose [diagnose=<preset>] key=value ...``: the Hydra app of :func:`eval.diagnose.run.run`.

The primary config is :class:`~eval.diagnose.config.DiagnoseConfig`'s defaults (registered as ``eyas_diagnose``)
with the preset ``conf/diagnose/<preset>.yaml`` (``default``, ``smoke``, ``gpu``) merged over them; every field
can be overridden (``chain_length=6 contexts=[128,4096] drafter=runs/export``). The exit status is 1 when a
cell is flagged, 2 for settings or inputs diagnose cannot work with.
"""

from __future__ import annotations

import logging
import shlex
import sys
from dataclasses import asdict

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from eyas.common import build_config
from eyas.eval.diagnose.config import DiagnoseConfig

CONFIG_NAME = "eyas_diagnose"
ConfigStore.instance().store(
    name=CONFIG_NAME, node={"defaults": ["_self_", {"diagnose": "default"}], **asdict(DiagnoseConfig())}
)


def diagnose_config(cfg: DictConfig) -> DiagnoseConfig:
    """The typed config of ``python -m eyas.eval.diagnose`` (every key at the top level)."""
    return build_config(DiagnoseConfig, cfg)


@hydra.main(config_path="pkg://eyas.conf", config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eyas.eval.diagnose.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        code = run(diagnose_config(cfg), "python -m eyas.eval.diagnose " + shlex.join(sys.argv[1:]))
    except ValueError as e:  # DiagnoseError, DrafterLoadError, ConfigError: the message says what to change
        print(f"error: {e}", file=sys.stderr)
        code = 2
    raise SystemExit(code)


if __name__ == "__main__":
    main()
