"""Diagnose a deployment's tokens/s, recommend its speculation settings, and plan its context length.

``python -m eyas.eval.diagnose [measure] [preset=default] key=value ...``  measure, explain, recommend (this file)
``python -m eyas.eval.diagnose plan model=kimi_k2 gpu_mem_gib=141 ...``   memory plan (``eval.plan``)

Presets live in ``conf/diagnose/`` (``default``: a few minutes on the embedded target; ``smoke``; ``gpu``). The
measure mode writes ``report.md``, ``results.json`` and plots to ``out_dir`` and exits with status 1 when a cell
is flagged, so CI can gate a serving change on it.

At batch 1, tokens/s = τ ÷ (draft + verify + bookkeeping) (``eval.throughput``). ``measure`` checks that
decomposition on the real loop and reports which term a slow deployment is paying for:

1. In each *round*, at each context length L, generate every prompt of every set with every method at contexts
   of about L tokens, and take a profile sample (``eval.profile.StepProfiler``: the target's verify forward for
   every width the settings use, the drafter's forwards, the loop's bookkeeping) before the first generation and
   after each one; the model-free proposers' search (prompt lookup) is timed once per round and L.
2. Per (method, prompt set, L): τ and acceptance per draft position are counted from the steps; the predicted
   tokens/s prices each generation's steps with the two samples that bracket it (never with the steps' own
   timings); the measured tokens/s is wall clock after prefill. The spread of the per-generation
   predicted/measured ratios is the noise, and a cell whose ratio is farther from 1 than
   ``max(tolerance, n_sigma × standard error)`` is flagged as a likely bug (work the loop does that the profile
   does not, or the reverse).
3. Per cell, chains K = 0..k_max are priced from the measured per-position acceptance and step-time curves,
   next to the levers: a better drafter (acceptance + δ), a cheaper verify, a cheaper drafter, the ceiling.

Design decisions:
- Profile samples are interleaved with the generations they price, so a machine shared with other jobs (or a
  GPU changing clocks) loads both sides of the comparison alike; what still differs is the noise estimate.
- Contexts of about L tokens are built by putting earlier turns of a real chat corpus (``filler``, ShareGPT by
  default) before each prompt, through the target's chat template, the last filler answer cut to fit; the
  actual mean context of the steps is what gets priced and reported.
- "Predictable" prompts: ``builtin:predictable`` (copy a HumanEval function verbatim, count, write a times
  table). Their answers are fixed by the prompt or by a trivial rule, so any competent drafter (and prompt
  lookup, for the copies) predicts most tokens: the high-τ end of the spectrum (the issue's τ 7–8). "Hard
  reasoning" is reasoning-gym's held-out seeds: each answer depends on arithmetic the drafter must redo.
- Drafters: an exported checkpoint (SGLang or speculators format), a trainer checkpoint, ``auto`` (the newest
  under ``runs/``) or ``random`` (an untrained EAGLE-3 drafter: τ ≈ 1, which still tests the arithmetic).
- The results never depend on the output directory: ``results.json`` holds every number ``report.md`` and the
  plots show.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shlex
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eyas.eval.acceptance import (
    AcceptanceResult,
    MethodSpec,
    PromptSetSpec,
    aggregate,
    make_proposer,
)
from eyas.eval.profile import ProfileConfig, StepProfile, StepProfiler, time_ms
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.eval.throughput import (
    AcceptanceCurve,
    ChainSweep,
    CostCurves,
    DrafterKind,
    Lever,
    MismatchCheck,
    StepPrediction,
    check_mismatch,
    levers,
    price_step,
    sweep_chain,
)
from eyas.serving.drafter import Eagle3Drafter
from eyas.serving.loop import GenerationResult, context_limit, generate
from eyas.serving.proposers import DraftContext, Proposer
from eyas.serving.target import Target, TargetConfig
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "diagnose"
METHODS = ("eagle3", "eagle3_tree", "prompt_lookup", "none")


class DiagnoseError(ValueError):
    """Settings or inputs diagnose cannot work with; the message says what to change."""


# -- config ------------------------------------------------------------------------------------------------------
def _default_sets() -> list[PromptSetSpec]:
    return [
        PromptSetSpec("reasoning", "reasoning_gym", n=2, label="hard reasoning", max_new_tokens=32),
        PromptSetSpec("predictable", BUILTIN_PREDICTABLE, n=2, label="predictable", max_new_tokens=32),
    ]


@dataclass
class DiagnoseConfig:
    """What ``measure`` runs (also the ``key=value`` arguments of ``python -m eyas.eval.diagnose``)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    """The target model (default: the embedded SmolLM2-135M-Instruct)."""
    drafter: str | None = None
    """EAGLE-3 drafter for the ``eagle3`` methods: ``random`` (untrained), ``auto`` (the newest drafter under
    ``runs_dir``), an exported checkpoint directory, or a trainer checkpoint / ``best`` / output directory."""
    draft_vocab_size: int = 32000
    """Draft vocabulary of the ``random`` drafter."""
    runs_dir: str = "runs"
    """Where ``drafter=auto`` looks."""
    methods: list[str] = field(default_factory=lambda: ["eagle3", "prompt_lookup"])
    """Any of ``eagle3`` (chain), ``eagle3_tree`` (one method per entry of ``trees``), ``prompt_lookup``, ``none``."""
    chain_length: int = 4
    """K: drafts per step of the measured chains (prompt lookup's draft length too)."""
    trees: list[TreeConfig] = field(default_factory=list)
    """EAGLE-2 tree shapes measured by ``eagle3_tree`` (recommendation candidates; trees are never extrapolated)."""
    prompt_sets: list[PromptSetSpec] = field(default_factory=_default_sets)
    """Prompt sets (``source``: any ``data.corpora.load_prompt_set`` name, or ``builtin:predictable``)."""
    prompts_per_set: int | None = None
    """Overrides every set's ``n``."""
    max_new_tokens: int | None = None
    """Overrides every set's ``max_new_tokens``."""
    contexts: list[int] = field(default_factory=lambda: [128, 1024, 2048])
    """Context lengths L (tokens before generation starts) to measure at."""
    filler: str = "sharegpt"
    """Corpus (``conf/corpus`` name) whose conversations pad prompts to L tokens."""
    rounds: int = 2
    """Repeats of the whole measurement (every context, set, prompt and method)."""
    profile_repeats: int = 2
    """Timed repetitions per profile sample and point (one sample is taken after every generation)."""
    statistic: str = "mean"
    """How profile repeats are summarised (``mean`` matches a sum of steps on a shared machine; or median, min)."""
    tolerance: float = 0.10
    """|predicted / measured - 1| always accepted (costs the model leaves out, e.g. the loop's own Python)."""
    n_sigma: float = 3.0
    """Standard errors of the per-generation predicted/measured ratios beyond which a mismatch is flagged."""
    k_max: int | None = None
    """Longest chain the recommendation prices (default: ``chain_length``; longer needs ``extrapolate``)."""
    extrapolate: bool = False
    """Price chains longer than measured by repeating the last measured acceptance rates (marked)."""
    better_acceptance: list[float] = field(default_factory=lambda: [0.1, 0.2])
    """What-if drafters: per-position acceptance raised by each δ."""
    verify_cut: float = 0.25
    """What-if: verify forward this fraction cheaper."""
    draft_cut: float = 0.5
    """What-if: drafter this fraction cheaper."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples (lossless rejection sampling)."""
    top_p: float = 1.0
    """Nucleus sampling mass when sampling."""
    seed: int = 0
    """Seeds prompt choice, the random drafter, the profile's random contexts and sampling."""
    num_threads: int | None = None
    """torch CPU threads (the entry point sets them; 1 is steadiest on a shared machine)."""
    out_dir: str = "runs/diagnose"
    """Where report.md, results.json and the plots go."""

    def __post_init__(self) -> None:
        if self.chain_length <= 0:
            raise DiagnoseError(f"chain_length (K) must be >= 1, got {self.chain_length}")
        if self.k_max is not None and self.k_max <= 0:
            raise DiagnoseError(f"k_max (K) must be >= 1, got {self.k_max}")
        if self.k_max is not None and self.k_max > self.chain_length and not self.extrapolate:
            raise DiagnoseError(
                f"k_max={self.k_max} exceeds the measured chain_length={self.chain_length}: acceptance beyond "
                f"position {self.chain_length} would not be measured. Raise chain_length, or set extrapolate=true"
            )
        if not self.methods:
            raise DiagnoseError(f"methods is empty; choose from {METHODS}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise DiagnoseError(f"unknown methods {unknown}; choose from {METHODS}")
        if "eagle3_tree" in self.methods and not self.trees:
            raise DiagnoseError(
                "method eagle3_tree needs tree shapes: trees=[{topk: 4, depth: 5, total_tokens: 24}]"
            )
        self.trees = [TreeConfig(**t) if isinstance(t, dict) else t for t in self.trees]
        if not self.contexts or min(self.contexts) < 1:
            raise DiagnoseError(f"contexts must be positive token counts, got {self.contexts}")
        self.contexts = sorted(set(int(c) for c in self.contexts))
        if not self.prompt_sets:
            raise DiagnoseError("prompt_sets is empty: give at least one prompt set")
        self.prompt_sets = [PromptSetSpec(**s) if isinstance(s, dict) else s for s in self.prompt_sets]
        names = [s.name for s in self.prompt_sets]
        if len(set(names)) != len(names):
            raise DiagnoseError(f"prompt set names must be distinct, got {names}")
        for name in ("prompts_per_set", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise DiagnoseError(f"{name} must be >= 1")
        if self.prompts_per_set is not None or self.max_new_tokens is not None:
            self.prompt_sets = [
                PromptSetSpec(
                    s.name,
                    s.source,
                    self.prompts_per_set or s.n,
                    s.label,
                    self.max_new_tokens or s.max_new_tokens,
                )
                for s in self.prompt_sets
            ]
        if self.rounds < 1 or self.profile_repeats < 1:
            raise DiagnoseError("rounds and profile_repeats must be >= 1")
        if self.tolerance < 0 or self.n_sigma < 0:
            raise DiagnoseError("tolerance and n_sigma must be >= 0")
        if any(not 0 < d <= 1 for d in self.better_acceptance):
            raise DiagnoseError(f"better_acceptance holds increments in (0, 1], got {self.better_acceptance}")
        if self.statistic not in ("mean", "median", "min"):
            raise DiagnoseError(f"statistic must be mean, median or min, not {self.statistic!r}")
        SamplingConfig(self.temperature, self.top_p, self.seed)  # validates

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.seed)

    @property
    def recommend_k_max(self) -> int:
        return self.k_max or self.chain_length

    @property
    def uses_drafter(self) -> bool:
        return any(m.startswith("eagle3") for m in self.methods)


def method_specs(cfg: DiagnoseConfig) -> list[MethodSpec]:
    """The measured methods, named as in the report."""
    out: list[MethodSpec] = []
    for m in cfg.methods:
        if m == "eagle3":
            out.append(MethodSpec("eagle3-chain", "eagle3", "chain", cfg.chain_length))
        elif m == "eagle3_tree":
            out += [
                MethodSpec(
                    f"eagle3-tree-{t.topk}x{t.depth}/{t.total_tokens}", "eagle3", "tree", cfg.chain_length, t
                )
                for t in cfg.trees
            ]
        elif m == "prompt_lookup":
            out.append(MethodSpec("prompt-lookup", "prompt_lookup", "chain", cfg.chain_length))
        else:
            out.append(MethodSpec("none", "none", "chain", 1))
    return out


def drafter_kind(spec: MethodSpec) -> DrafterKind:
    return {"eagle3": "model", "prompt_lookup": "lookup", "none": "none"}[spec.kind]


# -- drafters ----------------------------------------------------------------------------------------------------
@dataclass
class LoadedDrafter:
    drafter: Eagle3Drafter
    source: str
    """Where it came from (a path, or ``random``)."""
    trained: bool


def random_drafter(target: Target, draft_vocab_size: int = 32000, seed: int = 0) -> Eagle3Drafter:
    """An untrained EAGLE-3 drafter for ``target`` (its τ is ~1; the step costs are a trained one's)."""
    from eyas.serving.drafter import DrafterConfig

    dcfg = DrafterConfig.from_target(
        target.model.config, list(target.aux_layers), min(draft_vocab_size, target.vocab_size)
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def _is_export_dir(d: Path) -> bool:
    if not (d / "config.json").exists():
        return False
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    archs = " ".join(cfg.get("architectures") or [])
    return "Eagle3" in archs or "eagle" in str(cfg.get("speculators_model_type", "")).lower()


def _is_trainer_dir(d: Path) -> bool:
    from eyas.serving.drafter import is_drafter_checkpoint

    return is_drafter_checkpoint(d)


def find_drafter(runs_dir: str | Path) -> Path | None:
    """The newest exported or trained drafter directory under ``runs_dir`` (None: there is none)."""
    root = Path(runs_dir)
    if not root.is_dir():
        return None
    found = [p.parent for p in root.rglob("config.json") if _is_export_dir(p.parent)]
    found += [p.parent for p in root.rglob("drafter_config.json") if _is_trainer_dir(p.parent)]
    found = [p for p in found if not any(part.startswith(".") for part in p.parts)]  # no temp dirs
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def load_drafter(
    spec: str, target: Target, draft_vocab_size: int = 32000, seed: int = 0, runs_dir: str | Path = "runs"
) -> LoadedDrafter:
    """An EAGLE-3 drafter from ``spec`` (see :attr:`DiagnoseConfig.drafter`), on the target's device and dtype."""
    if spec == "random":
        return LoadedDrafter(random_drafter(target, draft_vocab_size, seed), "random", False)
    path = Path(spec)
    if spec == "auto":
        found = find_drafter(runs_dir)
        if found is None:
            raise DiagnoseError(
                f"drafter=auto: no exported or trained drafter under {runs_dir}/; train and export one "
                "(python -m eyas.train ...), point drafter= at a checkpoint, or use drafter=random"
            )
        path = found
    if not path.is_dir():
        raise DiagnoseError(f"drafter {spec!r} is neither random, auto nor a directory")
    if _is_export_dir(path):
        from eyas.serving.export import load_exported

        d = load_exported(path, embedding=target, dtype=target.dtype, device=target.device)
        return LoadedDrafter(d.eval(), str(path), True)
    if not _is_trainer_dir(path):
        from eyas.train.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else None
        best = path / "best"
        path = best if _is_trainer_dir(best) else ckpt
        if path is None or not _is_trainer_dir(path):
            raise DiagnoseError(
                f"{spec}: no drafter here (an export needs config.json + model.safetensors; a trainer "
                "checkpoint needs drafter_config.json + drafter.safetensors)"
            )
    from eyas.serving.drafter import load_trained_drafter

    drafter = load_trained_drafter(path, target.model.get_input_embeddings().weight)
    return LoadedDrafter(drafter.to(device=target.device, dtype=target.dtype).eval(), str(path), True)


# -- prompts -----------------------------------------------------------------------------------------------------
@dataclass
class ContextPrompts:
    """One prompt set's token-id prompts at every measured context length."""

    spec: PromptSetSpec
    by_context: dict[int, list[list[int]]]
    """Nominal context length L -> prompts of about L tokens (never shorter than the bare prompt)."""

    def __post_init__(self) -> None:
        empty = [c for c, p in self.by_context.items() if not p]
        if not self.by_context or empty:
            raise DiagnoseError(f"prompt set {self.spec.name} ({self.spec.source}) has no prompts")
        if any(len(p) == 0 for ps in self.by_context.values() for p in ps):
            raise DiagnoseError(f"prompt set {self.spec.name}: a prompt has no tokens")


def filler_pairs(corpus: str, limit: int = 64) -> list[list[dict[str, str]]]:
    """(user, assistant) turn pairs from the first conversations of a corpus, to pad contexts with."""
    from eyas.data.corpora.config import load_corpus_config
    from eyas.data.corpora.sources import read_source

    pairs: list[list[dict[str, str]]] = []
    for src in load_corpus_config(corpus).sources:
        for conv in itertools.islice(read_source(src), limit):
            msgs = [m for m in conv.messages if m["role"] in ("user", "assistant")]
            for u, a in zip(msgs, msgs[1:]):
                if u["role"] == "user" and a["role"] == "assistant" and u["content"] and a["content"]:
                    pairs.append(
                        [
                            {"role": "user", "content": u["content"]},
                            {"role": "assistant", "content": a["content"]},
                        ]
                    )
        if len(pairs) >= limit:
            break
    if not pairs:
        raise DiagnoseError(f"filler corpus {corpus!r} has no user/assistant turn pairs to pad contexts with")
    return pairs


def pad_to_context(
    messages: list[dict[str, Any]], pairs: list[list[dict[str, str]]], tokenizer, length: int, offset: int = 0
) -> list[int]:
    """Token ids of earlier filler turns + ``messages`` under the chat template, at most ``length`` tokens
    (the last filler answer cut to fit), or the bare prompt when it alone is longer."""
    from eyas.data.chat import format_prompt

    ids = format_prompt(messages, tokenizer)
    if len(ids) >= length:
        return ids
    chosen: list[dict[str, str]] = []
    for j in range(4 * len(pairs)):
        user, answer = pairs[(offset + j) % len(pairs)]
        full = format_prompt(chosen + [user, answer] + messages, tokenizer)
        if len(full) <= length:
            chosen += [user, answer]
            ids = full
            if len(full) == length:
                return ids
            continue
        words = tokenizer(answer["content"], add_special_tokens=False)["input_ids"]
        lo, hi, best = 1, len(words) - 1, None
        while lo <= hi:  # the longest cut of this answer that still fits
            mid = (lo + hi) // 2
            cut = {"role": "assistant", "content": tokenizer.decode(words[:mid])}
            trial = format_prompt(chosen + [user, cut] + messages, tokenizer)
            if len(trial) <= length:
                best, lo = trial, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return best
        # even the question alone is too long: try the next pair
    return ids


def build_prompts(cfg: DiagnoseConfig, tokenizer) -> dict[str, ContextPrompts]:
    """Every set's prompts at every context length of ``cfg`` (chat template + filler)."""
    pairs = filler_pairs(cfg.filler)
    out = {}
    for spec in cfg.prompt_sets:
        msgs = prompt_messages(spec, cfg.seed)
        by_context = {
            length: [pad_to_context(m, pairs, tokenizer, length, offset=3 * i) for i, m in enumerate(msgs)]
            for length in cfg.contexts
        }
        out[spec.name] = ContextPrompts(spec, by_context)
    return out


def prompts_from_ids(
    spec: PromptSetSpec, prompts: list[list[int]], filler: list[int], contexts: list[int]
) -> ContextPrompts:
    """Targets without a chat template: each prompt prefixed by the tail of ``filler`` ids to reach L tokens."""
    if not prompts:
        raise DiagnoseError(f"prompt set {spec.name} is empty: no prompts to measure")
    by_context = {}
    for length in contexts:
        rows = []
        for p in prompts:
            need = max(length - len(p), 0)
            if need > len(filler):
                raise DiagnoseError(f"filler of {len(filler)} ids cannot pad a prompt to {length} tokens")
            rows.append(list(filler[len(filler) - need :]) + list(p) if need else list(p))
        by_context[length] = rows
    return ContextPrompts(spec, by_context)


# -- measurement -------------------------------------------------------------------------------------------------
@dataclass
class Generation:
    """One generation of the measured runs, bracketed by the profile samples taken just before and after it."""

    round: int
    context: int
    """Nominal context length L."""
    prompt_set: str
    method: str
    prompt_index: int
    result: GenerationResult
    sample_before: int
    """Index into ``Measurements.samples[(round, context)]``; the sample after it is the next one."""

    @property
    def emitted(self) -> int:
        return sum(s.num_emitted for s in self.result.steps)

    @property
    def decode_s(self) -> float:
        """Wall clock after prefill: every step and the loop around them."""
        return self.result.total_s - self.result.prefill_s


@dataclass
class Measurements:
    generations: list[Generation]
    samples: dict[tuple[int, int], list[StepProfile]]
    """(round, L) -> profile samples at L, one before the first generation at L and one after each."""
    propose_ms: dict[tuple[int, int, str, str], float]
    """(round, L, method, prompt set) -> one ``propose`` of a model-free proposer (prompt lookup)."""
    contexts: list[int]
    wall_s: float

    def costs(self, g: Generation) -> CostCurves:
        """The costs a generation is priced with: the samples taken just before and just after it."""
        samples = self.samples[(g.round, g.context)][g.sample_before : g.sample_before + 2]
        return costs_from_samples(samples, self.propose_ms.get((g.round, g.context, g.method, g.prompt_set)))

    def mean_costs(
        self, context: int, method: str | None = None, prompt_set: str | None = None
    ) -> CostCurves:
        """Every sample taken for ``context`` (with the mean proposer time of ``method`` on ``prompt_set``)."""
        samples = [p for (_, length), ps in sorted(self.samples.items()) if length == context for p in ps]
        propose = [
            v
            for (_, length, me, ps), v in self.propose_ms.items()
            if (length, me, ps) == (context, method, prompt_set)
        ]
        return costs_from_samples(samples, statistics.fmean(propose) if propose else None)


def costs_from_samples(samples: list[StepProfile], propose_ms: float | None = None) -> CostCurves:
    """Profile samples (each at one context length) -> cost curves: samples at the same length averaged."""
    by_length: dict[int, list[CostCurves]] = defaultdict(list)
    for p in samples:
        (length,) = p.context_lengths
        by_length[length].append(CostCurves.from_profile(p, None if propose_ms is None else [propose_ms]))
    return CostCurves.concat([CostCurves.mean(curves) for curves in by_length.values()])


def profile_config(cfg: DiagnoseConfig, context: int) -> ProfileConfig:
    k_top = max(cfg.chain_length, cfg.recommend_k_max)  # the recommendation prices chains up to k_max
    widths = set(range(1, k_top + 2))
    rows = set(range(1, k_top + 2))
    if "eagle3_tree" in cfg.methods:
        widths |= {t.total_tokens + 1 for t in cfg.trees}
        rows |= {r for t in cfg.trees for r in range(1, t.depth + 2)} | {t.topk for t in cfg.trees}
    return ProfileConfig(
        context_lengths=[context],
        verify_tokens=sorted(widths),
        accepted_rows=1,
        repeats=cfg.profile_repeats,
        seed=cfg.seed,
        statistic=cfg.statistic,
        draft_rows=sorted(rows) if cfg.uses_drafter else [],
        bookkeeping=True,
        temperature=cfg.temperature,
    )


def time_propose(
    proposer: Proposer,
    target: Target,
    prompt: list[int],
    k: int,
    sampling: SamplingConfig,
    repeats: int,
    statistic: str,
) -> float:
    """ms of one ``propose`` of a model-free proposer with ``prompt`` as the context (its last token pending)."""
    ids = torch.as_tensor(prompt, dtype=torch.long, device=target.device)
    proposer.reset(ids, target=target.info, max_len=ids.numel() + k + 2)
    gen = torch.Generator(device=target.device).manual_seed(sampling.seed)
    ctx = DraftContext(
        tokens=ids,
        length=ids.numel() - 1,
        sampling=sampling,
        generator=gen,
        mode="chain",
        max_depth=k,
        max_tokens=k,
    )
    return time_ms(lambda: proposer.propose(ctx), repeats, target.device, statistic)


def check_contexts(cfg: DiagnoseConfig, target: Target) -> int:
    """The target's supported maximum; raises when a measured context cannot fit under it."""
    limit = context_limit(target)
    longest_draft = max([cfg.chain_length, *[t.total_tokens for t in cfg.trees]])
    new = max(s.max_new_tokens for s in cfg.prompt_sets)
    worst = max(cfg.contexts) + new + longest_draft + 1
    if worst > limit:
        raise DiagnoseError(
            f"context {max(cfg.contexts)} + max_new_tokens {new} + a draft of {longest_draft} = {worst} tokens "
            f"exceeds the target's supported maximum of {limit} tokens (max_position_embeddings); "
            f"use contexts <= {limit - new - longest_draft - 1}"
        )
    return limit


def measure(
    target: Target,
    cfg: DiagnoseConfig,
    prompts: dict[str, ContextPrompts],
    drafter: Eagle3Drafter | None = None,
    proposers: dict[str, Proposer] | None = None,
) -> Measurements:
    """Rounds of (profile at L, then every prompt × method at about L tokens) for every L; see the module doc.

    proposers: method name -> proposer, replacing the one built from the method's spec (custom drafters).
    """
    specs = method_specs(cfg)
    if cfg.uses_drafter and drafter is None:
        raise DiagnoseError(
            "the eagle3 methods need a drafter: set drafter=random, auto or a checkpoint path"
        )
    built = {s.name: (proposers or {}).get(s.name) or make_proposer(s, drafter) for s in specs}
    missing = [s.name for s in cfg.prompt_sets if s.name not in prompts]
    if missing:
        raise DiagnoseError(f"no prompts were built for the sets {missing}")
    for name, cp in prompts.items():
        absent = [c for c in cfg.contexts if c not in cp.by_context]
        if absent:
            raise DiagnoseError(f"prompt set {name} has no prompts at contexts {absent}")
    check_contexts(cfg, target)
    sampling = cfg.sampling
    first = next(iter(prompts.values())).by_context[cfg.contexts[0]][0]
    for s in specs:  # fail on a mismatched drafter before the long run, and warm every path up
        generate(target, built[s.name], first, 4, sampling, mode=s.mode)

    t0 = time.perf_counter()
    gens: list[Generation] = []
    samples: dict[tuple[int, int], list[StepProfile]] = {}
    propose: dict[tuple[int, int, str, str], float] = {}
    per_round = sum(len(cp.by_context[c]) for cp in prompts.values() for c in cfg.contexts) * len(specs)
    bar = tqdm(total=cfg.rounds * per_round, desc="diagnose", unit="gen")
    for r in range(cfg.rounds):
        for length in cfg.contexts:
            # samples alternate between the shortest prompt at L and the longest one plus its new tokens, so each
            # generation is bracketed in time and in context by the samples that price it
            lens = [len(p) for cp in prompts.values() for p in cp.by_context[length]]
            lo, hi = min(lens), max(lens) + max(cp.spec.max_new_tokens for cp in prompts.values())
            profiler = StepProfiler(target, drafter if cfg.uses_drafter else None, profile_config(cfg, lo))
            profiler.prepare(lo)
            profiler.prepare(hi)
            taken = samples[(r, length)] = [profiler.sample(lo)]
            for s in specs:
                if (
                    s.kind != "prompt_lookup"
                ):  # EAGLE-3 is priced by the drafter's forwards; none drafts nothing
                    continue
                for name, cp in prompts.items():
                    times = [
                        time_propose(
                            built[s.name],
                            target,
                            p,
                            s.chain_length,
                            sampling,
                            cfg.profile_repeats,
                            cfg.statistic,
                        )
                        for p in cp.by_context[length]
                    ]
                    propose[(r, length, s.name, name)] = statistics.fmean(times)
            for name, cp in prompts.items():
                for i, prompt in enumerate(cp.by_context[length]):
                    for s in specs:
                        res = generate(
                            target, built[s.name], prompt, cp.spec.max_new_tokens, sampling, mode=s.mode
                        )
                        gens.append(Generation(r, length, name, s.name, i, res, len(taken) - 1))
                        taken.append(profiler.sample(hi if taken[-1].context_lengths[0] == lo else lo))
                        bar.update()
    bar.close()
    return Measurements(gens, samples, propose, list(cfg.contexts), time.perf_counter() - t0)


# -- analysis ----------------------------------------------------------------------------------------------------
@dataclass
class CellResult:
    """One (method, prompt set, context length): the decomposition, predicted against measured."""

    method: str
    prompt_set: str
    label: str
    context: int
    """Nominal context length L."""
    mean_context: float
    """Mean context of the steps (what is priced)."""
    generations: int
    steps: int
    tau: float
    acceptance_by_position: list[float]
    """P(accepted >= i) over all steps, i = 1..K."""
    prediction: StepPrediction
    """τ ÷ (draft + verify + bookkeeping): each generation's steps priced with the profile samples bracketing
    it, step-weighted over the cell's generations."""
    measured_tokens_per_s: float
    """Tokens emitted by the steps ÷ wall clock after prefill."""
    measured_step_ms: float
    measured_draft_ms: float
    """The loop's own timings, shown to localise a mismatch; never used in the prediction."""
    measured_verify_ms: float
    measured_loop_ms: float
    """Wall clock per step outside the loop's draft and verify timers."""
    check: MismatchCheck
    curve: AcceptanceCurve | None = None
    """Chains: the per-position acceptance the recommendation prices."""
    drafted_distribution: list[float] = field(default_factory=list)
    """P(drafted = j) over the steps."""
    accepted_distribution: list[float] = field(default_factory=list)
    """P(accepted = j) over the steps."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prediction"] = self.prediction.to_dict()
        d["curve"] = None if self.curve is None else self.curve.to_dict()
        return d


@dataclass
class CellRecommendation:
    """Settings that maximise predicted tokens/s for one (chain method, prompt set, context length)."""

    method: str
    prompt_set: str
    context: int
    sweep: ChainSweep
    levers: list[Lever]
    trees: list[StepPrediction] = field(default_factory=list)
    """Measured tree shapes at the same set and context (their τ measured, never extrapolated)."""
    best: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "prompt_set": self.prompt_set,
            "context": self.context,
            "sweep": self.sweep.to_dict(),
            "levers": [lv.to_dict() for lv in self.levers],
            "trees": [t.to_dict() for t in self.trees],
            "best": self.best,
        }


@dataclass
class DiagnoseResult:
    config: dict[str, Any]
    target: dict[str, Any]
    drafter: str | None
    costs: CostCurves
    """Target and drafter costs at each context, mean of every profile sample."""
    cells: list[CellResult]
    recommendations: list[CellRecommendation]
    acceptance: AcceptanceResult
    """τ per (prompt set, method), pooled over contexts and rounds (``eval.acceptance`` aggregates)."""
    acceptance_by_context: AcceptanceResult
    """The same per (prompt set @ context, method)."""
    noise: str
    notes: list[str]
    wall_s: float

    @property
    def flagged(self) -> list[CellResult]:
        return [c for c in self.cells if c.check.flagged]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "target": self.target,
            "drafter": self.drafter,
            "costs": self.costs.to_dict(),
            "cells": [c.to_dict() for c in self.cells],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "acceptance": self.acceptance.to_dict(),
            "acceptance_by_context": self.acceptance_by_context.to_dict(),
            "noise": self.noise,
            "notes": self.notes,
            "wall_s": self.wall_s,
        }


def _dist(values: list[int]) -> list[float]:
    """Empirical P(value = j), j = 0..max."""
    top = max(values, default=0)
    return [sum(v == j for v in values) / len(values) for j in range(top + 1)]


def predict_steps(costs: CostCurves, steps, spec: MethodSpec) -> StepPrediction:
    """Price measured steps (their counts only: context, drafted, accepted) with independently timed costs."""
    ctx = statistics.fmean(s.context_len for s in steps)
    setting = spec.name if spec.mode == "tree" else f"K={spec.chain_length}"
    return price_step(
        costs,
        ctx,
        _dist([s.num_drafted for s in steps]),
        _dist([s.num_accepted for s in steps]),
        drafter_kind(spec),
        spec.tree if spec.mode == "tree" else None,
        setting,
    )


def combine(predictions: list[StepPrediction], weights: list[int]) -> StepPrediction:
    """Step-weighted mean of per-generation predictions: τ ÷ (mean step) = tokens ÷ predicted time."""
    total = sum(weights)

    def avg(name: str) -> float:
        return sum(w * getattr(p, name) for p, w in zip(predictions, weights)) / total

    first = predictions[0]
    return StepPrediction(
        avg("context"),
        avg("tau"),
        avg("draft_ms"),
        avg("verify_ms"),
        avg("bookkeeping_ms"),
        avg("verify_tokens"),
        first.setting,
        any(p.extrapolated for p in predictions),
    )


def analyse(
    cfg: DiagnoseConfig,
    m: Measurements,
    target_info: dict[str, Any] | None = None,
    drafter_source: str | None = None,
) -> DiagnoseResult:
    """Decomposition, check and recommendation of every cell (see the module docstring)."""
    specs = {s.name: s for s in method_specs(cfg)}
    cells: list[CellResult] = []
    by_cell: dict[tuple[str, str, int], list[Generation]] = defaultdict(list)
    for g in m.generations:
        if g.result.steps:  # a generation that stopped at prefill has no step to price
            by_cell[(g.method, g.prompt_set, g.context)].append(g)
    labels = {s.name: s.label for s in cfg.prompt_sets}
    for (method, prompt_set, length), gens in by_cell.items():
        spec = specs[method]
        steps = [s for g in gens for s in g.result.steps]
        preds = [predict_steps(m.costs(g), g.result.steps, spec) for g in gens]
        pred = combine(preds, [len(g.result.steps) for g in gens])
        emitted = sum(g.emitted for g in gens)
        wall = sum(g.decode_s for g in gens)
        measured = emitted / wall
        ratios = [p.tokens_per_s / (g.emitted / g.decode_s) for p, g in zip(preds, gens)]
        check = check_mismatch(pred.tokens_per_s, measured, ratios, cfg.tolerance, cfg.n_sigma)
        n = len(steps)
        curve = None
        if spec.mode == "chain" and spec.kind != "none":
            curve = AcceptanceCurve.from_steps(
                [s.num_accepted for s in steps], [s.num_drafted for s in steps], k=spec.chain_length
            )
        cells.append(
            CellResult(
                method=method,
                prompt_set=prompt_set,
                label=labels.get(prompt_set, ""),
                context=length,
                mean_context=pred.context,
                generations=len(gens),
                steps=n,
                tau=sum(s.num_emitted for s in steps) / n,
                acceptance_by_position=curve.reach() if curve else [],
                prediction=pred,
                measured_tokens_per_s=measured,
                measured_step_ms=1e3 * wall / n,
                measured_draft_ms=1e3 * sum(s.draft_s for s in steps) / n,
                measured_verify_ms=1e3 * sum(s.verify_s for s in steps) / n,
                measured_loop_ms=1e3 * (wall - sum(s.step_s for s in steps)) / n,
                check=check,
                curve=curve,
                drafted_distribution=_dist([s.num_drafted for s in steps]),
                accepted_distribution=_dist([s.num_accepted for s in steps]),
            )
        )
    order = {name: i for i, name in enumerate(specs)}
    set_order = {s.name: i for i, s in enumerate(cfg.prompt_sets)}
    cells.sort(key=lambda c: (order[c.method], set_order.get(c.prompt_set, 0), c.context))

    recs = recommend(cfg, cells, m, specs)
    noise = (
        "noise = spread of the predicted/measured ratio over a cell's generations, each priced with the profile "
        "samples taken just before and just after it (so both sides see the same machine load); a cell is "
        f"flagged when |ratio - 1| > max({cfg.tolerance:.2f}, {cfg.n_sigma:g} × std / sqrt(generations))"
    )
    notes = []
    if cfg.extrapolate and cfg.recommend_k_max > cfg.chain_length:
        notes.append(
            f"chains longer than the measured K={cfg.chain_length} are EXTRAPOLATED (last measured acceptance "
            "rate repeated); measure with a longer chain to confirm"
        )
    elif cfg.recommend_k_max == cfg.chain_length:
        notes.append(
            f"chains are priced up to the measured K={cfg.chain_length}; longer chains were not "
            "measured and are not recommended (raise chain_length, or set extrapolate=true)"
        )
    if "eagle3_tree" in cfg.methods:
        notes.append(
            "tree shapes are priced with their measured τ only (no tree shape is extrapolated); a tree "
            "expansion is priced as a drafter forward over topk context rows"
        )
    return DiagnoseResult(
        config=_config_dict(cfg),
        target=target_info or {},
        drafter=drafter_source,
        costs=costs_from_samples([p for ps in m.samples.values() for p in ps]),
        cells=cells,
        recommendations=recs,
        acceptance=_acceptance(m, cfg, by_context=False),
        acceptance_by_context=_acceptance(m, cfg, by_context=True),
        noise=noise,
        notes=notes,
        wall_s=m.wall_s,
    )


def recommend(
    cfg: DiagnoseConfig, cells: list[CellResult], m: Measurements, specs: dict[str, MethodSpec]
) -> list[CellRecommendation]:
    """Best chain length (and the levers) for every chain cell, with the measured trees alongside; costs are
    every profile sample at the cell's context, made monotone in the work done."""
    out = []
    for c in cells:
        spec = specs[c.method]
        if c.curve is None:
            continue
        costs = m.mean_costs(c.context, c.method, c.prompt_set).monotone()
        kind = drafter_kind(spec)
        k_max = cfg.recommend_k_max
        sweep = sweep_chain(costs, c.curve, c.mean_context, k_max, kind, cfg.extrapolate)
        lv = levers(
            costs,
            c.curve,
            c.mean_context,
            spec.chain_length,
            k_max,
            kind,
            cfg.better_acceptance,
            cfg.verify_cut,
            cfg.draft_cut,
            cfg.extrapolate,
        )
        trees = [
            price_step(
                costs,
                t.mean_context,
                t.drafted_distribution,
                t.accepted_distribution,
                "model",
                specs[t.method].tree,
                t.method,
            )
            for t in cells
            if specs[t.method].mode == "tree"
            and t.prompt_set == c.prompt_set
            and t.context == c.context
            and spec.kind == "eagle3"
        ]
        best = sweep.best
        text = f"{c.method}: K={sweep.best_k} ({best.tokens_per_s:.1f} tok/s predicted)"
        if trees:
            top = max(trees, key=lambda t: t.tokens_per_s)
            if top.tokens_per_s > best.tokens_per_s:
                text = f"{top.setting} ({top.tokens_per_s:.1f} tok/s predicted, measured τ {top.tau:.2f})"
        if sweep.best_k == 0:
            text += (
                f": speculation does not pay at this acceptance (K=1 needs τ > {sweep.break_even_tau(1):.2f}, "
                f"has {sweep.options[1].tau:.2f}; K={k_max} needs {sweep.break_even_tau(k_max):.2f}, "
                f"has {sweep.options[k_max].tau:.2f})"
            )
        out.append(CellRecommendation(c.method, c.prompt_set, c.context, sweep, lv, trees, text))
    return out


def _acceptance(m: Measurements, cfg: DiagnoseConfig, by_context: bool) -> AcceptanceResult:
    labels = {s.name: s.label for s in cfg.prompt_sets}
    groups: dict[tuple[str, str], list[GenerationResult]] = defaultdict(list)
    for g in m.generations:
        key = f"{g.prompt_set} @ {g.context}" if by_context else g.prompt_set
        groups[(key, g.method)].append(g.result)
    results = [
        aggregate(s, meth, labels.get(s.split(" @ ")[0], ""), runs) for (s, meth), runs in groups.items()
    ]
    return AcceptanceResult(results=results, sampling=asdict(cfg.sampling))


def _config_dict(cfg: DiagnoseConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg), default=str))


# -- the whole run -----------------------------------------------------------------------------------------------
def target_facts(target: Target) -> dict[str, Any]:
    """The target's identity plus, from ``eval.plan``'s arithmetic, the KV bytes one token adds to every verify
    forward's reads (why verify time grows with context) and its supported context."""
    from eyas.eval.plan import PlanError, load_model_config, model_shape, supported_context

    facts = target.info.to_dict()
    try:
        cfg, name = load_model_config(target.config)
        shape = model_shape(cfg, name)
        facts["kv_bytes_per_token"] = shape.kv_values_per_layer() * shape.num_layers * target.dtype.itemsize
        facts["supported_context"] = supported_context(cfg, shape).tokens
    except PlanError as e:
        log.info("no memory facts for the target: %s", e)
    return facts


def diagnose(
    target: Target,
    cfg: DiagnoseConfig,
    drafter: LoadedDrafter | Eagle3Drafter | None = None,
    prompts: dict[str, ContextPrompts] | None = None,
    proposers: dict[str, Proposer] | None = None,
) -> DiagnoseResult:
    """Measure, decompose, check and recommend (prompts built from ``cfg`` unless given)."""
    if cfg.uses_drafter and drafter is None and cfg.drafter is not None:
        drafter = load_drafter(cfg.drafter, target, cfg.draft_vocab_size, cfg.seed, cfg.runs_dir)
    source = (
        drafter.source if isinstance(drafter, LoadedDrafter) else ("given" if drafter is not None else None)
    )
    module = drafter.drafter if isinstance(drafter, LoadedDrafter) else drafter
    check_contexts(cfg, target)
    if prompts is None:
        prompts = build_prompts(cfg, target.tokenizer)
    m = measure(target, cfg, prompts, module, proposers)
    result = analyse(cfg, m, target_facts(target), source)
    if isinstance(drafter, LoadedDrafter) and not drafter.trained:
        result.notes.append(
            "the EAGLE-3 drafter is UNTRAINED (random init): its τ is ~1 by construction; its "
            "step costs are those of a trained drafter of the same shape"
        )
    return result


# -- report ------------------------------------------------------------------------------------------------------
def decomposition_rows(result: DiagnoseResult) -> list[dict[str, Any]]:
    rows = []
    for c in result.cells:
        p = c.prediction
        rows.append(
            {
                "method": c.method,
                "set": c.prompt_set,
                "label": c.label,
                "L": c.context,
                "ctx": c.mean_context,
                "tau": c.tau,
                "draft": p.draft_ms,
                "verify": p.verify_ms,
                "book": p.bookkeeping_ms,
                "step": p.step_ms,
                "pred": p.tokens_per_s,
                "meas": c.measured_tokens_per_s,
                "ratio": c.check.ratio,
                "noise": c.check.noise,
                "threshold": c.check.threshold,
                "flagged": c.check.flagged,
                "verdict": c.check.verdict,
            }
        )
    return rows


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.0f}%"


def decomposition_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| method | set | L (mean) | τ | draft ms | verify ms | bookkeeping ms | step ms | predicted tok/s "
        "| measured tok/s | pred/meas | noise | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in decomposition_rows(result):
        lines.append(
            f"| {r['method']} | {r['set']} ({r['label']}) | {r['L']} ({r['ctx']:.0f}) | {r['tau']:.2f} "
            f"| {r['draft']:.1f} | {r['verify']:.1f} | {r['book']:.2f} | {r['step']:.1f} | {r['pred']:.2f} "
            f"| {r['meas']:.2f} | {r['ratio']:.3f} | {_pct(r['noise'])} | {r['verdict']} |"
        )
    return "\n".join(lines)


def measured_breakdown_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| method | set | L | loop draft ms | loop verify ms | loop outside timers ms | wall per step ms "
        "| profile step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result.cells:
        lines.append(
            f"| {c.method} | {c.prompt_set} | {c.context} | {c.measured_draft_ms:.1f} | {c.measured_verify_ms:.1f} "
            f"| {c.measured_loop_ms:.2f} | {c.measured_step_ms:.1f} | {c.prediction.step_ms:.1f} |"
        )
    return "\n".join(lines)


def recommendation_markdown(result: DiagnoseResult) -> str:
    md = []
    for rec in result.recommendations:
        md += [
            f"### {rec.method} / {rec.prompt_set} @ {rec.context} tokens",
            "",
            f"**Recommended: {rec.best}**",
            "",
        ]
        md += [
            "| K | τ | draft ms | verify ms | step ms | predicted tok/s | τ needed to beat K=0 |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = rec.sweep.options[0].step_ms
        for k, o in enumerate(rec.sweep.options):
            mark = " **best**" if k == rec.sweep.best_k else ""
            ext = " (extrapolated)" if o.extrapolated else ""
            md.append(
                f"| {k}{ext}{mark} | {o.tau:.2f} | {o.draft_ms:.1f} | {o.verify_ms:.1f} | {o.step_ms:.1f} "
                f"| {o.tokens_per_s:.2f} | {rec.sweep.break_even_tau(k) if k else 1.0:.2f} |"
            )
        for t in rec.trees:
            md.append(
                f"| {t.setting} | {t.tau:.2f} | {t.draft_ms:.1f} | {t.verify_ms:.1f} | {t.step_ms:.1f} "
                f"| {t.tokens_per_s:.2f} | {t.step_ms / base:.2f} |"
            )
        md += [
            "",
            "| lever | best K | τ | step ms | predicted tok/s | vs as run |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for lv in rec.levers:
            ext = " (extrapolated)" if lv.extrapolated else ""
            md.append(
                f"| {lv.name}{ext} | {lv.k} | {lv.tau:.2f} | {lv.step_ms:.1f} | {lv.tokens_per_s:.2f} "
                f"| {lv.gain:.2f}× |"
            )
        md.append("")
    return "\n".join(md)


def step_profile(costs: CostCurves) -> StepProfile:
    """The mean costs as an ``eval.profile.StepProfile`` (for ``eval.report.plot_step_time``)."""
    one_row = costs.draft_rows_ms.get(1, [0.0] * len(costs.context_lengths)) if costs.draft_step_ms else []
    return StepProfile(
        costs.context_lengths,
        costs.verify_ms,
        draft_context_ms=list(one_row),
        draft_step_ms=list(costs.draft_step_ms),
        accepted_rows=1,
        draft_rows_ms=costs.draft_rows_ms,
        bookkeeping_ms=costs.bookkeeping_ms,
    )


def write_report(result: DiagnoseResult, out_dir: str | Path, command: str | None = None) -> Path:
    """``report.md``, ``results.json`` and the plots into ``out_dir``; returns the report's path."""
    from eyas.eval import report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "step time against context": report.plot_step_time(
            step_profile(result.costs), out / "step_time.png", result.config.get("chain_length")
        ),
        "predicted against measured tokens/s": report.plot_predicted_vs_measured(
            decomposition_rows(result), out / "predicted_vs_measured.png"
        ),
        "τ per prompt set": report.plot_tau(result.acceptance, out / "tau.png"),
        "τ per prompt set and context": report.plot_tau(
            result.acceptance_by_context, out / "tau_by_context.png"
        ),
        "acceptance per draft position": report.plot_acceptance_by_position(
            result.acceptance, out / "acceptance_by_position.png"
        ),
    }
    if result.recommendations:
        series = {
            f"{r.method} / {r.prompt_set} @ {r.context}": [o.tokens_per_s for o in r.sweep.options]
            for r in result.recommendations
        }
        plots["predicted tokens/s against K"] = report.plot_k_sweep(series, out / "k_sweep.png")
    (out / "results.json").write_text(json.dumps(result.to_dict(), indent=1, default=float))
    flagged = result.flagged
    unchecked = [c for c in result.cells if c.check.verdict.startswith("UNCHECKED")]
    md = ["# eyas diagnose: where the tokens/s go", ""]
    if command:
        md += ["Reproduce with:", "", f"    {command}", ""]
    md += [
        f"Target: {result.target.get('name', '?')}; drafter: {result.drafter or 'none'}; "
        f"measured in {result.wall_s / 60:.1f} min."
        + (
            f" KV cache per token: {result.target['kv_bytes_per_token'] / 1024:.1f} KiB (eval.plan), read by every "
            f"verify forward for every token of context."
            if result.target.get("kv_bytes_per_token")
            else ""
        ),
        "",
        "tokens/s = τ ÷ (draft + verify + bookkeeping), at batch 1. τ is counted from the measured steps; every "
        "time on the left of *measured* comes from `eval.profile`, timed on its own, never from those steps.",
        "",
        f"**{len(flagged)} of {len(result.cells)} cells flagged"
        + (f", {len(unchecked)} unchecked (one generation: no noise estimate)" if unchecked else "")
        + f".** {result.noise}.",
        "",
        "## Decomposition",
        "",
        decomposition_markdown(result),
        "",
        "## The loop's own timers (for localising a mismatch; not used by the prediction)",
        "",
        measured_breakdown_markdown(result),
        "",
        "## τ per prompt set",
        "",
        "(tokens/s in these two tables is end to end, prefill included, as `eval.acceptance` reports it.)",
        "",
        report.markdown_table(result.acceptance),
        "",
        "## τ per prompt set and context",
        "",
        report.markdown_table(result.acceptance_by_context),
        "",
        "## Step time against context (ms, mean of every profile sample)",
        "",
        _costs_markdown(result.costs, result.target.get("kv_bytes_per_token")),
        "",
        "## Recommendations",
        "",
        recommendation_markdown(result),
    ]
    if result.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    for name, p in plots.items():
        md += [f"## {name}", "", f"![{name}]({p.name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _costs_markdown(costs: CostCurves, kv_bytes_per_token: int | None = None) -> str:
    widths = sorted(costs.verify_ms)
    head = ["context"] + (["KV read per verify (MiB)"] if kv_bytes_per_token else [])
    head += [f"verify {n}" for n in widths]
    if costs.draft_step_ms:
        head += ["draft step", "draft 1 row"]
    if costs.bookkeeping_ms:
        head += [f"bookkeeping {widths[-1]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for i, length in enumerate(costs.context_lengths):
        row = [str(length)] + ([f"{length * kv_bytes_per_token / 2**20:.1f}"] if kv_bytes_per_token else [])
        row += [f"{costs.verify_ms[n][i]:.1f}" for n in widths]
        if costs.draft_step_ms:
            row += [
                f"{costs.draft_step_ms[i]:.2f}",
                f"{costs.draft_rows_ms.get(1, [float('nan')] * (i + 1))[i]:.2f}",
            ]
        if costs.bookkeeping_ms:
            row += [f"{costs.bookkeeping_ms[widths[-1]][i]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_summary(result: DiagnoseResult, report_path: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="tokens/s = τ ÷ (draft + verify + bookkeeping)   [ms; predicted from the profile]")
    for col in (
        "method",
        "set",
        "L",
        "τ",
        "draft",
        "verify",
        "book",
        "pred tok/s",
        "meas tok/s",
        "pred/meas",
        "noise",
        "flag",
    ):
        t.add_column(col, justify="left" if col in ("method", "set") else "right")
    for r in decomposition_rows(result):
        t.add_row(
            r["method"],
            f"{r['set']} ({r['label']})",
            f"{r['L']}",
            f"{r['tau']:.2f}",
            f"{r['draft']:.1f}",
            f"{r['verify']:.1f}",
            f"{r['book']:.2f}",
            f"{r['pred']:.2f}",
            f"{r['meas']:.2f}",
            f"{r['ratio']:.3f}",
            _pct(r["noise"]),
            "LIKELY BUG" if r["flagged"] else r["verdict"].split(":")[0],
        )
    console = Console(width=max(Console().width, 180))
    console.print(t)
    for rec in result.recommendations:
        console.print(f"[bold]{rec.prompt_set} @ {rec.context}[/bold] → {rec.best}")
        console.print(
            "   levers: "
            + "; ".join(f"{lv.name}: {lv.tokens_per_s:.1f} tok/s ({lv.gain:.2f}×)" for lv in rec.levers)
        )
    for c in result.flagged:
        console.print(f"[red]{c.method} / {c.prompt_set} @ {c.context}: {c.check.verdict}[/red]")
    console.print(result.noise)
    if report_path:
        console.print(f"report: {report_path}")


# -- entry point -------------------------------------------------------------------------------------------------
def load_config(args: list[str]) -> DiagnoseConfig:
    """Defaults ← ``conf/diagnose/<preset>.yaml`` (``preset=``, default ``default``) ← ``key=value`` overrides."""
    from omegaconf import OmegaConf

    preset = next((a.split("=", 1)[1] for a in args if a.startswith("preset=")), "default")
    rest = [a for a in args if not a.startswith("preset=")]
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise DiagnoseError(f"arguments must be key=value, got {bad}")
    merged = OmegaConf.structured(DiagnoseConfig)
    path = CONF_DIR / f"{preset}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise DiagnoseError(f"no preset {preset!r} in {CONF_DIR} (known: {known})")
    merged = OmegaConf.merge(merged, OmegaConf.load(path), OmegaConf.from_dotlist(rest))
    return OmegaConf.to_object(merged)


def main(argv: list[str] | None = None) -> int:
    """``python -m eyas.eval.diagnose [measure|plan] key=value ...`` (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "plan":
        from eyas.eval.plan import main as plan_main

        return plan_main(args[1:])
    if args and args[0] == "measure":
        args = args[1:]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.split("\n\n")[1])
        print("measure fields: " + ", ".join(DiagnoseConfig.__dataclass_fields__))
        print("plan fields: see python -m eyas.eval.plan --help")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # omegaconf names the bad key or value
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    from eyas.serving.target import load_target

    try:
        target = load_target(cfg.target)
        result = diagnose(target, cfg)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m eyas.eval.diagnose " + " ".join(shlex.quote(a) for a in args)
    path = write_report(result, cfg.out_dir, command)
    print_summary(result, path)
    return 1 if result.flagged else 0


if __name__ == "__main__":
    raise SystemExit(main())
