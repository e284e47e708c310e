"""Measurement: generations interleaved with the profile samples that price them."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from eyas.eval.acceptance import (
    make_proposer,
)
from eyas.eval.diagnose.config import DiagnoseConfig, DiagnoseError, method_specs
from eyas.eval.diagnose.context_prompts import ContextPrompts
from eyas.eval.profile import ProfileConfig, StepProfile, StepProfiler, time_ms
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.eval.throughput import (
    CostCurves,
)
from eyas.serving.loop import GenerationResult, context_limit, generate
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import Target
from eyas.serving.proposers import DraftContext, Proposer
from eyas.serving.verify import SamplingConfig


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
    if "eagle3-tree" in cfg.methods:
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
            "the eagle3 methods need a drafter: diagnose.export_dir=<export> or auto (null: an untrained one)"
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
                    s.kind != "prompt-lookup"
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
