"""The drafter recipe study: ``python -m eyas.lab.recipe`` (``eyas recipe``; Hydra, ``conf/recipe.yaml``).

Trains several drafter variants on ONE feature store at one token budget and reports, per variant and seed:
held-out τ through the bundled loop (chain K, greedy) on hard-reasoning prompts the training data never saw,
first-position acceptance, τ_sim (the trainer's held-out simulated chain τ), and training tokens/s. The table
is printed and written (Markdown and JSON) under ``<work_dir>/recipe/<hash>/``.

Design decisions:
- Every stage is the pipeline's own (``stage_prepare``, ``stage_extract``, ``stage_train``, ``stage_export``,
  ``stage_eval``), so variants share the one store and a rerun reuses every finished training and evaluation.
- A variant is a name plus overrides of the ``drafter`` and ``train`` groups (merged over the composed config);
  the budget is the base ``train`` settings', so every variant sees the same tokens unless it overrides the
  steps (say so in its name).
- Evaluation runs the exported checkpoint with the ``eagle3-chain`` method only, no step-time profile: τ and
  acceptance do not depend on the machine, the training tokens/s does (it is this machine's, under its load).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.command import command_line
from eyas.common import build_config, json_hash
from eyas.eval.acceptance import PromptSetSpec
from eyas.pipeline import PipelineJob, pipeline_command
from eyas.train.config import DraftModelConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Variant:
    """One recipe to train: overrides of the ``drafter`` and ``train`` groups."""

    name: str
    drafter: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecipeConfig:
    """The study (``recipe`` in ``conf/recipe.yaml``)."""

    variants: list[Variant] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    """Training seeds; each variant is trained once per seed (two tell a difference from noise)."""
    prompts: PromptSetSpec = field(
        default_factory=lambda: PromptSetSpec(
            name="ood_reasoning",
            source="ood_reasoning",
            n=24,
            label="hard reasoning (out of distribution)",
            max_new_tokens=128,
            half="report",
        )
    )
    """Held-out evaluation prompts: out-of-distribution reasoning from the source's ``report`` half by default
    (choose on ``half: calib``, report on ``half: report``); 24 of its 300 prompts, two per task."""
    chain_length: int = 6
    only: list[str] | None = None
    """Run only these variants (by name); None runs all."""
    store_dir: str | None = None
    """Train every variant on this existing feature store (skips prepare and extract); None: the pipeline's
    store for the composed ``prepare``/``extract`` settings (made or reused)."""
    eval_dtype: str = "target"
    """``eval.dtype`` of the held-out evaluation (``target``: the loaded target's, bf16 on this CPU)."""

    def __post_init__(self) -> None:
        self.variants = [
            build_config(Variant, v, f"recipe.variants[{i}]") for i, v in enumerate(self.variants)
        ]
        if isinstance(self.prompts, dict):
            self.prompts = build_config(PromptSetSpec, self.prompts, "recipe.prompts")
        if not self.variants:
            raise ValueError("recipe.variants is empty")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"recipe.variants: duplicate names in {names}")
        unknown = sorted(set(self.only or []) - set(names))
        if unknown:
            raise ValueError(f"recipe.only: unknown variants {unknown} (known: {names})")


@dataclass
class RecipeJob(PipelineJob):
    """The pipeline's job (its data, and the base of every variant) and the study."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)


@dataclass
class VariantResult:
    variant: str
    seed: int
    steps: int
    train_tokens: int | None
    train_tokens_per_s: float | None
    tau_sim: float | None
    tau: float
    first_acceptance: float
    acceptance_by_position: list[float]
    prompts: int
    train_dir: str
    tau_served_sim: float | None = None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def variant_configs(
    v: Variant, drafter: DraftModelConfig, train: TrainConfig, seed: int
) -> tuple[DraftModelConfig, TrainConfig]:
    """The drafter and train configs of ``v`` over the base ones, with the training seed ``seed``."""
    d = build_config(DraftModelConfig, _merge(asdict(drafter), v.drafter), f"recipe.{v.name}.drafter")
    # the seed moves both the drafter's random init and the data order (the loader's shuffle has its own seed):
    # a drafter started from the target has no random weights, so the order is its only source of variation
    over = _merge(v.train, {"seed": seed, "data": {"loader": {"seed": seed}}})
    t = build_config(TrainConfig, _merge(asdict(train), over), f"recipe.{v.name}.train")
    return d, t


def format_table(results: list[VariantResult], chain_length: int) -> str:
    head = (
        f"| variant | seed | steps | train tokens | train tok/s | τ_sim | τ_sim served | held-out τ (chain K={chain_length}) "
        "| 1st-position acceptance |\n|---|---|---|---|---|---|---|---|---|\n"
    )

    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    return head + "\n".join(
        f"| {r.variant} | {r.seed} | {r.steps} | {f(r.train_tokens, ',')} | {f(r.train_tokens_per_s, '.0f')} "
        f"| {f(r.tau_sim, '.3f')} | {f(r.tau_served_sim, '.3f')} | {r.tau:.3f} | {r.first_acceptance:.3f} |"
        for r in results
    )


def run_recipe(job: RecipeJob, command: str = "python -m eyas.lab.recipe") -> list[VariantResult]:
    """Prepare and extract once, then train, export and evaluate every variant (see the module docstring)."""
    from eyas.eval.stage import EvalStageConfig
    from eyas.pipeline import stage_eval, stage_export, stage_extract, stage_prepare, stage_train
    from eyas.serving.models.target import load_target

    os.environ.setdefault("WANDB_SILENT", "true")
    rc = job.recipe
    work_dir = Path(job.work_dir)
    if job.threads:
        torch.set_num_threads(job.threads)
    # every run's configs first: a bad override stops the study here, not after hours of prepare and extract
    runs = [
        (v, seed, *variant_configs(v, job.drafter, job.train, seed))
        for v in rc.variants
        if not rc.only or v.name in rc.only
        for seed in rc.seeds
    ]
    target = load_target(job.target)
    if rc.store_dir:
        store_dir = Path(rc.store_dir)
    else:
        prep, _ = stage_prepare(job.prepare, target, job.target)
        store_dir, _ = stage_extract(prep, job.extract.settings(), target, work_dir)
    ecfg = build_config(
        EvalStageConfig,
        {
            "prompt_sets": [asdict(rc.prompts)],
            "chain_length": rc.chain_length,
            "methods": ["eagle3-chain"],
            "profile": None,
            "seed": job.eval.seed,
            "max_prompt_tokens": job.eval.max_prompt_tokens,
            "dtype": rc.eval_dtype,
        },
        "recipe.eval",
    )
    results: list[VariantResult] = []
    out = (
        work_dir / "recipe" / json_hash({"store": str(store_dir), "recipe": asdict(rc), "eval": asdict(ecfg)})
    )
    out.mkdir(parents=True, exist_ok=True)
    for v, seed, dcfg, tcfg in runs:
        t0 = time.perf_counter()
        print(f"\n== recipe variant {v.name} (seed {seed}) ==", flush=True)
        train_res, rec = stage_train(store_dir, dcfg, tcfg, target, work_dir, job.target)
        export_dir, _ = stage_export(train_res, target, work_dir)
        acc, _, _, _ = stage_eval(export_dir, ecfg, target, work_dir, {"variant": v.name}, command)
        r = acc.results[0]
        fe = train_res.final_eval or {}
        results.append(
            VariantResult(
                variant=v.name,
                seed=seed,
                steps=train_res.steps,
                train_tokens=train_res.tokens if train_res.steps_this_run else None,
                train_tokens_per_s=round(train_res.tokens_per_s, 1) if train_res.steps_this_run else None,
                tau_sim=round(fe["tau_chain"], 4) if "tau_chain" in fe else None,
                tau=round(r.tau, 4),
                tau_served_sim=round(fe["tau_served"], 4) if "tau_served" in fe else None,
                first_acceptance=round(r.acceptance_by_position[0], 4) if r.acceptance_by_position else 0.0,
                acceptance_by_position=[round(a, 4) for a in r.acceptance_by_position],
                prompts=r.prompts,
                train_dir=rec.path,
            )
        )
        prior = out / f"{v.name}.seed{seed}.json"
        if results[-1].train_tokens is None and prior.exists():  # reused training: keep the measured speed
            old = json.loads(prior.read_text())
            results[-1].train_tokens = old.get("train_tokens")
            results[-1].train_tokens_per_s = old.get("train_tokens_per_s")
        prior.write_text(json.dumps(asdict(results[-1]), indent=1))
        print(f"recipe variant {v.name} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    table = format_table(results, rc.chain_length)
    (out / "recipe.md").write_text(f"`{command}`\n\n{table}\n")
    (out / "recipe.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print("\n" + table)
    print(f"\nrecipe: {out / 'recipe.md'}")
    return results


def recipe(job: RecipeJob) -> None:
    run_recipe(job, command_line(COMMAND))


COMMAND = pipeline_command("recipe", "eyas.lab.recipe", "recipe", RecipeJob, recipe)
main = COMMAND.main


if __name__ == "__main__":
    main()
