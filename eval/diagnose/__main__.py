"""x"""

from __future__ import annotations

import logging
import shlex
import sys

import torch

from eyas.eval.diagnose.config import CONF_DIR, DiagnoseConfig, DiagnoseError
from eyas.eval.diagnose.report import print_summary, write_report
from eyas.eval.diagnose.run import diagnose
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.serving.drafters import DrafterLoadError


# -- entry point -------------------------------------------------------------------------------------------------
def load_config(args: list[str]) -> DiagnoseConfig:
    """Defaults ← ``conf/diagnose/<preset>.yaml`` (``preset=``, default ``default``) ← ``key=value`` overrides."""
    from omegaconf import OmegaConf

    preset = next((a.split("=", 1)[1] for a in args if a.startswith("preset=")), "default")
    rest = [a for a in args if not a.startswith("preset=")]
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise DiagnoseError(f"arguments must be key=value, got {bad}")
    merged = OmegaConf.structured(DiagnoseConfig)
    path = CONF_DIR / f"{preset}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise DiagnoseError(f"no preset {preset!r} in {CONF_DIR} (known: {known})")
    merged = OmegaConf.merge(merged, OmegaConf.load(path), OmegaConf.from_dotlist(rest))
    return OmegaConf.to_object(merged)


def main(argv: list[str] | None = None) -> int:
    """``python -m eyas.eval.diagnose [measure|plan] key=value ...`` (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "plan":
        from eyas.eval.plan import main as plan_main

        return plan_main(args[1:])
    if args and args[0] == "measure":
        args = args[1:]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.split("\n\n")[1])
        print("measure fields: " + ", ".join(DiagnoseConfig.__dataclass_fields__))
        print("plan fields: see python -m eyas.eval.plan --help")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # omegaconf names the bad key or value
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    from eyas.serving.target import load_target

    try:
        target = load_target(cfg.target)
        result = diagnose(target, cfg)
    except (DiagnoseError, DrafterLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m eyas.eval.diagnose " + " ".join(shlex.quote(a) for a in args)
    path = write_report(result, cfg.out_dir, command)
    print_summary(result, path)
    return 1 if result.flagged else 0


if __name__ == "__main__":
    raise SystemExit(main())
