"""The evaluation stage: an exported drafter (the directory a user ships) against prompt lookup and plain decoding.

``python -m eyas.eval eval.checkpoint=<exported drafter dir>``; the pipeline calls :func:`run` with its own export.
τ per prompt set and draft position, tokens/s, step time against context, a report with plots under
``<work_dir>/eval/<hash>`` (the hash of the export, the settings and the target).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.common import ConfigError, build_config, json_hash
from eyas.eval.acceptance import AcceptanceResult, MethodSpec, PromptSetSpec, default_methods, run_acceptance
from eyas.eval.profile import ProfileConfig, StepProfile, profile_steps
from eyas.serving.target import Target, TargetConfig
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig


@dataclass
class EvalStageConfig:
    """The evaluation stage (``conf/eval``)."""

    prompt_sets: list[PromptSetSpec] = field(default_factory=list)
    """Prompt sets; ``source`` is any ``data.corpora.load_prompt_set`` name or ``builtin:predictable``."""
    chain_length: int = 6
    """K: draft tokens per step of the chain methods."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """EAGLE-2 tree of the ``eagle3-tree`` method."""
    methods: list[str] = field(
        default_factory=lambda: ["eagle3-chain", "eagle3-tree", "prompt-lookup", "none"]
    )
    """Which of ``eagle3-chain``, ``eagle3-tree``, ``prompt-lookup``, ``none`` to run."""
    temperature: float = 0.0
    """0 = greedy (outputs must equal plain decoding's); > 0 samples (lossless in distribution)."""
    seed: int = 0
    profile: ProfileConfig | None = field(default_factory=ProfileConfig)
    """Step-time profile against context length (None: skip)."""
    max_prompt_tokens: int = 1536
    """Prompts longer than this are left out."""
    threads: int | None = None
    """torch CPU threads during evaluation (None: leave as is)."""
    dtype: str = "auto"
    """Target dtype of the evaluation: ``auto`` is float32 on CPU (decode is memory-bound there, so it costs
    little, and greedy speculative output is then token-for-token plain decoding's: a mismatch is a bug) and the
    loaded target's dtype elsewhere (bf16 on GPU, where near-tie divergence is expected); or ``bfloat16``,
    ``float16``, ``float32``, ``target`` (the loaded target's, whatever it is)."""
    checkpoint: str | None = None
    """``python -m eyas.eval``: the drafter to evaluate, normally the exported directory (SGLang/vLLM format) a user
    ships; any directory :func:`serving.drafters.load_drafter` reads. The pipeline sets its own."""

    def __post_init__(self) -> None:
        self.prompt_sets = [
            build_config(PromptSetSpec, p, f"eval.prompt_sets[{i}]") for i, p in enumerate(self.prompt_sets)
        ]
        if isinstance(self.tree, dict):
            self.tree = build_config(TreeConfig, self.tree, "eval.tree")
        if isinstance(self.profile, dict):
            self.profile = build_config(ProfileConfig, self.profile, "eval.profile")
        if not self.prompt_sets:
            raise ValueError("eval.prompt_sets is empty: give at least one prompt set")
        if self.chain_length < 1:
            raise ValueError(f"eval.chain_length (K) must be >= 1, got {self.chain_length}")
        if self.dtype not in ("auto", "target", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"eval.dtype must be auto, target, bfloat16, float16 or float32, not {self.dtype!r}"
            )
        known = {m.name for m in default_methods(self.chain_length, self.tree)}
        bad = [m for m in self.methods if m not in known]
        if bad:
            raise ValueError(f"unknown eval methods {bad}; known: {sorted(known)}")

    def resolve_dtype(self, target: Target) -> torch.dtype:
        """The dtype to evaluate ``target`` in (see ``dtype``)."""
        if self.dtype == "target" or (self.dtype == "auto" and target.device.type != "cpu"):
            return target.dtype
        return torch.float32 if self.dtype == "auto" else getattr(torch, self.dtype)

    def method_specs(self) -> list[MethodSpec]:
        return [m for m in default_methods(self.chain_length, self.tree) if m.name in self.methods]


@dataclass
class EvalJob:
    """What ``python -m eyas.eval`` runs (:func:`run`): the Hydra groups of the same names."""

    target: TargetConfig = field(default_factory=TargetConfig)
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)
    work_dir: str = "runs"
    threads: int | None = None


@dataclass
class EvalResult:
    acceptance: AcceptanceResult
    profile: StepProfile | None
    report: Path
    seconds: float


def run(
    job: EvalJob,
    target: Target | None = None,
    extra: dict[str, Any] | None = None,
    command: str = "",
    title: str = "eyas: acceptance of an exported drafter",
) -> EvalResult:
    """Evaluate the export ``job.eval.checkpoint`` on the target (loaded unless given); ``extra``: facts of
    earlier stages for the report."""
    from eyas.eval.prompts import load_prompt_ids
    from eyas.eval.report import print_table, write_report
    from eyas.serving.drafters import load_drafter
    from eyas.serving.target import load_target

    ecfg = job.eval
    if not ecfg.checkpoint:
        raise ConfigError(
            "eval.checkpoint is not set: give the exported drafter directory, eval.checkpoint=<dir>"
        )
    if job.threads:
        torch.set_num_threads(job.threads)
    target = target if target is not None else load_target(job.target)
    target = target.with_dtype(ecfg.resolve_dtype(target))
    export_dir = Path(ecfg.checkpoint)
    t0 = time.perf_counter()
    out = (
        Path(job.work_dir)
        / "eval"
        / json_hash(
            {
                "export": str(export_dir.resolve()),
                "eval": {**asdict(ecfg), "checkpoint": None},
                "target": target.info.to_dict(),
                "dtype": str(target.dtype),
            }
        )
    )
    if ecfg.threads:
        torch.set_num_threads(ecfg.threads)
    drafter = load_drafter(
        str(export_dir), target
    ).drafter  # an export (what users ship) or a trainer checkpoint
    prompts = {
        s.name: (s, load_prompt_ids(s, target.tokenizer, ecfg.seed, ecfg.max_prompt_tokens))
        for s in ecfg.prompt_sets
    }
    acc = run_acceptance(
        target,
        drafter,
        prompts,
        ecfg.method_specs(),
        SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed),
    )
    prof = None
    if ecfg.profile is not None:
        pcfg = ecfg.profile
        sizes = sorted({1, ecfg.chain_length + 1, ecfg.tree.total_tokens + 1, *pcfg.verify_tokens})
        prof = profile_steps(target, drafter, ProfileConfig(**{**asdict(pcfg), "verify_tokens": sizes}))
    report = write_report(
        out,
        acc,
        prof,
        extra=extra or {},
        title=title,
        chain_length=ecfg.chain_length,
        command=command,
    )
    print_table(acc)
    return EvalResult(acc, prof, Path(report), time.perf_counter() - t0)
