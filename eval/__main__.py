"""``python -m eyas.eval eval.export_dir=<exported drafter dir> [target=...] [eval.prompt_sets=...]``: the acceptance
evaluation of an exported EAGLE-3 checkpoint (the SGLang/vLLM directory a user ships): τ per prompt set and draft
position, tokens/s against prompt lookup and plain decoding, step time against context, report with plots
(:func:`eval.stage.run`)."""

from __future__ import annotations

from eyas.command import Command, command_line
from eyas.eval.stage import EvalJob


def evaluate(job: EvalJob) -> None:
    from eyas.eval.stage import run

    res = run(job, command=command_line(COMMAND))
    print(f"report: {res.report}")


COMMAND = Command(
    "eval", "eyas.eval", "config", EvalJob, evaluate, renamed={"eval.checkpoint": "eval.export_dir"}
)
main = COMMAND.main

if __name__ == "__main__":
    main()
