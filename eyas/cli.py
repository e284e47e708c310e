"""``eyas <command> [hydra overrides]``: one console script over the stage entry points.

Each command is the :class:`eyas.command.Command` of the module a user could also run with ``python -m`` (so
multi-node training stays the ordinary ``accelerate launch ... -m eyas.train ...``): ``eyas <command>`` and
``python -m <module>`` call the same app, and ``eyas <command> --help`` is its help (its groups and the keys it
reads). Hydra reads the overrides from ``sys.argv``, so the command name is taken off it before the app runs.
This module imports no command until one is asked for (``eyas --help`` lists them all at once).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("eyas.pipeline", "the whole pipeline on the embedded default target; prints the result table"),
    "bench": ("eyas.lab.bench", "the benchmark: larger data budget, BENCH.md with the headline numbers"),
    "recipe": (
        "eyas.lab.recipe",
        "the drafter recipe study: several recipes on one store, held-out tau per recipe",
    ),
    "prepare": (
        "eyas.data.prepare",
        "corpus mixture -> (regeneration) -> chat-formatted samples with loss masks",
    ),
    "extract": ("eyas.data.extract", "run the target over samples and write the feature store"),
    "train": (
        "eyas.train",
        "train an EAGLE-3 drafter (accelerate launch ... -m eyas.train for several processes)",
    ),
    "export": (
        "eyas.serving.export",
        "write a trainer checkpoint in the SGLang/vLLM format, with a round-trip check",
    ),
    "eval": ("eyas.eval", "acceptance evaluation of an exported drafter"),
    "diagnose": (
        "eyas.eval.diagnose",
        "explain tokens/s = tau / step time; recommend K (`diagnose=smoke` for a one-minute check)",
    ),
    "context": (
        "eyas.eval.context_sweep",
        "τ, step time and tokens/s against context length (prompts after long real prefixes)",
    ),
    "plan": ("eyas.eval.plan", "KV-cache and context-length arithmetic from a model config"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: eyas <command> [key=value ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name == "diagnose" and rest[:1] == ["plan"]:  # `eyas diagnose plan ...` is `eyas plan ...`
        name, rest = "plan", rest[1:]
    if name not in COMMANDS:
        raise SystemExit(f"eyas: unknown command {name!r}\n\n{usage()}")
    sys.argv = [f"eyas {name}", *rest]
    command(name).main()


def command(name: str):
    """The :class:`eyas.command.Command` of ``eyas <name>`` (its module imported now)."""
    module = importlib.import_module(COMMANDS[name][0])
    if not hasattr(module, "COMMAND"):  # a package: its command is in __main__
        module = importlib.import_module(COMMANDS[name][0] + ".__main__")
    return module.COMMAND


if __name__ == "__main__":
    main()
