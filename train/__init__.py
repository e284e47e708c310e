"""Drafter training: EAGLE-3 distillation from the target's distribution with training-time test.

Entry points: ``python -m eyas.train`` (Hydra; :mod:`train.__main__`), :func:`train.setup.run` (target + data + vocab +
drafter, then fit) and :func:`train.trainer.fit` (the loop itself, on any :class:`train.sources.BatchSource`).
Modules: ``config`` (typed configs), ``vocab`` (draft vocabulary), ``losses`` (teacher, TTT loss, acceptance
counts), ``metrics`` (simulated acceptance, metrics JSONL, wandb), ``checkpoint`` (exact resume), ``sources``
(the data interface), ``synthetic`` (batches made in memory from a target), ``setup``, ``loop``.
"""
