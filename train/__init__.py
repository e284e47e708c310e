"""Drafter training: EAGLE-3 distillation from the target's distribution with training-time test.

Entry points: ``python -m eyas.train`` (Hydra; :mod:`train.__main__`), :func:`train.setup.run` (target + data + vocab +
drafter, then fit) and :class:`train.trainer.Trainer` (the loop itself, on any :class:`train.sources.BatchSource`;
``fit`` is its one-line entry). Modules: ``config`` (typed configs), ``vocab`` (draft vocabulary), ``losses``
(teacher, TTT loss, acceptance counts), ``metrics`` (simulated acceptance, metrics JSONL, wandb), ``checkpoint``
(exact resume), ``guards`` (one trainer per output directory, a checkpoint on SIGTERM / SIGINT), ``sources`` (the
data interface), ``synthetic`` (batches made in memory from a target), ``setup``, ``trainer``.
"""
