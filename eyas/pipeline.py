"""The whole pipeline on one config: corpus → regeneration → feature store → training → export → evaluation.

``eyas demo`` = ``python -m eyas.pipeline`` (the README's main command; ``eyas bench`` runs it at the benchmark's
budget).

Design decisions:
- Each stage writes under ``work_dir/<stage>/<hash>``, the hash taken over everything that shapes its output
  (its own settings and the identity of its input), so a rerun with the same config reuses finished stages and
  resumes unfinished ones (regeneration, extraction and training are all resumable), and a changed setting
  reruns only the stages downstream of it.
- The target is loaded once and shared by regeneration, extraction and evaluation; training reads the store
  and needs only the target's frozen head and embedding.
- Evaluation runs the *exported* checkpoint (``serving.export.load_exported``): the directory a user would hand
  to SGLang or vLLM, after a round-trip check that it reproduces the trained drafter's logits.
- The result table is printed at the end and written with plots to the eval stage's directory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from eyas.command import Command, command_line
from eyas.common import build_config, json_hash
from eyas.data.extract import ExtractStage
from eyas.data.extract_speed import extraction_speed_check
from eyas.data.prepare import PrepareConfig
from eyas.eval.acceptance import AcceptanceResult
from eyas.eval.profile import StepProfile
from eyas.eval.stage import EvalStageConfig
from eyas.serving.models.target import Target, TargetConfig
from eyas.train.config import DraftModelConfig, TrainConfig

if TYPE_CHECKING:
    from eyas.data.store import BytesPerToken

log = logging.getLogger(__name__)
J = TypeVar("J", bound="PipelineJob")


@dataclass
class StageRecord:
    name: str
    path: str
    seconds: float
    reused: bool
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineResult:
    stages: list[StageRecord]
    acceptance: AcceptanceResult | None
    profile: StepProfile | None
    report: str | None

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


# -- stages ------------------------------------------------------------------------------------------------------
def stage_prepare(pcfg, target: Target, target_cfg: TargetConfig) -> tuple[Any, StageRecord]:
    from eyas.data.prepare import PrepareJob, format_summary
    from eyas.data.prepare import run as run_prepare

    t0 = time.perf_counter()
    res = run_prepare(PrepareJob(target_cfg, pcfg), target)
    print(format_summary(res), flush=True)
    train = res.splits["train"]
    facts = {"samples": train.samples, "tokens": train.tokens, "loss_tokens": train.loss_tokens}
    if train.regen is not None:
        facts["regenerated"] = train.regen.written + train.regen.already_done
        facts["regen_tokens_per_s"] = round(train.regen.tokens_per_s, 1)
        if (
            train.regen.remaining
        ):  # a time-budgeted run: how many were not regenerated, and what became of them
            kept = pcfg.regen.unfinished == "keep"
            facts["not_regenerated_" + ("kept_with_original_answers" if kept else "left_out")] = (
                train.regen.remaining
            )
    return res, StageRecord("prepare", str(res.out_dir), time.perf_counter() - t0, res.reused, facts)


def store_sizes(target: Target) -> dict[str, BytesPerToken]:
    """Bytes per token of every named storage option for this target."""
    from eyas.data.store import NAMED_OPTIONS, bytes_per_token

    info = target.info
    return {
        name: bytes_per_token(info.hidden_size, len(info.aux_layers), opt, info.vocab_size)
        for name, opt in NAMED_OPTIONS.items()
    }


def stage_extract(
    prep, ecfg, target: Target, work_dir: Path, speed_check_tokens: int = 0
) -> tuple[Path, StageRecord]:
    from eyas.data.extract import extract, inputs_fingerprint, read_samples_jsonl

    t0 = time.perf_counter()
    samples = list(read_samples_jsonl(prep.samples_path("train")))
    key = json_hash(
        {
            "samples": inputs_fingerprint(samples),
            "store": ecfg.store.to_dict(),
            "shard_size": ecfg.shard_size,
            "target": target.info.to_dict(),
            "dtype": str(target.dtype),
        }
    )
    out = work_dir / "store" / key
    res = extract(samples, target, out, ecfg)
    bpt = res.bytes_per_token
    facts = {
        "samples": res.num_samples,
        "tokens": res.num_tokens,
        "loss_tokens": res.num_loss_tokens,
        "bytes_per_token": round(bpt.total, 1),
        "ratio_to_4H_bf16": round(bpt.ratio_to_anchor, 3),
        "extract_tokens_per_s": round(res.tokens_per_s, 1),
    }
    print(
        f"extract: {out} ({'reused' if res.shards_written == 0 else f'{res.shards_written} shards written'}): "
        f"{res.num_samples} samples, {res.num_tokens:,} tokens, {bpt.total:.0f} bytes/token "
        f"({bpt.ratio_to_anchor:.2f} of 4H bf16)"
        + (f", {res.tokens_per_s:.0f} tok/s" if res.shards_written else ""),
        flush=True,
    )
    sizes = store_sizes(target)
    print(
        "store bytes/token by option (ratio to 4H bf16): "
        + ", ".join(f"{k} {b.total} ({b.ratio_to_anchor:.2f})" for k, b in sizes.items()),
        flush=True,
    )
    if res.shards_written and speed_check_tokens > 0:
        check = extraction_speed_check(samples, target, ecfg, speed_check_tokens)
        facts.update(check)
        print(
            f"extract speed check over {check['check_tokens']:,} tokens: extraction "
            f"{check['check_extract_tokens_per_s']:.0f} tok/s; bare target forward with logits "
            f"{check['bare_forward_tokens_per_s']:.0f} tok/s, without the vocabulary projection "
            f"{check['bare_base_tokens_per_s']:.0f} tok/s: extraction takes "
            f"{check['extract_time_vs_bare_forward']:.2f}x / {check['extract_time_vs_bare_base']:.2f}x their "
            "time (goal <= 1.10)",
            flush=True,
        )
    return out, StageRecord("extract", str(out), time.perf_counter() - t0, res.shards_written == 0, facts)


def train_key(store, dcfg, tcfg) -> str:
    """The training run's directory name: the store's data (``Manifest.data_identity``, what the trainer's
    resume check compares), the drafter and the training settings, with ``train.optimizer=auto`` resolved as the
    trainer resolves it for this launch. Two stores of one target (the corpus's answers and the target's, say)
    must not share a run, nor a DeepSpeed launch (AdamW) and a plain one (Muon) of the same settings."""
    from eyas.train.optim import deepspeed_launch, resolve_optimizer

    optimizer = resolve_optimizer(tcfg.optimizer, deepspeed=deepspeed_launch())
    train = tcfg.identity(optimizer)
    return json_hash({**store.manifest.data_identity(), "drafter": dcfg.identity(), "train": train})


def stage_train(store_dir: Path, dcfg, tcfg, target: Target, work_dir: Path, target_cfg: TargetConfig):
    from dataclasses import replace

    from eyas.data.store import FeatureStore
    from eyas.train.config import TrainJob
    from eyas.train.setup import run as run_train
    from eyas.train.vocab import DraftVocab

    t0 = time.perf_counter()
    store = FeatureStore(store_dir, expect_target=target.info)
    out = work_dir / "train" / train_key(store, dcfg, tcfg)
    data = replace(tcfg.data, source="store", store_dir=str(store_dir))
    tcfg = replace(tcfg, output_dir=str(out), data=data)
    res = run_train(TrainJob(target_cfg, dcfg, tcfg), target)
    vocab = DraftVocab.load(
        Path(dcfg.vocab_file or out / "draft_vocab.json"), target_vocab_size=target.vocab_size
    )
    facts: dict[str, Any] = {
        "steps": res.steps,
        "draft_vocab": vocab.size,
        "vocab_coverage": round(vocab.coverage, 4),
    }
    if res.steps_this_run:
        facts["train_tokens_per_s"] = round(res.tokens_per_s, 1)
    if res.final_eval:
        fe = res.final_eval
        facts.update(
            final_loss=round(fe["loss"], 4),
            step_acc=[round(a, 3) for a in fe["step_acc"]],
            tau_sim=round(fe["tau_chain"], 3),
        )
        if "tau_served" in fe:
            facts["tau_sim_served"] = round(fe["tau_served"], 3)
    print(
        f"train: {out} ({res.steps_this_run} steps this run, {res.steps} in all): "
        + ", ".join(f"{k} {v}" for k, v in facts.items()),
        flush=True,
    )
    return res, StageRecord("train", str(out), time.perf_counter() - t0, res.steps_this_run == 0, facts)


def stage_export(train_res, target: Target, work_dir: Path) -> tuple[Path, StageRecord]:
    """The export stage's :func:`serving.export.run` on the best (else the last) checkpoint; an export of the same
    weights is rewritten (it takes a second) and counts as reused."""
    from eyas.serving.export import ExportJob, ExportStage
    from eyas.serving.export import run as run_export

    t0 = time.perf_counter()
    src = Path(train_res.best_dir or train_res.last_checkpoint)
    out = work_dir / "export" / json_hash({"weights": str(src.resolve()), "step": train_res.steps})
    reused = (out / "config.json").exists()
    stage = ExportStage(checkpoint=str(src), out_dir=str(out), fmt="sglang", overwrite=True)
    done = run_export(ExportJob(export=stage), target)
    err = done["round_trip_max_abs_logit_diff"]
    kind = "vLLM DFlash" if done["format"] == "dflash" else "SGLang/vLLM EAGLE-3"
    print(f"export: {out} ({kind} format; round-trip max |Δlogit| {err:.2e})", flush=True)
    return out, StageRecord("export", str(out), time.perf_counter() - t0, reused, {"round_trip_max_abs": err})


def eval_settings(ecfg: EvalStageConfig, prep) -> EvalStageConfig:
    """The eval stage's settings in the pipeline: its prompts are checked against the records this drafter was
    trained on, the prepared training split (``eval.training_text``)."""
    return replace(ecfg, training_text=str(prep.out_dir / "train" / "conversations.jsonl"))


def stage_eval(
    export_dir: Path,
    ecfg: EvalStageConfig,
    target: Target,
    work_dir: Path,
    extra: dict[str, Any],
    command: str,
) -> tuple[AcceptanceResult, StepProfile | None, Path, StageRecord]:
    from dataclasses import replace

    from eyas.eval.stage import EvalJob
    from eyas.eval.stage import run as run_eval

    job = EvalJob(eval=replace(ecfg, export_dir=str(export_dir)), work_dir=str(work_dir))
    res = run_eval(job, target, extra, command, title="eyas: the whole pipeline on one config")
    if res.chain_length is not None:  # the export is served at the K this evaluation predicts fastest
        from eyas.serving.export import print_serving, record_serving

        rec = res.chain_length
        serve = record_serving(
            export_dir,
            rec.best_k,
            f"eval report {res.report}",
            profiled_on=rec.hardware,
            chosen_on={"split": "calibration", "prompts": rec.chosen_on},
        )
        print_serving(serve)
    return (
        res.acceptance,
        res.profile,
        res.report,
        StageRecord("eval", str(res.report.parent), res.seconds, False),
    )


# -- the pipeline ------------------------------------------------------------------------------------------------
@dataclass
class PipelineJob:
    """Every stage's typed config (the Hydra groups of the same names; ``prepare`` includes the corpus)."""

    target: TargetConfig
    prepare: PrepareConfig
    extract: ExtractStage
    drafter: DraftModelConfig
    train: TrainConfig
    eval: EvalStageConfig
    work_dir: str = "runs"
    seed: int = 0
    threads: int | None = None
    """torch CPU threads for the pipeline (None: torch's default)."""
    extract_speed_check_tokens: int = 0
    """Time extraction against a bare target forward over this many of the same tokens (0: skip)."""


def pipeline_job(cfg, cls: type[J] = PipelineJob) -> J:
    """The pipeline's typed config (``cls``: :class:`PipelineJob` or a job extending it) from the composed Hydra
    config, through the one loader; ``prepare`` folds in the ``corpus`` group."""
    from eyas.data.prepare import prepare_config_from_hydra

    names = {f.name for f in fields(cls)} - {"prepare"}
    return build_config(
        cls, {**{k: cfg[k] for k in cfg if k in names}, "prepare": prepare_config_from_hydra(cfg)}
    )


def run_pipeline(job: PipelineJob, command: str = "python -m eyas.pipeline") -> PipelineResult:
    """Run every stage of ``job`` (see the module docstring); ``command``: the command line, for the report."""
    from eyas.eval.stage import EvalJob, check_before_running
    from eyas.serving.models.target import load_target

    os.environ.setdefault("WANDB_SILENT", "true")  # the pipeline prints its own summary
    work_dir = Path(job.work_dir)
    if job.threads:
        torch.set_num_threads(job.threads)
    # the last stage's outputs and engine, checked before hours of the others: not found after training
    check_before_running(EvalJob(target=job.target, eval=job.eval, work_dir=job.work_dir))

    t0 = time.perf_counter()
    target = load_target(job.target)
    stages = [
        StageRecord(
            "load target",
            target.info.name,
            time.perf_counter() - t0,
            False,
            {"dtype": str(target.dtype).removeprefix("torch.")},
        )
    ]
    prep, rec = stage_prepare(job.prepare, target, job.target)
    stages.append(rec)
    store_dir, rec = stage_extract(
        prep, job.extract.settings(), target, work_dir, speed_check_tokens=job.extract_speed_check_tokens
    )
    stages.append(rec)
    train_res, rec = stage_train(store_dir, job.drafter, job.train, target, work_dir, job.target)
    stages.append(rec)
    export_dir, rec = stage_export(train_res, target, work_dir)
    stages.append(rec)
    extra = {f"{s.name}.{k}": v for s in stages for k, v in s.facts.items()}
    acc, prof, report, rec = stage_eval(
        export_dir, eval_settings(job.eval, prep), target, work_dir, extra, command
    )
    stages.append(rec)
    result = PipelineResult(stages=stages, acceptance=acc, profile=prof, report=str(report))
    summary = {"stages": [asdict(s) for s in stages], "report": str(report), "seconds": result.seconds}
    (Path(report).parent / "pipeline.json").write_text(json.dumps(summary, indent=2, default=str))
    print(
        "\nstages: "
        + ", ".join(f"{s.name} {s.seconds:.0f}s{' (reused)' if s.reused else ''}" for s in stages)
    )
    print(f"report: {report}")
    return result


def demo(job: PipelineJob) -> None:
    run_pipeline(job, command_line(COMMAND))


def pipeline_command(name: str, module: str, config: str, job: type[J], run: Callable[[J], Any]) -> Command:
    """The command of a job that is the pipeline's (``job``: :class:`PipelineJob` or one extending it): its
    ``prepare`` folds in the ``corpus`` group."""
    return Command(name, module, config, job, run, load=lambda cfg: pipeline_job(cfg, job), reads=("corpus",))


COMMAND = pipeline_command("demo", "eyas.pipeline", "demo", PipelineJob, demo)
main = COMMAND.main


if __name__ == "__main__":
    main()
