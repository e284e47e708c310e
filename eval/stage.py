"""The evaluation stage: an exported drafter (the directory a user ships) against prompt lookup and plain decoding.

``python -m eyas.eval eval.export_dir=<exported drafter dir>``; the pipeline calls :func:`run` with its own export.
τ per prompt set and draft position, tokens/s, step time against context, a report with plots under
``<work_dir>/eval/<hash>`` (the hash of the export, the settings and the target).

Design decisions:
- Choose on one split, report on another: each set's ``calibration_prompts``, from its source's ``calib`` half and
  disjoint from its reported prompts, choose the chain length to serve (:mod:`eval.recommend`), and the reported
  prompts measure it.
- One interleaved run measures every reported method (the chosen K's chain included) against one baseline, so
  every speedup comes from the same minutes of the machine (:func:`eval.acceptance.run_acceptance`).
- A fair baseline: plain decoding is timed on its own fastest numerics (:class:`EvalNumerics`), the speculative
  methods on the numerics their greedy-match check needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.common import ConfigError, build_config, ensure_out_dir, json_hash
from eyas.eval.acceptance import (
    REFERENCE,
    AcceptanceResult,
    MethodSpec,
    PromptSetSpec,
    default_methods,
    run_acceptance,
)
from eyas.eval.engine_eval import EngineSetResult
from eyas.eval.profile import ProfileConfig, StepProfile, profile_steps
from eyas.eval.recommend import ChainLengthRecommendation, recommend_chain_length
from eyas.serving.engine_process import (
    ENGINES,
    EngineName,
    EngineServerConfig,
    check_server_answers,
    check_server_url,
    engine_python,
)
from eyas.serving.exactness import probe
from eyas.serving.models.dflash import DFlashDrafter
from eyas.serving.models.exact_attention import EXACT, MAX_ROWS
from eyas.serving.models.target import Target, TargetConfig, cpu_has_bf16, tokenizer_hash
from eyas.serving.target_record import check_target, check_tokenizer, choose_target
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig

log = logging.getLogger(__name__)


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
    calibration_prompts: int = 4
    """Prompts per set, from the source's ``calib`` half and disjoint from the reported ones
    (:func:`calibration_specs`), that choose the chain length to serve: the EAGLE-3 chain at ``chain_length`` runs
    on them and the step profile prices every shorter chain (:mod:`eval.recommend`). 0: no recommendation (the K is
    never chosen on the prompts it is reported on)."""
    measure_best_k: bool = True
    """When the calibration split recommends a chain length other than ``chain_length``, also run the EAGLE-3
    chain at that K on the reported prompts, in the same interleaved run (method ``eagle3-chain-k<K>``): the
    report then shows measured, not predicted, tokens/s at the K to serve."""
    threads: int | None = None
    """torch CPU threads during evaluation, and the CPU engine server's OMP_NUM_THREADS (None: leave as is)."""
    dtype: str = "auto"
    """Target numerics of the speculative methods. ``auto`` on CPU: bfloat16 with row-exact attention
    (:mod:`eyas.serving.models.exact_attention`) where the CPU has bf16 units and a probe finds every verify row (of
    every width the evaluation verifies) bitwise equal to one-token decoding, so greedy chain output must equal
    plain decoding's token for token (a mismatch is a bug) while a multi-token verify costs what it costs in
    serving (7 tokens ~1.1x one; in fp32 on a small CPU ~1.9x, compute-bound); float32 otherwise. ``auto``
    elsewhere: the loaded target's dtype and attention (bf16 on GPU, where near-tie divergence is expected). Or
    ``bfloat16``, ``float16``, ``float32``, ``target`` (the loaded target's, whatever it is), with the target's
    attention. Plain decoding, the baseline, is timed on its own fastest numerics (:meth:`baseline_target`)."""
    export_dir: str | None = None
    """``python -m eyas.eval``: the exported drafter to evaluate (``eyas export``'s SGLang/vLLM directory, what a
    user ships); the bundled loop also reads a trainer checkpoint (:func:`serving.load.load_drafter`). The
    pipeline sets its own."""
    engine: EngineName = "bundled"
    """``bundled``: eyas's own serving loop only. ``vllm`` / ``sglang``: also measure the same prompts inside that
    engine (:mod:`eval.engine`; started from ``make vllm``'s venv unless ``server_url`` is given)."""
    server_url: str | None = None
    """A running engine server (``http://host:port``) to measure instead of starting one; read-only: eyas only
    sends prompts and reads its counters. Needs ``engine`` to say which engine it is."""
    server_model: str | None = None
    """With ``server_url``: the model to send prompts to (None: the server's only model; a server listing several
    needs it named)."""
    server: EngineServerConfig = field(default_factory=EngineServerConfig)
    """How eyas starts the engine server (interpreter, timeouts, dtype, extra arguments)."""
    bundled: bool = True
    """With an engine: also run the bundled loop on the same prompts, for the comparison (false for a target
    transformers cannot hold; then only its tokenizer is loaded)."""
    training_text: str | None = None
    """The records the drafter was trained on (a prepared ``train/conversations.jsonl``, or any file the corpus
    reader takes): before anything runs, every prompt is checked against it and a prompt found there is refused
    (:func:`eval.prompts.check_prompt_sets`). The pipeline sets its own prepared corpus; None (``python -m
    eyas.eval`` without it): not checked, and the report says so."""
    decontamination_ngram: int = 13
    """Words in a span that, found in the training text, refuses an out-of-distribution prompt."""

    def __post_init__(self) -> None:
        sets = [
            build_config(PromptSetSpec, p, f"eval.prompt_sets[{i}]") for i, p in enumerate(self.prompt_sets)
        ]
        # out-of-distribution sets first, whatever the config's order: reports lead with them
        self.prompt_sets = sorted(sets, key=lambda s: s.in_distribution)
        if self.decontamination_ngram < 1:
            raise ValueError(f"eval.decontamination_ngram must be >= 1, got {self.decontamination_ngram}")
        if isinstance(self.tree, dict):
            self.tree = build_config(TreeConfig, self.tree, "eval.tree")
        if isinstance(self.profile, dict):
            self.profile = build_config(ProfileConfig, self.profile, "eval.profile")
        if isinstance(self.server, dict):
            self.server = build_config(EngineServerConfig, self.server, "eval.server")
        if self.engine not in ENGINES:
            raise ValueError(f"eval.engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.server_url and self.engine == "bundled":
            raise ValueError(
                "eval.server_url needs eval.engine=vllm or eval.engine=sglang (which server it is)"
            )
        if self.server_url:
            check_server_url(self.server_url, "eval.server_url")
        if self.engine == "bundled" and not self.bundled:
            raise ValueError("eval.bundled=false needs an engine (eval.engine=vllm|sglang): nothing to run")
        if not self.prompt_sets:
            raise ValueError("eval.prompt_sets is empty: give at least one prompt set")
        if self.chain_length < 1:
            raise ValueError(f"eval.chain_length (K) must be >= 1, got {self.chain_length}")
        if self.calibration_prompts < 0:
            raise ValueError(
                f"eval.calibration_prompts must be >= 0 (0: no recommended K), got {self.calibration_prompts}"
            )
        if self.dtype not in ("auto", "target", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"eval.dtype must be auto, target, bfloat16, float16 or float32, not {self.dtype!r}"
            )
        known = {m.name for m in default_methods(self.chain_length, self.tree)}
        bad = [m for m in self.methods if m not in known]
        if bad:
            raise ValueError(f"unknown eval methods {bad}; known: {sorted(known)}")

    def resolve_dtype(self, target: Target) -> torch.dtype:
        """The dtype to evaluate ``target`` in, before :meth:`numerics`' exactness probe (see ``dtype``)."""
        if self.dtype == "target" or (self.dtype == "auto" and target.device.type != "cpu"):
            return target.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if cpu_has_bf16() else torch.float32
        return getattr(torch, self.dtype)

    def probe_widths(self) -> list[int]:
        """Every verify width the evaluation runs: 2 .. the widest. A chain of K verifies K + 1 tokens, but prompt
        lookup drafts fewer where its match is short, the last steps of an answer draft what is left, and the
        recommended K may be shorter; a tree verifies its nodes + 1 (at most ``MAX_ROWS`` in exact mode)."""
        top = self.chain_length + 1
        if "eagle3-tree" in self.methods:
            top = max(top, min(self.tree.total_tokens + 1, MAX_ROWS))
        return list(range(2, top + 1))

    def verify_numerics(self, target: Target) -> tuple[Target, str]:
        """The target the speculative methods decode with (see ``dtype``) and one line saying why."""
        dtype = self.resolve_dtype(target)
        if self.dtype != "auto" or target.device.type != "cpu":
            chosen = target.with_dtype(dtype)
            return chosen, f"{dtype} with {chosen.attention} attention"
        if dtype != torch.bfloat16:
            return target.with_dtype(torch.float32), "torch.float32 (this CPU has no bf16 units)"
        exact = target.with_dtype(torch.bfloat16, EXACT)
        widths = self.probe_widths()
        problem = probe(exact, widths)
        if problem is None:
            return exact, (
                f"torch.bfloat16 with row-exact attention (probe: verify forwards of {widths[0]}..{widths[-1]} "
                "tokens give logits bitwise equal to one-token decoding)"
            )
        log.warning("bf16 row-exact probe failed, evaluating in float32: %s", problem)
        return target.with_dtype(torch.float32), f"torch.float32 (the bf16 row-exact probe failed: {problem})"

    def baseline_target(self, target: Target, verify: Target) -> Target:
        """The target plain decoding is timed on: it verifies nothing, so it needs no row exactness and runs on
        its fastest numerics, stock ``sdpa`` attention in bf16 where ``auto`` finds bf16 units on a CPU, else in
        the speculative methods' dtype."""
        if self.dtype == "auto" and target.device.type == "cpu" and cpu_has_bf16():
            return target.with_dtype(torch.bfloat16, "sdpa")
        return verify.with_dtype(verify.dtype, "sdpa")

    def numerics(self, target: Target) -> EvalNumerics:
        """The targets to evaluate with (see ``dtype``) and one line saying which numerics and why."""
        verify, note = self.verify_numerics(target)
        baseline = self.baseline_target(target, verify)
        if baseline is not verify:
            note += (
                f"; plain decoding (`none`, the speedup baseline) on {baseline.dtype} with {baseline.attention} "
                f"attention, its fastest numerics; `{REFERENCE}` is plain decoding on the speculative methods' "
                "numerics, their greedy-match reference"
            )
        return EvalNumerics(verify, baseline, note)

    def method_specs(self) -> list[MethodSpec]:
        return [m for m in default_methods(self.chain_length, self.tree) if m.name in self.methods]


@dataclass
class EvalNumerics:
    """The targets an evaluation decodes with (``EvalStageConfig.numerics``)."""

    verify: Target
    """The speculative methods' target, and the greedy reference's: row-exact bf16 on a CPU where the probe
    passes, so every chain must reproduce plain decoding's greedy output token for token."""
    baseline: Target
    """Plain decoding's (the speedup baseline): its fastest numerics (bf16 ``sdpa`` on a CPU with bf16 units)."""
    note: str
    """One line: which numerics were chosen and why (the report's ``numerics`` fact)."""


@dataclass
class PromptSplit:
    """Each set's prompts, split: the reported ones and a disjoint calibration split (``calibration_prompts``)."""

    reported: dict[str, tuple[PromptSetSpec, list[list[int]]]]
    calibration: dict[str, tuple[PromptSetSpec, list[list[int]]]]
    """Only the sets that have calibration prompts left after the reported ones."""


@dataclass
class EvalJob:
    """What ``python -m eyas.eval`` runs (:func:`run`): the Hydra groups of the same names."""

    target: TargetConfig | None = None
    """None (no ``target=`` on the command line): the target the drafter records (its export's
    ``eyas_export.json``, its checkpoint's ``target.json``), else the default one."""
    eval: EvalStageConfig = field(default_factory=EvalStageConfig)
    work_dir: str = "runs"
    threads: int | None = None


@dataclass
class EvalResult:
    acceptance: AcceptanceResult
    profile: StepProfile | None
    report: Path
    seconds: float
    engine: list[EngineSetResult] | None = None
    """Per prompt set inside the serving engine (``eval.engine`` other than ``bundled``)."""
    chain_length: ChainLengthRecommendation | None = None
    """The K to serve the EAGLE-3 chain with (needs ``profile``; see ``eval.recommend``)."""


def check_before_running(job: EvalJob) -> None:
    """What the stage writes to and talks to, checked before the target is loaded and anything runs, so that a bad
    setting is named in one line instead of losing a whole evaluation: ``work_dir`` takes the report (not a file,
    writable), and with an engine, its server answers at ``eval.server_url`` or its venv exists
    (``eval.server.python``)."""
    ecfg = job.eval
    ensure_out_dir(Path(job.work_dir) / "eval", "work_dir", value=job.work_dir)
    if ecfg.engine == "bundled":
        return
    if ecfg.server_url:
        check_server_answers(ecfg.server_url, "eval.server_url", min(30.0, ecfg.server.request_timeout_s))
    else:
        engine_python(ecfg.engine, ecfg.server, key="eval.server")


def run(
    job: EvalJob,
    target: Target | None = None,
    extra: dict[str, Any] | None = None,
    command: str = "",
    title: str = "eyas: acceptance of an exported drafter",
) -> EvalResult:
    """Evaluate the export ``job.eval.export_dir`` on the target (loaded unless given) with the bundled loop and,
    if ``eval.engine`` names one, inside that serving engine on the same prompts; ``extra``: facts of earlier
    stages for the report."""
    from eyas.serving.load import load_target_for_drafter

    ecfg = job.eval
    engine_only = ecfg.engine != "bundled" and not ecfg.bundled
    if not ecfg.export_dir and not (engine_only and ecfg.server_url):
        raise ConfigError(
            "eval.export_dir is not set: give the exported drafter directory, eval.export_dir=<dir>"
        )
    check_before_running(job)
    if job.threads:
        torch.set_num_threads(job.threads)
    decontamination, exclude = check_decontaminated(ecfg)  # before the target loads: a refusal costs nothing
    chosen = choose_target(job.target, ecfg.export_dir, "eval", caller_loaded=target is not None)
    job = replace(job, target=chosen.config)
    if target is None and not engine_only:
        target = load_target_for_drafter(job.target, ecfg.export_dir)
    if target is not None:
        check_target(chosen.record, target.info, ecfg.export_dir)
    numerics = ecfg.numerics(target) if target is not None else None
    if numerics is not None:
        log.info("evaluation numerics: %s", numerics.note)
    export_dir = Path(ecfg.export_dir) if ecfg.export_dir else None
    t0 = time.perf_counter()
    out = _out_dir(job, export_dir, numerics)
    if ecfg.threads:
        torch.set_num_threads(ecfg.threads)
    tokenizer = numerics.verify.tokenizer if numerics is not None else _load_tokenizer(job.target)
    if target is None:  # an engine-only evaluation loads no weights: the tokenizer is what can be checked
        check_tokenizer(chosen.record, tokenizer_hash(tokenizer), job.target.path, ecfg.export_dir)
    split = split_prompts(ecfg, tokenizer, exclude)
    res = measure_bundled(ecfg, numerics, export_dir, split)
    res.engine = run_engine(job, export_dir, split.reported, out) if ecfg.engine != "bundled" else None
    facts = {
        **(extra or {}),
        **({"numerics": numerics.note} if numerics else {}),
        "decontamination": decontamination,
        "calibration split": describe_split(split),
    }
    res.report = report_and_print(res, out, ecfg, facts, title, command)
    res.seconds = time.perf_counter() - t0
    return res


def measure_bundled(
    ecfg: EvalStageConfig, numerics: EvalNumerics | None, export_dir: Path | None, split: PromptSplit
) -> EvalResult:
    """The bundled loop's part: step profile, the K chosen on the calibration split, then one interleaved run of
    every reported method on the reported prompts (nothing without a target: an engine-only evaluation)."""
    from eyas.serving.load import load_drafter

    sampling = SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed)
    res = EvalResult(AcceptanceResult(results=[], sampling=asdict(sampling)), None, Path(), 0.0)
    if numerics is None:
        return res
    drafter = load_drafter(str(export_dir), numerics.verify).drafter  # an export or a trainer checkpoint
    # the step profile times EAGLE-3 drafter forwards: a DFlash drafter gets no profile, hence no K choice
    res.profile = None if isinstance(drafter, DFlashDrafter) else _profile(ecfg, numerics, drafter)
    res.chain_length = calibrate(ecfg, numerics.verify, drafter, split.calibration, res.profile)
    methods = methods_to_report(ecfg, res.chain_length)
    res.acceptance = run_acceptance(
        numerics.verify, drafter, split.reported, methods, sampling, baseline=numerics.baseline
    )
    return res


def report_and_print(
    res: EvalResult, out: Path, ecfg: EvalStageConfig, facts: dict[str, Any], title: str, command: str
) -> Path:
    """Write the report under ``out`` and print its tables; the report's path."""
    from eyas.eval.report import print_engine_table, print_table, write_report

    acc, chain_k = res.acceptance, res.chain_length
    report = write_report(
        out,
        acc,
        res.profile,
        extra={**facts, **({"recommended_k": chain_k.to_dict()} if chain_k else {})},
        sections={"Chain length to serve": chain_k.markdown()} if chain_k else None,
        title=title,
        chain_length=ecfg.chain_length,
        command=command,
        engine=res.engine,
    )
    if acc.results:
        print_table(acc)
    if chain_k:
        print(f"recommended chain length: K={chain_k.best_k}, chosen on the calibration split (see {report})")
    if res.engine is not None:
        print_engine_table(res.engine, acc)
    return Path(report)


def check_decontaminated(ecfg: EvalStageConfig) -> tuple[str, dict[str, set[str]]]:
    """The report's line and, per set (and per calibration split, :func:`calibration_specs`), the prompt ids to
    leave out: every prompt is checked against ``ecfg.training_text`` (:func:`eval.prompts.check_prompt_sets`;
    raises for an out-of-distribution hit)."""
    from eyas.eval.prompts import check_prompt_sets

    if ecfg.training_text is None:
        log.warning("eval.training_text is not set: the prompts are not checked against the training text")
        return (
            "not checked (no eval.training_text: give the training records to check the prompts against)",
            {},
        )
    specs = [*ecfg.prompt_sets, *calibration_specs(ecfg).values()]
    res = check_prompt_sets(specs, ecfg.seed, ecfg.training_text, ecfg.decontamination_ngram)
    for name, hits in res.left_out.items():
        log.warning(
            "eval set %s: left out %d prompts found in the training text: %s",
            name,
            len(hits),
            hits[0].describe(),
        )
    line = res.describe(ecfg.training_text, ecfg.decontamination_ngram)
    return line, {s.name: res.excluded(s.name) for s in specs}


def calibration_specs(ecfg: EvalStageConfig) -> dict[str, PromptSetSpec]:
    """Set name -> the set's calibration split: ``calibration_prompts`` prompts of the source's ``calib`` half
    (:func:`data.corpora.load_prompt_set`: every source splits into a ``calib`` and a ``report`` half by item), under
    the name ``calib_<set>``; none for a set that itself reports its ``calib`` half."""
    if not ecfg.calibration_prompts:
        return {}
    return {
        s.name: replace(s, name=f"calib_{s.name}", n=ecfg.calibration_prompts, half="calib")
        for s in ecfg.prompt_sets
        if s.half != "calib"
    }


def _out_dir(job: EvalJob, export_dir: Path | None, numerics: EvalNumerics | None) -> Path:
    """``<work_dir>/eval/<hash of the export, the settings, the target and its numerics>``."""
    target = numerics.verify if numerics else None
    key = {
        "export": str(export_dir.resolve()) if export_dir else None,
        "eval": {**asdict(job.eval), "export_dir": None},
        "target": target.info.to_dict() if target is not None else asdict(job.target),
        "dtype": str(target.dtype) if target is not None else None,
        "attention": target.attention if target is not None else None,
        "baseline": f"{numerics.baseline.dtype}/{numerics.baseline.attention}" if numerics else None,
    }
    return Path(job.work_dir) / "eval" / json_hash(key)


def split_prompts(
    ecfg: EvalStageConfig, tokenizer, exclude: dict[str, set[str]] | None = None
) -> PromptSplit:
    """Each set's reported prompts and its calibration split (:func:`calibration_specs`), ``exclude`` (prompt ids
    per set name, from decontamination) left out of both. A set reported from its ``report`` half never shares a
    prompt with its ``calib`` half; one reported from its whole source can, so a calibration prompt equal to a
    reported one is dropped."""
    from eyas.eval.prompts import load_prompt_ids

    exclude = exclude or {}
    cal_specs = calibration_specs(ecfg)
    reported, calibration = {}, {}
    for s in ecfg.prompt_sets:
        shown = load_prompt_ids(s, tokenizer, ecfg.seed, ecfg.max_prompt_tokens, exclude.get(s.name, ()))
        reported[s.name] = (s, shown)
        c = cal_specs.get(s.name)
        if c is None:
            continue
        ids = load_prompt_ids(c, tokenizer, ecfg.seed, ecfg.max_prompt_tokens, exclude.get(c.name, ()))
        seen = {tuple(p) for p in shown}
        cal = [p for p in ids if tuple(p) not in seen]
        if cal:
            calibration[s.name] = (c, cal)
    return PromptSplit(reported, calibration)


def describe_split(split: PromptSplit) -> str:
    """One line for the report: how many prompts each split holds per set."""
    shown = ", ".join(f"{name} {len(ps)}" for name, (_, ps) in split.reported.items())
    cal = ", ".join(f"{name} {len(ps)}" for name, (_, ps) in split.calibration.items()) or "none"
    return f"reported prompts: {shown}; calibration prompts (choose K, never reported): {cal}"


def _profile(ecfg: EvalStageConfig, numerics: EvalNumerics, drafter) -> StepProfile | None:
    """The step profile on the speculative methods' target, with plain decoding's one-token forward timed on the
    baseline target (K = 0 is priced at what plain decoding costs on its own numerics)."""
    if ecfg.profile is None:
        return None
    pcfg = ecfg.profile
    sizes = sorted({1, ecfg.chain_length + 1, ecfg.tree.total_tokens + 1, *pcfg.verify_tokens})
    # drafter forwards over 1..K+1 rows price every shorter chain (the recommended K)
    rows = sorted({*pcfg.draft_rows, 1, ecfg.chain_length + 1})
    prof = profile_steps(
        numerics.verify,
        drafter,
        ProfileConfig(**{**asdict(pcfg), "verify_tokens": sizes, "draft_rows": rows}),
    )
    if numerics.baseline is not numerics.verify:
        plain = profile_steps(
            numerics.baseline, None, ProfileConfig(**{**asdict(pcfg), "verify_tokens": [1], "draft_rows": []})
        )
        prof.verify_ms[1] = plain.verify_ms[1]
        prof.plain_numerics = f"{numerics.baseline.dtype} with {numerics.baseline.attention} attention"
    return prof


def calibrate(
    ecfg: EvalStageConfig,
    target: Target,
    drafter,
    calibration: dict[str, tuple[PromptSetSpec, list[list[int]]]],
    prof: StepProfile | None,
) -> ChainLengthRecommendation | None:
    """The K to serve, chosen on the calibration split: the EAGLE-3 chain at ``chain_length`` on those prompts,
    priced at every shorter K with the step profile (:func:`recommend_chain_length`); None without a profile,
    calibration prompts or the chain among the methods."""
    chain = [m for m in ecfg.method_specs() if m.name == "eagle3-chain"]
    if prof is None or not calibration or not chain:
        return None
    sampling = SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed)
    acc = run_acceptance(target, drafter, calibration, chain, sampling)
    rec = recommend_chain_length(acc, prof)
    if rec is not None:
        rec.chosen_on = {name: len(ps) for name, (_, ps) in calibration.items()}
    return rec


def methods_to_report(ecfg: EvalStageConfig, chain_k: ChainLengthRecommendation | None) -> list[MethodSpec]:
    """The configured methods and, with ``measure_best_k``, the EAGLE-3 chain at the recommended K right after
    the chain at ``chain_length`` (when they differ and the recommendation is a chain at all)."""
    methods = ecfg.method_specs()
    k = chain_k.best_k if chain_k is not None else ecfg.chain_length
    if not ecfg.measure_best_k or k in (0, ecfg.chain_length) or "eagle3-chain" not in ecfg.methods:
        return methods
    i = next(j for j, m in enumerate(methods) if m.name == "eagle3-chain")
    return [*methods[: i + 1], MethodSpec(f"eagle3-chain-k{k}", "eagle3", "chain", k), *methods[i + 1 :]]


def run_engine(
    job: EvalJob,
    export_dir: Path | None,
    prompts: dict[str, tuple[PromptSetSpec, list[list[int]]]],
    out: Path,
) -> list[EngineSetResult]:
    """The prompt sets inside ``eval.engine``: at ``eval.server_url``, else a server eyas starts with the target
    and ``export_dir`` as its drafter (log: ``<out>/engine_server.log``) and stops on every exit path."""
    from eyas.eval.engine_eval import EngineClient, measure
    from eyas.serving.engine_process import engine_server
    from eyas.serving.models.target import model_source

    ecfg = job.eval
    if ecfg.server_url:
        client = EngineClient(ecfg.server_url, ecfg.engine, ecfg.server.request_timeout_s, ecfg.server_model)
        return measure(client, prompts, ecfg.temperature, ecfg.seed)
    assert export_dir is not None
    target_dir, _ = model_source(job.target)
    with engine_server(
        ecfg.engine,
        target_dir,
        str(export_dir.resolve()),
        ecfg.chain_length,
        ecfg.server,
        out / "engine_server.log",
        cuda=torch.cuda.is_available(),
        threads=ecfg.threads or job.threads,
    ) as server:
        client = EngineClient(server.url, ecfg.engine, ecfg.server.request_timeout_s, model=server.model)
        return measure(client, prompts, ecfg.temperature, ecfg.seed)


def _load_tokenizer(tcfg: TargetConfig):
    from transformers import AutoTokenizer

    from eyas.serving.models.target import model_source

    path, _ = model_source(tcfg)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=tcfg.trust_remote_code)
