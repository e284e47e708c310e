"""``eyas diagnose [diagnose=<preset>] [diagnose.export_dir=<export>] diagnose.key=value ...`` (``python -m
eyas.eval.diagnose``): the Hydra app of :func:`eval.diagnose.run.run`.

The config is ``conf/diagnose.yaml``: the ``target`` group and :class:`~eval.diagnose.config.DiagnoseConfig` under
``diagnose``, every field at its default, with the preset ``conf/diagnose/<preset>.yaml`` (``default``, ``smoke``,
``gpu``) merged over them; every field can be overridden (``diagnose.chain_length=6
diagnose.contexts=[128,4096] diagnose.export_dir=runs/export``). The exit status is 1 when a cell is flagged, 2
for settings or inputs diagnose cannot work with.
"""

from __future__ import annotations

from dataclasses import fields

from eyas.command import Command, command_line
from eyas.eval.diagnose.config import DiagnoseConfig, DiagnoseJob


def diagnose(job: DiagnoseJob) -> int:
    from eyas.eval.diagnose.run import run

    return run(job, command_line(COMMAND))


# diagnose's settings were top-level keys, and its drafter `drafter=` (the trainer's config group of that name)
OLD_KEYS = {f.name: f"diagnose.{f.name}" for f in fields(DiagnoseConfig)} | {"drafter": "diagnose.export_dir"}
COMMAND = Command("diagnose", "eyas.eval.diagnose", "diagnose", DiagnoseJob, diagnose, renamed=OLD_KEYS)
main = COMMAND.main

if __name__ == "__main__":
    main()
