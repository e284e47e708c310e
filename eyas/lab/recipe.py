"""The drafter recipe study: ``python -m eyas.lab.recipe`` (``eyas recipe``; Hydra, ``conf/recipe.yaml``).

Trains several drafter variants on ONE feature store at one token budget and reports, per variant and seed, at
every chain length of ``recipe.chain_lengths``: held-out τ through the bundled loop (chain K, greedy) with its 95%
interval over prompts, the paired Δτ against the baseline variant (the first one run) and τ against prompt
lookup's on the same prompts; τ_sim (the trainer's held-out simulated chain τ) and training tokens/s. The table is
printed and written (Markdown and JSON, :mod:`eyas.lab.recipe_table`) under ``<work_dir>/recipe/<hash>/``.

Design decisions:
- Every stage is the pipeline's own (``stage_prepare``, ``stage_extract``, ``stage_train``, ``stage_export``,
  ``stage_eval``), so variants share the one store and a rerun reuses every finished training; a variant's
  evaluations are kept with each prompt's counts (``<variant>.seed<seed>.json``) and reused for the same weights,
  so a rerun recomputes the table without training or evaluating again (``recipe.reevaluate=true`` evaluates).
- A variant is a name plus overrides of the ``drafter`` and ``train`` groups (merged over the composed config);
  the budget is the base ``train`` settings', so every variant sees the same tokens unless it overrides the
  steps (say so in its name). The table prints the base's steps and each variant's tokens.
- Choose on one split, report on another: the prompts are out-of-distribution reasoning from the source's
  ``report`` half by default; a choice (the best combination) is made on ``recipe.prompts.half=calib`` and
  reported on the ``report`` half. The directory's hash is taken over the store, the prompts and the evaluation
  settings, not the variants, so runs of other variants over the same prompts share their results.
- Evaluation runs the exported checkpoint with the ``eagle3-chain`` method only, no step-time profile: τ and
  acceptance do not depend on the machine, the training tokens/s does (it is this machine's, under its load).
  Prompt lookup runs once per K, on the same prompts and numerics (it has no weights to vary); every comparison
  checks the prompts' fingerprints.
"""

from __future__ import annotations

import dataclasses
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
from eyas.eval.acceptance import MethodSpec, PromptSetSpec, run_acceptance
from eyas.eval.stage import EvalStageConfig
from eyas.lab.recipe_table import LOOKUP, ChainEval, VariantResult, format_table, table_json, table_rows
from eyas.pipeline import PipelineJob, pipeline_command
from eyas.serving.models.target import Target
from eyas.train.config import DraftModelConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Variant:
    """One recipe to train: overrides of the ``drafter`` and ``train`` groups."""

    name: str
    drafter: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    history: bool = False
    """A variant of an earlier study (BENCH.md), kept so that its command lines still run it: it runs only when
    ``recipe.only`` names it."""


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
    chain_lengths: list[int] = field(default_factory=lambda: [6, 3])
    """K of the chain evaluations, one evaluation (and one column) each; the shorter stands in for the
    recommended K (the study runs no step profile)."""
    only: list[str] | None = None
    """Run only these variants (by name); None runs every variant not marked ``history``."""
    baseline: str | None = None
    """The variant every Δτ is paired against (run with any ``only``); None: the first variant run."""
    store_dir: str | None = None
    """Train every variant on this existing feature store (skips prepare and extract); None: the pipeline's
    store for the composed ``prepare``/``extract`` settings (made or reused)."""
    training_text: str | None = None
    """The records the store was made from, every prompt checked against them (``eval.training_text``); None: the
    prepared ``train/conversations.jsonl`` when the study prepares the store, else not checked (the report says
    so)."""
    eval_dtype: str = "target"
    """``eval.dtype`` of the held-out evaluation (``target``: the loaded target's, bf16 on this CPU)."""
    reevaluate: bool = False
    """Evaluate every variant (and prompt lookup) again instead of reusing the results kept for the same weights
    and prompts."""

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
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"recipe.baseline: unknown variant {self.baseline!r} (known: {names})")
        if not self.chain_lengths or any(k < 1 for k in self.chain_lengths):
            raise ValueError(f"recipe.chain_lengths must list chain lengths >= 1, got {self.chain_lengths}")
        if len(set(self.chain_lengths)) != len(self.chain_lengths):
            raise ValueError(f"recipe.chain_lengths: {self.chain_lengths} repeats a chain length")
        if not self.selected():
            raise ValueError(
                "recipe.variants: every variant is a history one; name those to run in recipe.only"
            )

    def selected(self) -> list[Variant]:
        """The variants to run, in the config's order: ``only``'s, else every one not marked ``history``; the
        baseline first when ``baseline`` names one not among them."""
        chosen = [v for v in self.variants if (v.name in self.only if self.only else not v.history)]
        if self.baseline is not None and all(v.name != self.baseline for v in chosen):
            chosen.insert(0, next(v for v in self.variants if v.name == self.baseline))
        return chosen

    def baseline_name(self) -> str:
        return self.baseline or self.selected()[0].name


@dataclass
class RecipeJob(PipelineJob):
    """The pipeline's job (its data, and the base of every variant) and the study."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)


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


def eval_config(job: RecipeJob, chain_length: int, training_text: str | None) -> EvalStageConfig:
    """The held-out evaluation at chain length ``chain_length``: the EAGLE-3 chain on ``recipe.prompts``, no
    profile and no calibration split (nothing is chosen from it)."""
    rc = job.recipe
    return build_config(
        EvalStageConfig,
        {
            "prompt_sets": [asdict(rc.prompts)],
            "chain_length": chain_length,
            "methods": ["eagle3-chain"],
            "profile": None,
            "calibration_prompts": 0,
            "measure_best_k": False,
            "seed": job.eval.seed,
            "max_prompt_tokens": job.eval.max_prompt_tokens,
            "dtype": rc.eval_dtype,
            "training_text": training_text,
        },
        "recipe.eval",
    )


def measure_lookup(ecfg: EvalStageConfig, target: Target) -> ChainEval:
    """Prompt lookup at ``ecfg.chain_length`` on the prompts the variants' evaluations run: the same
    decontamination, prompts and numerics as :func:`eval.stage.run` (it needs no drafter)."""
    from eyas.eval.stage import check_decontaminated, split_prompts
    from eyas.serving.verify import SamplingConfig

    _, exclude = check_decontaminated(ecfg)
    verify = ecfg.numerics(target).verify
    split = split_prompts(ecfg, verify.tokenizer, exclude)
    method = MethodSpec(LOOKUP, "prompt-lookup", "chain", ecfg.chain_length)
    sampling = SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed)
    acc = run_acceptance(verify, None, split.reported, [method], sampling)
    return ChainEval.of(acc.results[0], ecfg.chain_length)


def train_speed(metrics: Path) -> tuple[int | None, float | None]:
    """(tokens, tokens/s) of a training run from its ``metrics.jsonl``: every logged training window's tokens
    over the seconds its steps took (data wait and compute; held-out evaluations and checkpoints excluded), so a
    reused training reports what it measured when it ran. (None, None) without the file."""
    if not metrics.is_file():
        return None, None
    tokens, seconds = 0, 0.0
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if rec.get("kind") == "train":
            tokens += int(rec.get("tokens", 0))
            seconds += float(rec.get("data_wait_s", 0.0)) + float(rec.get("compute_s", 0.0))
    return (tokens, round(tokens / seconds, 1)) if seconds > 0 else (tokens or None, None)


def _prior(d: dict[str, Any] | None, path: Path) -> VariantResult | None:
    try:
        return VariantResult.from_dict(d) if d else None
    except (TypeError, KeyError) as e:  # written by another version of the study
        log.warning("recipe: %s is not a result of this study's version (%s); measuring again", path, e)
        return None


def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as e:
        log.warning("recipe: %s %s is unreadable (%s); measuring again", what, path, e)
        return None


@dataclass
class Study:
    """What every variant's run shares."""

    job: RecipeJob
    target: Target
    store_dir: Path
    evals: dict[int, EvalStageConfig]
    """Chain length -> its evaluation."""
    out: Path
    command: str


def run_variant(
    study: Study, v: Variant, seed: int, dcfg: DraftModelConfig, tcfg: TrainConfig
) -> VariantResult:
    """Train (or reuse the training of) one variant and evaluate its export at every chain length (or reuse the
    evaluations kept for the same weights); the result is written to ``<out>/<variant>.seed<seed>.json``."""
    from eyas.pipeline import stage_eval, stage_export, stage_train

    work_dir = Path(study.job.work_dir)
    train_res, rec = stage_train(study.store_dir, dcfg, tcfg, study.target, work_dir, study.job.target)
    export_dir, _ = stage_export(train_res, study.target, work_dir)
    src = Path(train_res.best_dir or train_res.last_checkpoint)
    weights = f"{src.resolve()}@{train_res.steps}"
    path = study.out / f"{v.name}.seed{seed}.json"
    prior_d = None if study.job.recipe.reevaluate else _read_json(path, "result")
    prior = _prior(prior_d, path)
    kept = prior.evals if prior is not None and prior.weights == weights else []
    evals = []
    for k, ecfg in study.evals.items():
        done = next((e for e in kept if e.chain_length == k), None)
        if done is None:
            extra = {"variant": v.name, "seed": seed}
            acc, _, report, _ = stage_eval(export_dir, ecfg, study.target, work_dir, extra, study.command)
            done = ChainEval.of(acc.results[0], k, str(report))
        evals.append(done)
    evals += [e for e in kept if e.chain_length not in study.evals]  # other K's, kept for a later table
    tokens, speed = train_speed(Path(train_res.metrics_path or Path(rec.path) / "metrics.jsonl"))
    fe = train_res.final_eval or {}
    res = VariantResult(
        variant=v.name,
        seed=seed,
        steps=train_res.steps,
        train_tokens=tokens,
        train_tokens_per_s=speed,
        tau_sim=round(fe["tau_chain"], 4) if "tau_chain" in fe else None,
        tau_served_sim=round(fe["tau_served"], 4) if "tau_served" in fe else None,
        train_dir=rec.path,
        weights=weights,
        evals=evals,
    )
    path.write_text(json.dumps(res.to_dict(), indent=1))
    return res


def lookup_reference(study: Study) -> dict[int, ChainEval]:
    """Prompt lookup at every chain length on the study's prompts, kept in ``<out>/prompt-lookup.k<K>.json``."""
    out = {}
    for k, ecfg in study.evals.items():
        path = study.out / f"{LOOKUP}.k{k}.json"
        kept = None if study.job.recipe.reevaluate else _read_json(path, "prompt lookup result")
        if kept is not None:
            out[k] = ChainEval.from_dict(kept)
            continue
        print(f"\n== prompt lookup, K={k} (the reference) ==", flush=True)
        out[k] = measure_lookup(ecfg, study.target)
        path.write_text(json.dumps(asdict(out[k]), indent=1))
    return out


def study_header(
    job: RecipeJob, baseline: str, lookup: dict[int, ChainEval], results: list[VariantResult]
) -> str:
    """What the table was measured on, above it: the prompts, the chain lengths, the training budget and the
    tokens each variant stepped over, the baseline and how the intervals are made."""
    rc, t = job.recipe, job.train
    p = rc.prompts
    n = {len(e.per_prompt) for e in lookup.values()}
    ks = rc.chain_lengths
    half = f"its {p.half} half" if p.half else "the whole source"
    kind = "in distribution" if p.in_distribution else "out of distribution"
    longest, rest = max(ks), sorted((k for k in ks if k != max(ks)), reverse=True)
    chains = f"chain K = {longest}" + (
        f" and K = {', '.join(map(str, rest))} (standing in for the recommended K: the demo's on this CPU is 2-3, "
        "and the study runs no step profile)"
        if rest
        else ""
    )
    budget = f"max_steps {t.max_steps}" + (f", epochs {t.epochs}" if t.epochs is not None else "")
    loader = t.data.loader
    counts = sorted({r.train_tokens for r in results if r.train_tokens is not None})
    tokens = (
        f"every variant stepped over {counts[0]:,} tokens"
        if len(counts) == 1
        else f"the variants stepped over {', '.join(f'{c:,}' for c in counts)} tokens (see the table)"
        if counts
        else "tokens not recorded"
    )
    return "\n".join(
        [
            f"Prompts: `{p.name}` ({kind}; source `{p.source}`, {half}, {'/'.join(map(str, sorted(n))) or '?'} "
            f"prompts of n = {p.n}, seed {job.eval.seed}, {p.max_new_tokens} new tokens), greedy, {chains}, "
            f"through the bundled loop in `eval.dtype={rc.eval_dtype}`.",
            f"Training: the base train config's {budget}, {loader.get('batch_rows')} × {loader.get('max_tokens')} "
            f"tokens per batch ({loader.get('packing')}); {tokens}; training tokens/s over the training steps' "
            "seconds (held-out evaluations and checkpoints excluded), this machine's under its load; τ_sim: the "
            f"trainer's held-out simulated chain τ at K = {t.eval_chain_length} (its rows, not these prompts).",
            f"Baseline: `{baseline}`; every Δτ is paired with it on the same prompts (seed by seed), the relative "
            "change in % beside it; prompt lookup ran at each K on the same prompts and numerics (last row). 95% "
            "intervals: bootstrap over prompts (eval/intervals.py), paired for differences and ratios.",
        ]
    )


def run_recipe(job: RecipeJob, command: str = "python -m eyas.lab.recipe") -> list[VariantResult]:
    """Prepare and extract once, then train, export and evaluate every variant (see the module docstring)."""
    from eyas.pipeline import eval_settings, stage_extract, stage_prepare
    from eyas.serving.models.target import load_target

    os.environ.setdefault("WANDB_SILENT", "true")
    rc = job.recipe
    work_dir = Path(job.work_dir)
    if job.threads:
        torch.set_num_threads(job.threads)
    # every run's configs first: a bad override stops the study here, not after hours of prepare and extract
    runs = [
        (v, seed, *variant_configs(v, job.drafter, job.train, seed))
        for v in rc.selected()
        for seed in rc.seeds
    ]
    target = load_target(job.target)
    training_text = rc.training_text
    if rc.store_dir:
        store_dir = Path(rc.store_dir)
    else:
        prep, _ = stage_prepare(job.prepare, target, job.target)
        store_dir, _ = stage_extract(prep, job.extract.settings(), target, work_dir)
        training_text = training_text or eval_settings(job.eval, prep).training_text
    evals = {k: eval_config(job, k, training_text) for k in rc.chain_lengths}
    # the results of every variant and K over the same store, prompts and evaluation settings live together
    key = {**asdict(evals[rc.chain_lengths[0]]), "chain_length": None}
    out = (
        work_dir
        / "recipe"
        / json_hash({"store": str(store_dir), "eval": key, "target": target.info.to_dict()})
    )
    out.mkdir(parents=True, exist_ok=True)
    study = Study(job, target, store_dir, evals, out, command)
    lookup = lookup_reference(study)
    results = []
    for v, seed, dcfg, tcfg in runs:
        t0 = time.perf_counter()
        print(f"\n== recipe variant {v.name} (seed {seed}) ==", flush=True)
        results.append(run_variant(study, v, seed, dcfg, tcfg))
        print(f"recipe variant {v.name} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    write_table(study, results, lookup)
    return results


def write_table(study: Study, results: list[VariantResult], lookup: dict[int, ChainEval]) -> str:
    """Print the table and write it under the study's directory (``recipe.md``, ``recipe.json``)."""
    rc = study.job.recipe
    baseline = rc.baseline_name()
    rows = table_rows(results, lookup, baseline, rc.chain_lengths)
    table = (
        study_header(study.job, baseline, lookup, results)
        + "\n\n"
        + format_table(rows, lookup, baseline, rc.chain_lengths)
    )
    (study.out / "recipe.md").write_text(f"`{study.command}`\n\n{table}\n")
    data = {
        "command": study.command,
        "store": str(study.store_dir),
        "prompts": asdict(rc.prompts),
        "chain_lengths": rc.chain_lengths,
        "baseline": baseline,
        "train": {"max_steps": study.job.train.max_steps, "epochs": study.job.train.epochs},
        "table": table_json(rows),
        "variants": [r.to_dict() for r in results],
        "lookup": {str(k): asdict(e) for k, e in lookup.items()},
    }
    (study.out / "recipe.json").write_text(json.dumps(data, indent=1))
    print("\n" + table)
    print(f"\nrecipe: {study.out / 'recipe.md'}")
    return table


def recipe(job: RecipeJob) -> None:
    run_recipe(job, command_line(COMMAND))


COMMAND = dataclasses.replace(
    pipeline_command("recipe", "eyas.lab.recipe", "recipe", RecipeJob, recipe),
    renamed={"recipe.chain_length": "recipe.chain_lengths"},
)
main = COMMAND.main


if __name__ == "__main__":
    main()
