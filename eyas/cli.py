"""``eyas <command> [hydra overrides]``: one console script over the stage entry points.

Each command calls the Hydra app of the module a user could also run with ``python -m`` (so multi-node
training stays the ordinary ``accelerate launch ... -m eyas.train ...``); ``eyas <command> --help`` is that
app's help (its config groups and the composed config). Hydra reads the overrides from ``sys.argv``, so the
command name is taken off it before the app runs.
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
    module = COMMANDS[name][0]
    app = importlib.import_module(module)
    if not hasattr(app, "main"):  # a package: its app is __main__
        app = importlib.import_module(module + ".__main__")
    if any(a in ("-h", "--help") for a in rest):
        print(f"eyas {name}: {COMMANDS[name][1]}\n")
    sys.argv = [f"eyas {name}", *rest]
    app.main()


if __name__ == "__main__":
    main()
