"""τ against context length: ``eyas context`` (``python -m eyas.eval.context_sweep``, config ``conf/context.yaml``).

Each prompt is put after a long, real prefix (earlier chat turns of a corpus, :mod:`data.long_context`) at every
context length, and generated greedily with every method; the result is τ, acceptance per draft position, step
time and tokens/s per (method, length), a JSON of every number, a markdown table and one figure with τ(context),
step time(context) and tokens/s(context).

Design decisions:
- The generations are :func:`eval.acceptance.run_acceptance`'s (one prompt set per length), so the methods run
  interleaved on identical prompts and code paths, and greedy outputs are checked against plain decoding.
- Step time is the loop's own wall clock per verify step after prefill (draft + verify + bookkeeping), so
  tokens/s = τ ÷ step time holds exactly for the numbers shown; the measured context of each length is the mean
  context of its steps (prompt + tokens generated so far).
- The prefix comes from the corpus's held-out split by default, and each prompt gets a different one (``offset``).
- ``eval.diagnose`` reads the JSON written here (``diagnose.tau_context=<path>``) to price each length with the τ measured
  at that length.
- Drafter windows are methods of the sweep (``windows``): ``eagle3-chain-w512`` is the same drafter drafting with a
  512-token sliding window (``Eagle3ProposerConfig.attention_window``: the weights shared, its config untouched),
  measured on the same prompts, interleaved with the others and after the same prefill, so the curves of the
  drafter's own attention and of each window compare paired.
- Intervals: 95%, the seeded bootstrap over prompts of :mod:`eyas.eval.intervals` (:func:`bootstrap_intervals`).
- Context grown by the target's own answer (``answer_tokens``): the prompts of the shortest length are generated
  that long and each
  verify step is put in the bin of the largest length <= its context (points of ``kind="answer"``), beside the
  long-prefix points (``kind="prefix"``): reasoning traces are long because the model writes them.
- A serving engine beside the bundled loop (``engine: vllm``): the export is served by vLLM (or SGLang) and sent
  the very token-id prompts of every length after the bundled sweep; per length its τ, acceptance per position
  and :func:`eval.engine_eval.check_agreement`'s verdict against the bundled loop's ``eagle3-chain`` (the drafter
  as exported, with its own window: what the engine reads from ``sliding_window`` / ``layer_types``). So a window
  or a rope scaling the engine ignores at long context shows as a τ that parts from the bundled loop's there.
- ``check_target``: the target's own loss on real long text over its first and last ``loss_span`` tokens at the
  longest length (:func:`target_long_loss`), so a τ that falls with context is known to be the drafter's failure
  and not a target that cannot read that far (e.g. a rope-scaled target, ``target=smollm2_yarn``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.command import Command, command_line
from eyas.common import ConfigError, build_config, json_hash
from eyas.eval.acceptance import (
    REFERENCE,
    AcceptanceResult,
    MethodSpec,
    PromptSetSpec,
    default_methods,
    run_acceptance,
)
from eyas.eval.intervals import bootstrap
from eyas.serving.engine_process import ENGINES, EngineServerConfig, check_server_url
from eyas.serving.models.target import Target, TargetConfig
from eyas.serving.verify import SamplingConfig

log = logging.getLogger(__name__)

RESULT_FILE = "context.json"
ANSWER_SET = "answer"
"""The prompt set whose context grows by the target's own answer (``ContextConfig.answer_tokens``)."""
METHODS = ("eagle3-chain", "eagle3-tree", "prompt-lookup", "none")


@dataclass
class ContextConfig:
    """What ``eyas context`` measures (``conf/context.yaml``, group ``context``)."""

    export_dir: str | None = None
    """The exported drafter (``eyas export``'s directory; a trainer checkpoint also loads); None measures the
    drafter-free methods only."""
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 7168])
    """Context lengths: tokens of the prompt the target receives (prefix + prompt, chat template included)."""
    prompts: PromptSetSpec = field(
        default_factory=lambda: PromptSetSpec("mt_bench", "mt_bench", n=3, label="chat", max_new_tokens=64)
    )
    """The prompts put after the prefix (``n`` of them, ``max_new_tokens`` generated each)."""
    prefix_corpus: str = "demo"
    """The mixture the drafter was trained on, whose (user, assistant) turns make the prefix: a ``conf/corpus``
    name, or the prepare directory the drafter's data came from (``<work_dir>/prepare/<hash>``: its
    ``corpus.json`` holds the mixture with its seed). Its own split is used (:func:`data.long_prefixes.turn_pairs`):
    a standalone corpus splits by another seed or eval fraction, so its held-out records can be training records
    of the mixture. ``demo`` and ``bench`` split ShareGPT alike (same seed and eval fraction)."""
    prefix_split: str = "eval"
    """Which split of it: ``eval`` (held out from training), ``train`` or ``all``."""
    prefix_conversations: int = 200
    """Conversations of the corpus the prefixes are drawn from."""
    methods: list[str] = field(default_factory=lambda: ["eagle3-chain", "prompt-lookup", "none"])
    """Which of ``eagle3-chain``, ``eagle3-tree``, ``prompt-lookup``, ``none`` (``none`` gives the speedup)."""
    chain_length: int = 6
    """K: draft tokens per step (chains and prompt lookup)."""
    seed: int = 0
    """Seeds the prompt choice."""
    threads: int | None = None
    """torch CPU threads (None: leave as is)."""
    windows: list[int | None] = field(default_factory=lambda: [None])
    """The drafter's attention windows, each measured as its own method in the one run: null its own
    (``DrafterConfig.attention_window``; method ``eagle3-chain``), n > 0 a sliding window of n tokens
    (``eagle3-chain-w<n>``), 0 full attention (``eagle3-chain-wfull``), e.g. ``[null, 512]``."""
    attention_window: int | None = None
    """Replaced by ``windows`` (several windows side by side in one run); anything but null is refused with the
    way to write it."""
    answer_tokens: int = 0
    """> 0: also generate the bare prompts this many tokens and report τ with the context grown by the target's
    own answer, binned by ``lengths`` (``kind="answer"``); 0: only long prefixes."""
    check_target: bool = False
    """Also report the target's loss on real long text over its first and last ``loss_span`` tokens at the longest
    length (the target's own long-context quality)."""
    loss_span: int = 1024
    """Tokens at each end of the text ``check_target`` scores."""
    bootstrap: int = 1000
    """Bootstrap resamples over prompts for the 95% intervals of τ and tokens/s (0: none)."""
    dtype: str = "auto"
    """The numerics, as ``eval.dtype`` (:meth:`eval.stage.EvalStageConfig.numerics`). ``auto`` on a CPU with bf16
    units: the speculative methods decode in bf16 with row-exact attention where the exactness probe passes (their
    greedy output must equal plain decoding's on the same numerics, the ``greedy match`` column), plain decoding
    (``none``, the speedup baseline) is timed on bf16 ``sdpa``, its fastest; both copies continue from one prefill
    per prompt (``one_prefill``). ``target``: every method on the loaded target's numerics, one prefill per prompt; in bf16
    a multi-row verify then rounds otherwise than one-token decoding, so greedy outputs part at near-ties and the
    match column measures numerics, not losslessness."""
    one_prefill: bool = True
    """With two numerics copies (``dtype: auto``): both continue from one prefill of each prompt, the one its
    first method ran (:class:`serving.loop.PrefillMemo` ``across_copies``); a prefill at 32k tokens takes minutes
    on a CPU. Decoding keeps each copy's numerics, and the match column compares methods that start from the
    same state. false: each copy runs its own prefill."""
    engine: str = "bundled"
    """``vllm`` or ``sglang``: also serve ``export_dir`` in that engine (started from its venv, ``make vllm``) and
    send it the same prompts at every length; its τ, acceptance per position and agreement with the bundled loop's
    ``eagle3-chain`` per length (``engine`` in the result). ``bundled``: the bundled loop only."""
    server_url: str | None = None
    """A running engine server to send the prompts to instead of starting one (needs ``engine``)."""
    server: EngineServerConfig = field(default_factory=EngineServerConfig)
    """How eyas starts the engine (as ``eval.server``); a ``max_model_len`` too small for the longest length and
    its new tokens is raised to fit."""
    out_dir: str = "runs/context"
    """Results go to ``<out_dir>/<hash of the settings, drafter and target>/``."""

    def __post_init__(self) -> None:
        if isinstance(self.prompts, dict):
            self.prompts = build_config(PromptSetSpec, self.prompts, "context.prompts")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"context.lengths must be positive token counts, got {self.lengths}")
        self.lengths = sorted(set(int(n) for n in self.lengths))
        if self.dtype not in ("auto", "target", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"context.dtype must be auto, target, bfloat16, float16 or float32 (as eval.dtype), not {self.dtype!r}"
            )
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"context.methods: unknown {bad} (known: {list(METHODS)})")
        if self.chain_length < 1:
            raise ValueError(f"context.chain_length (K) must be >= 1, got {self.chain_length}")
        if self.attention_window is not None:
            raise ValueError(
                f"context.attention_window is now context.windows, each window a method of one run: write "
                f"context.windows=[{self.attention_window}] (or [null,{self.attention_window}] to measure the "
                "drafter's own attention beside it)"
            )
        self.windows = list(self.windows)
        bad = [w for w in self.windows if w is not None and (not isinstance(w, int) or w < 0)]
        if bad or not self.windows or len(set(self.windows)) < len(self.windows):
            raise ValueError(
                f"context.windows must be distinct entries of null (the drafter's own), 0 (full attention) or a "
                f"positive token count, e.g. [null,512]; got {self.windows}"
            )
        if isinstance(self.server, dict):
            self.server = build_config(EngineServerConfig, self.server, "context.server")
        if self.engine not in ENGINES:
            raise ValueError(f"context.engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.engine != "bundled":
            if "eagle3-chain" not in self.methods or None not in self.windows:
                raise ValueError(
                    f"context.engine={self.engine} is compared with the bundled loop's eagle3-chain as exported: "
                    f"context.methods must hold eagle3-chain and context.windows null (got {self.methods}, "
                    f"{self.windows})"
                )
            if self.server_url:
                check_server_url(self.server_url, "context.server_url")
        elif self.server_url:
            raise ValueError(
                "context.server_url needs context.engine=vllm or context.engine=sglang (which server it is)"
            )
        if self.answer_tokens < 0 or self.loss_span < 1 or self.bootstrap < 0:
            raise ValueError(
                "context.answer_tokens and context.bootstrap must be >= 0, context.loss_span >= 1"
            )


@dataclass
class ContextJob:
    """What ``python -m eyas.eval.context_sweep`` runs (:func:`run`)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    context: ContextConfig = field(default_factory=ContextConfig)


@dataclass
class ContextPoint:
    """One (method, context length)."""

    method: str
    length: int
    """Nominal context length."""
    mean_context: float
    """Mean context of the verify steps (prompt + tokens generated so far)."""
    prompt_tokens: float
    """Mean prompt length (prefix + prompt)."""
    tau: float
    acceptance_by_position: list[float]
    step_ms: float
    """Wall clock per verify step after prefill (draft + verify + the loop's own work)."""
    draft_ms: float
    verify_ms: float
    tokens_per_s: float
    """τ ÷ step time."""
    speedup: float
    """tokens/s over ``none`` at the same length (NaN without ``none``)."""
    match_rate: float
    """Share of prompts whose output equals plain decoding's (greedy: must be 1)."""
    steps: int
    chain_length: int = 0
    """K the method drafted with (0: ``none``)."""
    accepted: list[int] = field(default_factory=list)
    """Tokens accepted at each verify step (what ``eval.diagnose`` prices with its own step costs)."""
    drafted: list[int] = field(default_factory=list)
    """Tokens drafted at each verify step."""
    kind: str = "prefix"
    """``prefix``: the context is a long real prefix before the prompt; ``answer``: the target's own answer."""
    tau_ci: list[float] = field(default_factory=list)
    """95% bootstrap interval of τ over prompts ([lo, hi]; empty with fewer than two prompts)."""
    tokens_per_s_ci: list[float] = field(default_factory=list)
    """95% bootstrap interval of tokens/s over prompts (τ and draft+verify time per step resampled together)."""
    attention_window: int | None = None
    """The sliding window the drafter drafted with (None: full attention, and the drafter-free methods)."""


@dataclass
class LongTextLoss:
    """The target's cross-entropy (nats/token) on one real long text, at its start and at its end."""

    tokens: int
    first: float
    """Mean loss over the first ``span`` predicted tokens."""
    last: float
    """Mean loss over the last ``span`` tokens (reading everything before them)."""
    span: int


@dataclass
class EngineContextPoint:
    """The export inside a serving engine at one context length, beside the bundled loop on the same prompts."""

    length: int
    engine: str
    tau: float
    """The engine's τ over the length's prompts (its spec-decode counters: 1 + accepted drafts per draft step)."""
    tau_ci: list[float]
    acceptance_by_position: list[float]
    tokens_per_s: float
    """Completion tokens over request wall time (the prefill of the long prompt included)."""
    verdict: str
    """:func:`eval.engine_eval.check_agreement` against the bundled ``eagle3-chain`` at this length."""
    reasons: list[str]
    basis: str
    """Which prompts the verdict was judged on (``same outputs`` or ``all prompts``)."""
    same_outputs: int
    prompts: int
    tau_engine_judged: float
    tau_bundled_judged: float
    """τ of each side over the judged prompts, both counted as the engine counts (1 + accepted per step)."""
    acceptance_engine_judged: list[float]
    acceptance_bundled_judged: list[float]


@dataclass
class ContextResult:
    points: list[ContextPoint]
    config: dict[str, Any]
    target: dict[str, Any]
    out: Path
    seconds: float
    target_loss: LongTextLoss | None = None
    engine: list[EngineContextPoint] = field(default_factory=list)
    """Per length, the export inside ``context.engine`` beside the bundled loop (empty for ``bundled``)."""

    def get(self, method: str, length: int) -> ContextPoint | None:
        return next((p for p in self.points if p.method == method and p.length == length), None)

    def tau_by_length(self, method: str) -> dict[int, float]:
        return {p.length: p.tau for p in self.points if p.method == method}

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [asdict(p) for p in self.points],
            "config": self.config,
            "target": self.target,
            "seconds": self.seconds,
            "target_loss": None if self.target_loss is None else asdict(self.target_loss),
            "engine": [asdict(e) for e in self.engine],
        }


def build_context_prompts(cfg: ContextConfig, tokenizer) -> dict[int, list[list[int]]]:
    """Length -> token-id prompts: each prompt of ``cfg.prompts`` after a real prefix reaching that length."""
    from eyas.data.long_prefixes import pad_to_context, turn_pairs
    from eyas.eval.prompts import prompt_messages

    pairs = turn_pairs(cfg.prefix_corpus, cfg.prefix_conversations, cfg.prefix_split)
    msgs = prompt_messages(cfg.prompts, cfg.seed)
    return {
        length: [pad_to_context(m, pairs, tokenizer, length, offset=7 * i) for i, m in enumerate(msgs)]
        for length in cfg.lengths
    }


def points_from(
    acc: AcceptanceResult, prompts: dict[int, list[list[int]]], chain_length: int, bootstrap: int = 0
) -> list[ContextPoint]:
    """One :class:`ContextPoint` per long-prefix result of the acceptance run (its prompt sets are named by
    length; the ``answer`` set is :func:`answer_points`'s)."""
    out = []
    for r in acc.results:
        if r.prompt_set == ANSWER_SET:
            continue
        length = int(r.prompt_set)
        steps = max(r.steps, 1)
        step_s = r.tau / r.decode_tokens_per_s if r.decode_tokens_per_s else float("nan")
        ps = prompts[length]
        tau_ci, tps_ci = bootstrap_intervals(r.step_records, r.prompt_steps, r.decode_tokens_per_s, bootstrap)
        out.append(
            ContextPoint(
                method=r.method,
                length=length,
                mean_context=r.mean_context,
                prompt_tokens=sum(len(p) for p in ps) / len(ps),
                tau=r.tau,
                acceptance_by_position=r.acceptance_by_position,
                step_ms=1e3 * step_s,
                draft_ms=r.mean_draft_ms,
                verify_ms=r.mean_verify_ms,
                tokens_per_s=r.decode_tokens_per_s,
                speedup=_speedup(acc, r.prompt_set, r.decode_tokens_per_s),
                match_rate=r.match_rate,
                steps=steps,
                chain_length=0 if r.method == "none" else chain_length,
                accepted=[rec[3] for rec in r.step_records],
                drafted=[rec[4] for rec in r.step_records],
                tau_ci=tau_ci,
                tokens_per_s_ci=tps_ci,
            )
        )
    return out


def _per_prompt(records: list, prompt_steps: list[int]) -> list[list]:
    out, i = [], 0
    for n in prompt_steps:
        out.append(records[i : i + n])
        i += n
    return out


def bootstrap_intervals(
    records: list, prompt_steps: list[int], tokens_per_s: float, resamples: int, seed: int = 0
) -> tuple[list[float], list[float]]:
    """95% percentile intervals of τ and tokens/s over prompts drawn with replacement (seeded). A step emits its
    accepted tokens + 1; tokens/s scales the measured one by each resample's tokens per second of draft + verify
    time against the whole set's. Empty lists without resamples or with fewer than two prompts."""
    groups = [g for g in _per_prompt(records, prompt_steps) if g]
    if resamples <= 0 or len(groups) < 2:
        return [], []
    emitted = np.array([sum(r[3] + 1 for r in g) for g in groups], dtype=float)
    steps = np.array([len(g) for g in groups], dtype=float)
    busy = np.array([sum(r[1] + r[2] for r in g) for g in groups], dtype=float)
    n = len(groups)
    tau = bootstrap(lambda i: emitted[i].sum(-1) / steps[i].sum(-1), n, seed=seed, resamples=resamples)
    rate = bootstrap(lambda i: emitted[i].sum(-1) / busy[i].sum(-1), n, seed=seed, resamples=resamples)
    scale = tokens_per_s / max(rate.estimate, 1e-12)  # the measured tokens/s at the whole set's rate
    return [tau.low, tau.high], [rate.low * scale, rate.high * scale]


def answer_points(
    acc: AcceptanceResult, lengths: list[int], chain_length: int, bootstrap: int
) -> list[ContextPoint]:
    """τ with the context grown by the target's own answer: the ``answer`` set's verify steps binned by the
    largest of ``lengths`` <= their context. Step time here is draft + verify (no loop bookkeeping)."""
    edges = sorted(lengths)
    out: list[ContextPoint] = []
    for r in (x for x in acc.results if x.prompt_set == ANSWER_SET):
        groups = _per_prompt(r.step_records, r.prompt_steps)
        for i, lo in enumerate(edges):
            hi = edges[i + 1] if i + 1 < len(edges) else float("inf")
            binned = [[s for s in g if lo <= s[0] < hi] for g in groups]
            recs = [s for g in binned for s in g]
            if not recs:
                continue
            n = len(recs)
            tau = sum(s[3] + 1 for s in recs) / n
            step_s = sum(s[1] + s[2] for s in recs) / n
            depth = max(s[4] for s in recs)
            by_pos = [
                sum(s[3] >= k for s in recs if s[4] >= k) / max(sum(s[4] >= k for s in recs), 1)
                for k in range(1, depth + 1)
            ]
            tps = tau / step_s if step_s else float("nan")
            tau_ci, tps_ci = bootstrap_intervals(recs, [len(g) for g in binned], tps, bootstrap)
            out.append(
                ContextPoint(
                    method=r.method,
                    length=lo,
                    mean_context=sum(s[0] for s in recs) / n,
                    prompt_tokens=float("nan"),
                    tau=tau,
                    acceptance_by_position=by_pos,
                    step_ms=1e3 * step_s,
                    draft_ms=1e3 * sum(s[1] for s in recs) / n,
                    verify_ms=1e3 * sum(s[2] for s in recs) / n,
                    tokens_per_s=tps,
                    speedup=float("nan"),
                    match_rate=r.match_rate,
                    steps=n,
                    chain_length=0 if r.method == "none" else chain_length,
                    accepted=[s[3] for s in recs],
                    drafted=[s[4] for s in recs],
                    kind="answer",
                    tau_ci=tau_ci,
                    tokens_per_s_ci=tps_ci,
                )
            )
    base = {p.length: p.tokens_per_s for p in out if p.method == "none"}
    for p in out:
        p.speedup = p.tokens_per_s / base[p.length] if base.get(p.length) else float("nan")
    return out


def _speedup(acc: AcceptanceResult, prompt_set: str, tokens_per_s: float) -> float:
    base = acc.get(prompt_set, "none")
    return tokens_per_s / base.decode_tokens_per_s if base and base.decode_tokens_per_s else float("nan")


def window_suffix(window: int | None) -> str:
    """The method-name suffix of a drafter window (``ContextConfig.windows``)."""
    return "" if window is None else "-wfull" if window == 0 else f"-w{window}"


def split_window(method: str) -> tuple[str, int | None]:
    """``eagle3-chain-w512`` -> (``eagle3-chain``, 512); ``-wfull`` -> (base, 0); no suffix -> (method, None)
    (the inverse of :func:`window_suffix`)."""
    m = re.fullmatch(r"(.+)-w(full|[1-9][0-9]*)", method)
    if not m:
        return method, None
    return m.group(1), 0 if m.group(2) == "full" else int(m.group(2))


def sweep_methods(cfg: ContextConfig) -> list[MethodSpec]:
    """``cfg.methods`` at K = ``cfg.chain_length``, each EAGLE-3 method once per entry of ``cfg.windows``."""
    out = []
    for m in default_methods(cfg.chain_length):
        if m.name not in cfg.methods:
            continue
        if m.kind != "eagle3":
            out.append(m)
            continue
        out += [replace(m, name=m.name + window_suffix(w), attention_window=w) for w in cfg.windows]
    return out


@dataclass
class SweepNumerics:
    """The targets a sweep decodes with (``ContextConfig.dtype``)."""

    verify: Target
    """The speculative methods' and the greedy reference's."""
    baseline: Target | None
    """Plain decoding's, when it differs from ``verify`` (None: ``verify``)."""
    note: str
    """One line saying which numerics and why (printed in the report)."""


def sweep_numerics(target: Target, cfg: ContextConfig) -> SweepNumerics:
    """The evaluation's own choice of numerics (:meth:`eval.stage.EvalStageConfig.numerics`) for ``cfg``'s methods,
    or the loaded target for all of them (``dtype: target``)."""
    from eyas.eval.stage import EvalStageConfig

    if cfg.dtype == "target":
        note = f"{target.dtype} with {target.attention} attention for every method (context.dtype=target)"
        return SweepNumerics(target, None, note)
    ecfg = EvalStageConfig(
        prompt_sets=[cfg.prompts], dtype=cfg.dtype, chain_length=cfg.chain_length, methods=list(cfg.methods)
    )
    n = ecfg.numerics(target)
    return SweepNumerics(n.verify, None if n.baseline is n.verify else n.baseline, n.note)


def length_sets(
    cfg: ContextConfig, prompts: dict[int, list[list[int]]]
) -> dict[str, tuple[PromptSetSpec, list]]:
    """One prompt set per context length, named by the length (what the bundled loop and the engine both run)."""
    spec = cfg.prompts
    return {
        str(n): (PromptSetSpec(str(n), spec.source, len(ps), spec.label, spec.max_new_tokens), ps)
        for n, ps in prompts.items()
    }


def measure(
    target: Target,
    drafter,
    prompts: dict[int, list[list[int]]],
    cfg: ContextConfig,
    baseline: Target | None = None,
) -> tuple[list[ContextPoint], AcceptanceResult]:
    """Generate every prompt at every length with every method of ``cfg``; one point per (method, length), and
    per (method, length bin) of the target's own long answers when ``cfg.answer_tokens`` is set, with the
    acceptance run they come from. ``target`` decodes the speculative methods, ``baseline`` (when given) plain
    decoding."""
    methods = sweep_methods(cfg)
    spec = cfg.prompts
    sets = length_sets(cfg, prompts)
    if cfg.answer_tokens:  # the prompts at the shortest length, answered at length
        bare = prompts[min(prompts)]
        sets[ANSWER_SET] = (
            PromptSetSpec(ANSWER_SET, spec.source, len(bare), spec.label, cfg.answer_tokens),
            bare,
        )
    acc = run_acceptance(
        target,
        drafter,
        sets,
        methods,
        SamplingConfig(),
        baseline=baseline,
        prefill_across_copies=cfg.one_prefill,
    )
    points = points_from(acc, prompts, cfg.chain_length, cfg.bootstrap) + answer_points(
        acc, cfg.lengths, cfg.chain_length, cfg.bootstrap
    )
    # plain decoding on the speculative methods' numerics ran only as their greedy reference (the match column)
    points = [p for p in points if p.method != REFERENCE]
    own = None if drafter is None else drafter.config.attention_window
    window = {  # what each drafting method's drafter attended over (None: everything)
        m.name: own if m.attention_window is None else (m.attention_window or None)
        for m in methods
        if m.kind == "eagle3"
    }
    for p in points:
        p.attention_window = window.get(p.method)
    return points, acc


def measure_engine(
    job: ContextJob, prompts: dict[int, list[list[int]]], acc: AcceptanceResult, out: Path
) -> list[EngineContextPoint]:
    """Every length's prompts inside ``context.engine`` (at ``server_url``, else a server eyas starts with the
    target and the export, log ``<out>/engine_server.log``), each length judged against the bundled loop's
    ``eagle3-chain`` on the same prompts (:func:`eval.engine_eval.check_agreement`)."""
    from eyas.eval.engine_eval import EngineClient, check_agreement
    from eyas.eval.engine_eval import measure as engine_measure
    from eyas.serving.engine_process import engine_server
    from eyas.serving.models.target import model_source

    cfg = job.context
    sets = length_sets(cfg, prompts)
    server = engine_server_config(cfg, prompts)
    if cfg.server_url:
        client = EngineClient(cfg.server_url, cfg.engine, server.request_timeout_s)
        results = engine_measure(client, sets)
    else:
        if not cfg.export_dir:
            raise ConfigError(f"context.engine={cfg.engine} serves context.export_dir: set it")
        out.mkdir(parents=True, exist_ok=True)
        with engine_server(
            cfg.engine,
            model_source(job.target)[0],
            str(Path(cfg.export_dir).resolve()),
            cfg.chain_length,
            server,
            out / "engine_server.log",
            cuda=torch.cuda.is_available(),
            threads=cfg.threads,
        ) as srv:
            client = EngineClient(srv.url, cfg.engine, server.request_timeout_s, model=srv.model)
            results = engine_measure(client, sets)
    points = []
    for r in results:
        bundled = acc.get(r.prompt_set, "eagle3-chain")
        if bundled is None:  # measure() ran eagle3-chain on every length (ContextConfig checks the methods)
            raise RuntimeError(f"no bundled eagle3-chain result at context {r.prompt_set}")
        a = check_agreement(r, bundled)
        ci = r.tau_ci
        points.append(
            EngineContextPoint(
                length=int(r.prompt_set),
                engine=r.engine,
                tau=r.tau,
                tau_ci=[ci.low, ci.high] if ci is not None and ci.defined else [],
                acceptance_by_position=list(r.acceptance_by_position),
                tokens_per_s=r.tokens_per_s,
                verdict=a.verdict,
                reasons=list(a.reasons),
                basis=a.basis,
                same_outputs=a.same_outputs,
                prompts=a.prompts,
                tau_engine_judged=a.tau_engine,
                tau_bundled_judged=a.tau_bundled,
                acceptance_engine_judged=list(a.acceptance_engine),
                acceptance_bundled_judged=list(a.acceptance_bundled),
            )
        )
        log.info(
            "%s at context %s: tau %.3f (bundled %.3f on %s), %s", r.engine, r.prompt_set, r.tau, bundled.tau,
            a.basis, a.verdict,
        )  # fmt: skip
    return points


def engine_server_config(cfg: ContextConfig, prompts: dict[int, list[list[int]]]) -> EngineServerConfig:
    """``cfg.server`` with a ``max_model_len`` that holds the longest prompt, its new tokens and a last draft."""
    need = (
        max(len(p) for ps in prompts.values() for p in ps) + cfg.prompts.max_new_tokens + cfg.chain_length + 1
    )
    if cfg.server.max_model_len >= need:
        return cfg.server
    log.info(
        "context.server.max_model_len %d raised to %d (the longest prompt and its answer)",
        cfg.server.max_model_len,
        need,
    )
    return replace(cfg.server, max_model_len=need)


@torch.inference_mode()
def target_long_loss(target: Target, ids: list[int], span: int = 1024) -> LongTextLoss:
    """The target's loss on ``ids`` (one real long text) over its first and last ``span`` predicted tokens; the
    logits are computed at those rows only (a 32k x 49k fp32 logit matrix would be 6 GB)."""
    x = torch.tensor(ids, device=target.device)[None]
    span = min(span, (len(ids) - 1) // 2)
    if span < 1:
        raise ValueError(f"a text of {len(ids)} tokens is too short to score its first and last tokens")
    rows = torch.cat([torch.arange(span), torch.arange(len(ids) - 1 - span, len(ids) - 1)]).to(x.device)
    logits = target.forward(x, logits=rows).logits[0]  # [2 * span, V] fp32
    nll = torch.nn.functional.cross_entropy(logits, x[0, rows + 1], reduction="none")
    return LongTextLoss(len(ids), float(nll[:span].mean()), float(nll[span:].mean()), span)


def long_text(cfg: ContextConfig, tokenizer, length: int) -> list[int]:
    """Real long text for :func:`target_long_loss`: held-out turn pairs of ``prefix_corpus`` joined under the chat
    template up to ``length`` tokens (the prefixes the sweep uses, a different rotation)."""
    from eyas.data.long_prefixes import pad_to_context, turn_pairs

    pairs = turn_pairs(cfg.prefix_corpus, cfg.prefix_conversations, cfg.prefix_split)
    ask = [{"role": "user", "content": "Summarize the conversation above."}]
    return pad_to_context(ask, pairs, tokenizer, length, offset=3)


def run(
    job: ContextJob,
    target: Target | None = None,
    command: str = "",
    drafter=None,
    prompts: dict[int, list[list[int]]] | None = None,
) -> ContextResult:
    """Measure every method at every length (see the module docstring); writes JSON, markdown and the figure.
    The target is loaded, the drafter loaded from ``context.export_dir`` and the prompts built unless given."""
    from eyas.serving.load import load_target_for_drafter

    cfg = job.context
    if drafter is None and cfg.export_dir is None and any(m.startswith("eagle3") for m in cfg.methods):
        raise ConfigError(
            "context.export_dir is not set: give the exported drafter (context.export_dir=<dir>), or "
            "measure without it (context.methods=[prompt-lookup,none])"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = target if target is not None else load_target_for_drafter(job.target, cfg.export_dir)
    limit = int(target.model.config.get_text_config().max_position_embeddings)
    room = cfg.prompts.max_new_tokens + 2 * cfg.chain_length + 2
    too_long = [n for n in cfg.lengths if n + room > limit]
    if too_long:
        raise ConfigError(
            f"context.lengths {too_long} leave no room for {cfg.prompts.max_new_tokens} new tokens in the "
            f"target's window of {limit}"
        )
    t0 = time.perf_counter()
    if drafter is None and cfg.export_dir:
        from eyas.serving.load import load_drafter

        drafter = load_drafter(cfg.export_dir, target).drafter
    out = Path(cfg.out_dir) / json_hash(
        {
            "context": asdict(cfg),
            "drafter": str(Path(cfg.export_dir).resolve()) if cfg.export_dir else None,
            "target": target.info.to_dict(),
        }
    )
    if prompts is None:
        prompts = build_context_prompts(cfg, target.tokenizer)
    for length, ps in prompts.items():
        log.info("context %d: prompts of %s tokens", length, [len(p) for p in ps])
    loss = None
    if cfg.check_target:
        loss = target_long_loss(target, long_text(cfg, target.tokenizer, max(cfg.lengths)), cfg.loss_span)
        log.info(
            "target loss on %d tokens of real text: first %d %.3f, last %d %.3f nats/token",
            loss.tokens,
            loss.span,
            loss.first,
            loss.span,
            loss.last,
        )
    numerics = sweep_numerics(target, cfg)
    log.info("numerics: %s", numerics.note)
    points, acc = measure(numerics.verify, drafter, prompts, cfg, numerics.baseline)
    engine = measure_engine(job, prompts, acc, out) if cfg.engine != "bundled" else []
    result = ContextResult(
        points=points,
        config={
            **json.loads(json.dumps(asdict(cfg), default=str)),
            "command": command,
            "numerics": numerics.note,
        },
        target=target.info.to_dict(),
        out=out,
        seconds=time.perf_counter() - t0,
        target_loss=loss,
        engine=engine,
    )
    write_report(result)
    return result


# -- report --------------------------------------------------------------------------------------------------------
def markdown_table(result: ContextResult) -> str:
    lines = [
        "| method | context grown by | context (mean) | τ [95%] | acceptance per position | step ms | draft ms "
        "| tokens/s [95%] | speedup | greedy match |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(result.points, key=lambda p: (p.kind, p.method, p.length)):
        acc = " ".join(f"{a:.2f}" for a in p.acceptance_by_position)
        lines.append(
            f"| {p.method} | {p.kind} | {p.length} ({p.mean_context:.0f}) | {p.tau:.2f} {_ci(p.tau_ci, 2)} | {acc} "
            f"| {p.step_ms:.1f} | {p.draft_ms:.1f} | {p.tokens_per_s:.1f} {_ci(p.tokens_per_s_ci, 1)} "
            f"| {p.speedup:.2f}× | {p.match_rate:.0%} |"
        )
    if result.engine:
        lines += ["", engine_table(result)]
    loss = result.target_loss
    if loss is not None:
        lines += [
            "",
            f"Target loss on {loss.tokens} tokens of held-out text: first {loss.span} tokens {loss.first:.3f}, "
            f"last {loss.span} tokens {loss.last:.3f} nats/token.",
        ]
    return "\n".join(lines)


def engine_table(result: ContextResult) -> str:
    """The export inside the serving engine beside the bundled loop's ``eagle3-chain``, per length."""
    bundled = {p.length: p for p in result.points if p.method == "eagle3-chain" and p.kind == "prefix"}
    lines = [
        "| context | engine | τ engine, all prompts [95%] | τ bundled, all prompts | same output | τ engine / bundled, "
        "judged | acceptance per position engine / bundled, judged | verdict |",
        "|---:|---|---|---|---:|---|---|---|",
    ]
    for e in sorted(result.engine, key=lambda e: e.length):
        b = bundled.get(e.length)
        why = f" ({'; '.join(e.reasons)})" if e.reasons else ""
        acc = " ".join(f"{a:.2f}" for a in e.acceptance_engine_judged)
        bacc = " ".join(f"{a:.2f}" for a in e.acceptance_bundled_judged)
        b_tau = f"{b.tau:.2f} {_ci(b.tau_ci, 2)}" if b else "—"
        lines.append(
            f"| {e.length} | {e.engine} | {e.tau:.2f} {_ci(e.tau_ci, 2)} | {b_tau} | {e.same_outputs}/{e.prompts} "
            f"| {e.tau_engine_judged:.3f} / {e.tau_bundled_judged:.3f} ({e.basis}) | {acc} / {bacc} "
            f"| {e.verdict}{why} |"
        )
    return "\n".join(lines)


def _ci(ci: list[float], digits: int) -> str:
    return f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else ""


def plot(result: ContextResult, path: Path) -> Path:
    """τ(context), step time(context) and tokens/s(context) side by side, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    methods = list(dict.fromkeys((p.method, p.kind) for p in result.points))
    for ax, attr, ylabel in zip(
        axes, ("tau", "step_ms", "tokens_per_s"), ("τ (tokens per step)", "step time (ms)", "tokens/s")
    ):
        for m, kind in methods:
            pts = sorted(
                (p for p in result.points if (p.method, p.kind) == (m, kind)), key=lambda p: p.length
            )
            xs, ys = [p.mean_context for p in pts], [getattr(p, attr) for p in pts]
            label = m if kind == "prefix" else f"{m} (own answer)"
            style = "-" if kind == "prefix" else "--"
            ci = {"tau": "tau_ci", "tokens_per_s": "tokens_per_s_ci"}.get(attr)
            if ci and all(getattr(p, ci) for p in pts):
                err = [
                    [y - getattr(p, ci)[0] for p, y in zip(pts, ys)],
                    [getattr(p, ci)[1] - y for p, y in zip(pts, ys)],
                ]
                ax.errorbar(xs, ys, yerr=err, marker="o", linestyle=style, label=label, capsize=3)
            else:
                ax.plot(xs, ys, marker="o", linestyle=style, label=label)
        if attr == "tau" and result.engine:
            eng = sorted(result.engine, key=lambda e: e.length)
            mean = {p.length: p.mean_context for p in result.points if p.method == "eagle3-chain"}
            xs = [mean.get(e.length, e.length) for e in eng]
            ax.plot(
                xs, [e.tau for e in eng], marker="s", linestyle=":", label=f"{eng[0].engine}: eagle3-chain"
            )
        ax.set_xscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("τ, step time and tokens/s = τ ÷ step time against context length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result: ContextResult) -> Path:
    out = result.out
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
    fig = plot(result, out / "context.png")
    cmd = result.config.get("command", "")
    text = "\n".join(
        [
            "# eyas: τ against context length",
            "",
            f"`{cmd}`" if cmd else "",
            "",
            markdown_table(result),
            "",
            "τ = tokens per verify step (bonus included); step time = wall clock per verify step after prefill; "
            "tokens/s = τ ÷ step time; speedup over `none` at the same length.",
            "",
            f"Numerics: {result.config['numerics']}." if result.config.get("numerics") else "",
            "",
            f"![τ, step time and tokens/s against context]({fig.name})",
            "",
        ]
    )
    (out / "context.md").write_text(text)
    return out / "context.md"


def load_tau_context(path: str | Path) -> ContextResult:
    """A ``context.json`` written by :func:`run` (or the directory holding it)."""
    p = Path(path)
    p = p / RESULT_FILE if p.is_dir() else p
    if not p.exists():
        raise FileNotFoundError(f"{p}: no τ(context) results (write them with `eyas context`)")
    d = json.loads(p.read_text())
    points = [ContextPoint(**x) for x in d["points"]]
    loss = LongTextLoss(**d["target_loss"]) if d.get("target_loss") else None
    engine = [EngineContextPoint(**e) for e in d.get("engine", [])]
    return ContextResult(
        points, d.get("config", {}), d.get("target", {}), p.parent, d.get("seconds", 0.0), loss, engine
    )


# -- command ----------------------------------------------------------------------------------------------------------
def measure_context(job: ContextJob) -> None:
    res = run(job, command=command_line(COMMAND))
    print(markdown_table(res))
    print(f"report: {res.out / 'context.md'}")


COMMAND = Command(
    "context",
    "eyas.eval.context_sweep",
    "context",
    ContextJob,
    measure_context,
    renamed={"context.checkpoint": "context.export_dir"},
)
main = COMMAND.main


if __name__ == "__main__":
    main()
