"""``python -m eyas.eval eval.export_dir=<exported drafter dir> [target=...] [eval.prompt_sets=...]``: the acceptance
evaluation of an exported EAGLE-3 checkpoint (the SGLang/vLLM directory a user ships) on the target it was trained
against (recorded in its ``eyas_export.json``; ``target=`` overrides it, and a target that does not fit the drafter
is refused): τ per prompt set and draft position, tokens/s against prompt lookup and plain decoding, step time
against context, report with plots (:func:`eval.stage.run`)."""

from __future__ import annotations

from dataclasses import replace

from eyas.command import Command, command_line, command_line_sets
from eyas.eval.stage import EvalJob


def evaluate(job: EvalJob) -> None:
    from eyas.eval.stage import run

    if not command_line_sets("target"):  # the drafter's own target, not the default one
        job = replace(job, target=None)
    res = run(job, command=command_line(COMMAND))
    print(f"report: {res.report}")


COMMAND = Command(
    "eval", "eyas.eval", "config", EvalJob, evaluate, renamed={"eval.checkpoint": "eval.export_dir"}
)
main = COMMAND.main

if __name__ == "__main__":
    main()
