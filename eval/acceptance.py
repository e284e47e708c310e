"""Acceptance runs: every prompt set through the serving loop with every drafting method.

Design decisions:
- All methods (EAGLE-3 chain, EAGLE-3 tree, prompt lookup, none) run through the same
  :func:`serving.loop.generate`, so they differ only in the proposer.
- Methods are interleaved per prompt (prompt 1 with every method, then prompt 2 ...), the baseline among them,
  so a machine that gets busier during the run slows every method alike and the speedups stay fair; the order
  of the methods rotates from prompt to prompt, so none of them always runs first (after the previous prompt's
  last method) or last. Every speedup comes from this one run: a method added to an evaluation (the K to serve)
  is a method of the run, never a second run with a baseline of its own.
- τ counts the bonus token: tokens emitted per verify step. Speedup is end-to-end tokens/s (prefill included)
  over plain decoding ("none") on the same prompts in the same run.
- A fair baseline: plain decoding (``none``) may decode with a ``baseline`` target of its own, its fastest
  numerics (bf16 with stock ``sdpa`` attention on CPU), while the speculative methods keep the numerics their
  lossless check needs (row-exact attention). Plain decoding on the speculative methods' numerics then runs
  too, as :data:`REFERENCE`: the greedy output every method must reproduce, reported but never the baseline.
- Under greedy decoding every method must emit exactly what plain decoding emits (on the same numerics); the
  run records the fraction of prompts where it did (``match_rate``), so a numerics problem shows up in the
  report instead of hiding.
- A prompt is prefilled once per target copy, not once per method (``share_prefill``, :class:`serving.loop.PrefillMemo`):
  the methods decoding on one target continue from a copy of the first one's prefill, bit for bit what their
  own would have written, and each reports the real prefill's measured time. At 32k tokens a prefill of the
  embedded target takes minutes on CPU, and a run decodes every prompt with 3-5 methods.
- Every τ, tokens/s and speedup carries a 95% interval, a bootstrap over the set's prompts (:mod:`eval.intervals`;
  a speedup is paired with the baseline on the same prompts); each prompt's counts are kept (``per_prompt``), with
  a fingerprint of the prompt, so that two methods or two drafters can be compared paired on the same prompts, and
  results of other prompts are refused (:func:`compare`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from eyas.eval.intervals import Interval, paired_ratio, paired_ratio_difference, ratio_interval
from eyas.serving.loop import GenerationResult, PrefillMemo, generate
from eyas.serving.models.dflash import DFlashDrafter
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import Target
from eyas.serving.proposers import (
    DFlashProposer,
    DFlashProposerConfig,
    Eagle3Proposer,
    Eagle3ProposerConfig,
    NoProposer,
    PromptLookupConfig,
    PromptLookupProposer,
    Proposer,
)
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig

log = logging.getLogger(__name__)

MethodKind = Literal["eagle3", "dflash", "prompt-lookup", "none"]
IN_DISTRIBUTION_SUFFIX = "_in_dist"
"""Name suffix of a prompt set drawn from the training distribution (``PromptSetSpec.in_distribution``)."""
BASELINE = "none"
"""The method every speedup is over: plain decoding, on the baseline target when one is given."""
REFERENCE = "none-ref"
"""Plain decoding on the speculative methods' numerics, run beside a baseline that decodes on other numerics:
the greedy output the speculative methods must reproduce (``match_rate``); its tokens/s is reported, never used
as the baseline."""


@dataclass
class PromptSetSpec:
    """One evaluation prompt set."""

    name: str
    """Display name (e.g. ``reasoning``)."""
    source: str
    """What :func:`data.corpora.load_prompt_set` loads: ``ood_reasoning``, ``word_problems``, ``mt_bench``,
    ``humaneval``, ``reasoning_gym[/tasks]``, a corpus name, a JSONL/Parquet path or ``hf:<id>``."""
    n: int = 8
    """Prompts drawn from the source (seeded)."""
    label: str = ""
    """What kind of text it is, e.g. ``hard reasoning`` or ``predictable`` (diagnose compares them)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    in_distribution: bool = False
    """The set is drawn from the training distribution (e.g. ``reasoning_gym``: other seeds of the training
    generators). Its name must end in ``IN_DISTRIBUTION_SUFFIX`` so every table shows it, evaluation lists it after
    the out-of-distribution sets, and decontamination refuses only a verbatim training question in it, not shared
    template sentences (:mod:`data.corpora.decontamination`)."""
    half: str | None = None
    """``calib`` or ``report``: draw from that half of the source only (:func:`data.corpora.load_prompt_set`), so a
    setting chosen on the ``calib`` half is reported on other prompts; None: the whole source."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"prompt set {self.name}: n must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"prompt set {self.name}: max_new_tokens must be >= 1")
        if self.half not in (None, "calib", "report"):
            raise ValueError(f"prompt set {self.name}: half must be calib, report or null, not {self.half!r}")
        if self.in_distribution != self.name.endswith(IN_DISTRIBUTION_SUFFIX):
            raise ValueError(
                f"prompt set {self.name}: a set with in_distribution: true is named <name>{IN_DISTRIBUTION_SUFFIX} "
                f"(and only such a set), so reports show it; rename it or set in_distribution"
            )


@dataclass
class MethodSpec:
    """One drafting method."""

    name: str
    """Display name (``eagle3-chain``, ``prompt-lookup``, ``none`` ...)."""
    kind: MethodKind = "eagle3"
    """Which proposer."""
    mode: Literal["chain", "tree"] = "chain"
    """Chain or EAGLE-2 dynamic tree verification (trees: eagle3 only)."""
    chain_length: int = 6
    """Draft tokens per step (K) for chains; prompt lookup's draft length."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Tree shape when ``mode == "tree"``."""
    attention_window: int | None = None
    """eagle3 only: the drafter's attention window (:class:`serving.proposers.Eagle3ProposerConfig`: None its own,
    0 full attention, n > 0 a window of n tokens), so one run measures the same drafter at several windows."""

    def __post_init__(self) -> None:
        if self.chain_length < 1:
            raise ValueError(f"method {self.name}: chain_length (K) must be >= 1, got {self.chain_length}")
        if self.attention_window is not None and (self.kind != "eagle3" or self.attention_window < 0):
            raise ValueError(
                f"method {self.name}: attention_window is the EAGLE-3 drafter's (None, 0 for full attention or a "
                f"positive token count), not {self.attention_window} for a {self.kind} method"
            )
        if self.mode == "tree" and self.kind != "eagle3":
            raise ValueError(f"method {self.name}: tree drafting needs the eagle3 drafter")
        if isinstance(self.tree, dict):
            self.tree = TreeConfig(**self.tree)


def default_methods(
    chain_length: int = 6,
    tree: TreeConfig | None = None,
    with_tree: bool = True,
) -> list[MethodSpec]:
    methods = [MethodSpec("eagle3-chain", "eagle3", "chain", chain_length)]
    if with_tree:
        methods.append(MethodSpec("eagle3-tree", "eagle3", "tree", chain_length, tree or TreeConfig()))
    methods += [
        MethodSpec("prompt-lookup", "prompt-lookup", "chain", chain_length),
        MethodSpec("none", "none", "chain", 1),
    ]
    return methods


DRAFTER_CHAINS = ("eagle3-chain", "dflash-chain")
"""The trained drafter's chain method, by family: the one the engine agreement and K's choice read."""


def for_drafter(methods: list[MethodSpec], drafter: Eagle3Drafter | DFlashDrafter | None) -> list[MethodSpec]:
    """The methods as ``drafter``'s family runs them: for a DFlash block drafter the EAGLE-3 chain methods become
    ``dflash-chain`` (``eagle3-chain-k4`` -> ``dflash-chain-k4``) and its trees are dropped (it drafts chains)."""
    if not isinstance(drafter, DFlashDrafter):
        return methods
    out = []
    for m in methods:
        if m.kind != "eagle3":
            out.append(m)
        elif m.mode == "chain":
            name = m.name.replace("eagle3-chain", "dflash-chain", 1)
            out.append(MethodSpec(name, "dflash", "chain", m.chain_length))
    return out


def make_proposer(spec: MethodSpec, drafter: Eagle3Drafter | DFlashDrafter | None) -> Proposer:
    if spec.kind == "none":
        return NoProposer()
    if spec.kind == "prompt-lookup":
        return PromptLookupProposer(PromptLookupConfig(num_tokens=spec.chain_length))
    if drafter is None:
        raise ValueError(f"method {spec.name} needs a trained drafter")
    if (spec.kind == "dflash") != isinstance(drafter, DFlashDrafter):
        raise ValueError(
            f"method {spec.name} ({spec.kind}) cannot run a {type(drafter).__name__}: a DFlash drafter's chain is "
            "dflash-chain (eval.acceptance.for_drafter), an EAGLE-3 drafter's eagle3-chain / eagle3-tree"
        )
    if spec.kind == "dflash":
        return DFlashProposer(drafter, DFlashProposerConfig(spec.chain_length))
    cfg = Eagle3ProposerConfig(spec.chain_length, spec.tree, spec.attention_window)
    return Eagle3Proposer(drafter, cfg)


@dataclass
class PromptRecord:
    """One prompt under one method: what the intervals resample."""

    tokens: int
    """Tokens output (the first one, from prefill, included)."""
    emitted: int
    """Tokens emitted by verify steps (τ's numerator)."""
    steps: int
    """Verify steps (τ's denominator)."""
    seconds: float
    """End to end, prefill included (tokens/s's denominator)."""
    prompt: str = ""
    """The prompt's fingerprint (:func:`prompt_fingerprint`), so that results compared prompt by prompt can be
    checked to come from the same prompts ("": not recorded)."""
    output: str = ""
    """The fingerprint of the tokens output (:func:`prompt_fingerprint` of them): equal for two runs that decoded
    the very same sequence, so an engine's counts can be compared with the bundled loop's on the prompts where
    both verified the same tokens ("": not recorded)."""
    accepted_by_position: list[int] = field(default_factory=list)
    """Entry i: verify steps whose first i+1 draft tokens were accepted (per-position acceptance of this prompt
    is entry i over ``steps``)."""


def prompt_fingerprint(ids: list[int]) -> str:
    """A short hash of a prompt's token ids: equal for the same prompt, whichever run or method measured it."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


@dataclass
class SetMethodResult:
    """Aggregate of one prompt set under one method."""

    prompt_set: str
    method: str
    label: str
    prompts: int
    tokens: int
    steps: int
    tau: float
    acceptance_by_position: list[float]
    tokens_per_s: float
    decode_tokens_per_s: float
    mean_draft_ms: float
    mean_verify_ms: float
    mean_context: float
    mean_ttft_ms: float = float("nan")
    """Time to first token: prefill (target and the drafter's prompt rows) and the first token's choice."""
    speedup: float = float("nan")
    """End-to-end tokens/s over ``none`` on the same prompts."""
    match_rate: float = float("nan")
    """Greedy only: fraction of prompts whose output equals plain decoding's."""
    step_records: list[tuple[int, float, float, int, int]] = field(default_factory=list, repr=False)
    """(context_len, draft_s, verify_s, accepted, drafted) of every step, for plots and the throughput model."""
    prompt_steps: list[int] = field(default_factory=list, repr=False)
    """Steps of each prompt, in order: which of ``step_records`` belong to which prompt (intervals over prompts)."""
    per_prompt: list[PromptRecord] = field(default_factory=list, repr=False)
    """Each prompt's counts, in the set's prompt order (the same order under every method of a run)."""
    tau_ci: Interval | None = None
    """95% interval of ``tau`` (bootstrap over the set's prompts)."""
    tokens_per_s_ci: Interval | None = None
    """95% interval of ``tokens_per_s``."""
    speedup_ci: Interval | None = None
    """95% interval of ``speedup``, paired with the baseline on the same prompts."""

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_steps:
            d.pop("step_records")
            d.pop("prompt_steps")
        return d


@dataclass
class PairedComparison:
    """Two methods on the same prompts of one set (the same run): their differences, with paired 95% intervals."""

    prompt_set: str
    method: str
    against: str
    delta_tau: Interval
    """τ(method) - τ(against)."""
    speed_ratio: Interval
    """tokens/s(method) ÷ tokens/s(against)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: SetMethodResult, b: SetMethodResult) -> PairedComparison:
    """``a`` against ``b``, paired prompt by prompt (both must come from the same prompts, in the same order)."""
    pa, pb = a.per_prompt, b.per_prompt
    if a.prompt_set != b.prompt_set or len(pa) != len(pb):
        raise ValueError(f"{a.method} and {b.method} were not measured on the same prompts of one set")
    fa, fb = [p.prompt for p in pa], [p.prompt for p in pb]
    # where both runs recorded their prompts, they must be the same ones, in the same order
    if all(fa) and all(fb) and fa != fb:
        i = next(i for i, (x, y) in enumerate(zip(fa, fb)) if x != y)
        raise ValueError(
            f"{a.method} and {b.method} were not measured on the same prompts of {a.prompt_set}: prompt {i} differs"
        )
    delta = paired_ratio_difference(
        [p.emitted for p in pa], [p.steps for p in pa], [p.emitted for p in pb], [p.steps for p in pb]
    )
    ratio = paired_ratio(
        [p.tokens for p in pa], [p.seconds for p in pa], [p.tokens for p in pb], [p.seconds for p in pb]
    )
    return PairedComparison(a.prompt_set, a.method, b.method, delta, ratio)


@dataclass
class AcceptanceResult:
    results: list[SetMethodResult]
    sampling: dict[str, Any]

    def get(self, prompt_set: str, method: str) -> SetMethodResult | None:
        return next((r for r in self.results if r.prompt_set == prompt_set and r.method == method), None)

    def comparisons(self) -> list[PairedComparison]:
        """Per set: every EAGLE-3 method against prompt lookup (does the drafter beat a drafter-free method?), and
        a chain at another K against the chain at the evaluated K."""
        out = []
        for r in self.results:
            if not r.method.startswith(("eagle3", "dflash")) or not r.per_prompt:
                continue
            chain = next((c for c in DRAFTER_CHAINS if r.method.startswith(f"{c}-k")), None)
            against = ["prompt-lookup"] + ([chain] if chain else [])
            for b in (self.get(r.prompt_set, m) for m in against):
                if b is not None and b.per_prompt:
                    out.append(compare(r, b))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampling": self.sampling,
            "results": [r.to_dict() for r in self.results],
            "comparisons": [c.to_dict() for c in self.comparisons()],
        }


def aggregate(prompt_set: str, method: str, label: str, runs: list[GenerationResult]) -> SetMethodResult:
    steps = [s for r in runs for s in r.steps]
    emitted = sum(s.num_emitted for s in steps)
    depth = max((s.draft_depth for s in steps), default=0)
    by_pos = []
    for i in range(1, depth + 1):
        tried = [s for s in steps if s.draft_depth >= i]
        by_pos.append(sum(s.num_accepted >= i for s in tried) / max(len(tried), 1))
    total_s = sum(r.total_s for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    n = max(len(steps), 1)
    per_prompt = [
        PromptRecord(
            len(r.tokens),
            sum(s.num_emitted for s in r.steps),
            len(r.steps),
            r.total_s,
            output=prompt_fingerprint(list(r.tokens)),
            accepted_by_position=[sum(s.num_accepted >= i for s in r.steps) for i in range(1, depth + 1)],
        )
        for r in runs
    ]
    return SetMethodResult(
        prompt_set=prompt_set,
        method=method,
        label=label,
        prompts=len(runs),
        tokens=sum(len(r.tokens) for r in runs),
        steps=len(steps),
        tau=emitted / n,
        acceptance_by_position=by_pos,
        tokens_per_s=sum(len(r.tokens) for r in runs) / total_s if total_s else 0.0,
        decode_tokens_per_s=emitted / decode_s if decode_s else 0.0,
        mean_draft_ms=1e3 * sum(s.draft_s for s in steps) / n,
        mean_verify_ms=1e3 * sum(s.verify_s for s in steps) / n,
        mean_context=sum(s.context_len for s in steps) / n,
        mean_ttft_ms=1e3 * sum(r.prefill_s for r in runs) / max(len(runs), 1),
        step_records=[(s.context_len, s.draft_s, s.verify_s, s.num_accepted, s.num_drafted) for s in steps],
        prompt_steps=[len(r.steps) for r in runs],
        per_prompt=per_prompt,
        tau_ci=ratio_interval([p.emitted for p in per_prompt], [p.steps for p in per_prompt]),
        tokens_per_s_ci=ratio_interval([p.tokens for p in per_prompt], [p.seconds for p in per_prompt]),
    )


def speedup_interval(method: SetMethodResult, base: SetMethodResult) -> Interval:
    """tokens/s of ``method`` over ``base``'s, paired on the same prompts (the same run, the same order)."""
    a, b = method.per_prompt, base.per_prompt
    return paired_ratio(
        [p.tokens for p in a], [p.seconds for p in a], [p.tokens for p in b], [p.seconds for p in b]
    )


@dataclass
class RunPlan:
    """What one acceptance run decodes: its methods and the target each decodes with."""

    methods: list[MethodSpec]
    targets: dict[str, Target]
    """Method name -> the target it decodes with."""


def plan_run(methods: list[MethodSpec], target: Target, baseline: Target | None, greedy: bool) -> RunPlan:
    """``methods`` on ``target``, except plain decoding on ``baseline`` (when given and another target); then,
    under greedy decoding, plain decoding on ``target`` as well (:data:`REFERENCE`), the output to match."""
    targets = {m.name: target for m in methods}
    if baseline is None or baseline is target or BASELINE not in targets:
        return RunPlan(list(methods), targets)
    targets[BASELINE] = baseline
    if not greedy:  # sampled outputs are compared in distribution, not token for token: no reference
        return RunPlan(list(methods), targets)
    targets[REFERENCE] = target
    return RunPlan([*methods, MethodSpec(REFERENCE, "none", "chain", 1)], targets)


def method_order(methods: list[MethodSpec], prompt_index: int) -> list[MethodSpec]:
    """The order prompt number ``prompt_index`` (counted over the whole run) runs the methods in: rotated by one
    per prompt, so no method always runs first or last."""
    k = prompt_index % len(methods)
    return methods[k:] + methods[:k]


def run_acceptance(
    target: Target,
    drafter: Eagle3Drafter | None,
    prompt_sets: dict[str, tuple[PromptSetSpec, list[list[int]]]],
    methods: list[MethodSpec],
    sampling: SamplingConfig | None = None,
    warmup: bool = True,
    baseline: Target | None = None,
    share_prefill: bool = True,
    prefill_across_copies: bool = False,
) -> AcceptanceResult:
    """Generate every prompt of every set with every method; see the module docstring.

    prompt_sets: name -> (spec, token-id prompts). baseline: the target plain decoding (``none``) is timed on
    (None: ``target``). share_prefill: the methods on one target continue from one prefill of each prompt
    (same outputs and timings; False runs the target's prefill for every method, e.g. to time it each time).
    prefill_across_copies: with ``share_prefill``, the baseline's copy and ``target`` (same model and dtype) also
    continue from one prefill of each prompt (:class:`serving.loop.PrefillMemo`), the one the prompt's first
    method ran: one long prefill per prompt instead of two (``eyas context``).
    """
    sampling = sampling or SamplingConfig()
    if not prompt_sets or not any(p for _, p in prompt_sets.values()):
        raise ValueError("no evaluation prompts: give at least one non-empty prompt set")
    methods = for_drafter(methods, drafter)
    if not methods:
        raise ValueError("no drafting methods to evaluate")
    plan = plan_run(methods, target, baseline, sampling.greedy)
    proposers = {m.name: make_proposer(m, drafter) for m in plan.methods}
    # a target decoding one method only (the sdpa baseline) gains nothing from a kept copy of its prefill
    shared = Counter(id(t) for t in plan.targets.values())

    def memo_for(on: Target, memo: PrefillMemo | None) -> PrefillMemo | None:
        return memo if shared[id(on)] > 1 or prefill_across_copies else None

    def new_memo() -> PrefillMemo | None:
        return PrefillMemo(across_copies=prefill_across_copies) if share_prefill else None

    first = next(p for _, p in prompt_sets.values() if p)[0]
    memo = new_memo()
    for m in plan.methods:  # fail on a mismatched drafter before the long run, and warm every path up
        on = plan.targets[m.name]
        proposers[m.name].reset(torch.as_tensor(first), target=on.info, max_len=len(first) + 8)
        if warmup:
            generate(on, proposers[m.name], first, 8, sampling, mode=m.mode, prefill_memo=memo_for(on, memo))

    results: list[SetMethodResult] = []
    total = sum(len(p) for _, p in prompt_sets.values()) * len(plan.methods)
    bar = tqdm(total=total, desc="acceptance", unit="gen")
    index = 0
    for set_name, (spec, prompts) in prompt_sets.items():
        runs: dict[str, list[GenerationResult]] = {m.name: [] for m in plan.methods}
        for prompt in prompts:
            memo = new_memo()  # this prompt's only: the last one's is freed
            for m in method_order(plan.methods, index):
                on = plan.targets[m.name]
                runs[m.name].append(
                    generate(
                        on,
                        proposers[m.name],
                        prompt,
                        spec.max_new_tokens,
                        sampling,
                        mode=m.mode,
                        prefill_memo=memo_for(on, memo),
                    )
                )
                bar.update()
            index += 1
        done = set_results(set_name, spec.label, plan.methods, runs, sampling.greedy)
        marks = [prompt_fingerprint(p) for p in prompts]
        for r in done:
            for rec, mark in zip(r.per_prompt, marks):
                rec.prompt = mark
        results.extend(done)
    bar.close()
    return AcceptanceResult(results=results, sampling=asdict(sampling))


def set_results(
    set_name: str,
    label: str,
    methods: list[MethodSpec],
    runs: dict[str, list[GenerationResult]],
    greedy: bool,
) -> list[SetMethodResult]:
    """Each method's aggregate over one set, with its speedup over the baseline (paired on the same prompts)
    and, greedy, its match with the reference output (:data:`REFERENCE` where it ran, else the baseline's)."""
    out = [aggregate(set_name, m.name, label, runs[m.name]) for m in methods]
    base = next((r for r in out if r.method == BASELINE), None)
    ref = REFERENCE if REFERENCE in runs else BASELINE
    for r in out:
        if base is not None and base.tokens_per_s > 0:
            r.speedup = r.tokens_per_s / base.tokens_per_s
            r.speedup_ci = speedup_interval(r, base)
        if greedy and ref in runs:
            same = [a.tokens == b.tokens for a, b in zip(runs[r.method], runs[ref])]
            r.match_rate = sum(same) / len(same)
        log.info(
            "%s / %s: tau %.2f, %.1f tok/s (x%.2f), match %.2f",
            set_name,
            r.method,
            r.tau,
            r.tokens_per_s,
            r.speedup,
            r.match_rate,
        )
    return out
