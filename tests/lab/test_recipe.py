"""The recipe study (eyas/lab/recipe.py, conf/recipe.yaml): its prompts, variants and table, without training."""

from __future__ import annotations

from dataclasses import fields

import pytest

from eyas.command import dry_run
from eyas.eval.acceptance import PromptSetSpec


def _job(overrides: list[str]):
    from eyas.lab.recipe import COMMAND

    return dry_run(COMMAND, overrides)


def test_the_study_reports_out_of_distribution_reasoning_by_default_from_its_report_half():
    rc = _job([]).recipe
    p = rc.prompts
    assert (p.source, p.half, p.in_distribution) == ("ood_reasoning", "report", False)
    assert p.n == 24  # two prompts of each of the 12 tasks; the report half holds 300


def test_every_prompt_set_field_is_settable_from_the_command_line():
    job = _job(["recipe.prompts.half=calib", "recipe.prompts.n=12", "recipe.prompts.max_new_tokens=64"])
    assert (job.recipe.prompts.half, job.recipe.prompts.n, job.recipe.prompts.max_new_tokens) == (
        "calib",
        12,
        64,
    )
    job = _job(
        [
            "recipe.prompts.in_distribution=true",
            "recipe.prompts.name=reasoning_in_dist",
            "recipe.prompts.source=reasoning_gym",
            "recipe.prompts.label=in distribution",
            "recipe.prompts.half=null",
        ]
    )
    p = job.recipe.prompts
    assert (p.in_distribution, p.name, p.source, p.label, p.half) == (
        True,
        "reasoning_in_dist",
        "reasoning_gym",
        "in distribution",
        None,
    )
    # a key of PromptSetSpec the config lacked would be refused by Hydra ("not in struct"): every one is there
    from hydra import compose, initialize_config_module

    with initialize_config_module("eyas.conf", version_base="1.3"):
        cfg = compose("recipe")
    assert set(cfg.recipe.prompts) == {f.name for f in fields(PromptSetSpec)}
    with pytest.raises(ValueError, match="_in_dist"):  # the set's name says what it is
        _job(["recipe.prompts.in_distribution=true"])
