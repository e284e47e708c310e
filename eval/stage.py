"""The evaluation stage: an exported drafter (the directory a user ships) against prompt lookup and plain decoding.

``python -m eyas.eval eval.export_dir=<exported drafter dir>``; the pipeline calls :func:`run` with its own export.
τ per prompt set and draft position, tokens/s, step time against context, a report with plots under
``<work_dir>/eval/<hash>`` (the hash of the export, the settings and the target).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.common import ConfigError, build_config, ensure_out_dir, json_hash
from eyas.eval.acceptance import AcceptanceResult, MethodSpec, PromptSetSpec, default_methods, run_acceptance
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
    measure_best_k: bool = True
    """When the profile recommends a chain length other than ``chain_length``, also run the EAGLE-3 chain at that
    K on every set (method ``eagle3-chain-k<K>``): the report then shows measured, not predicted, tokens/s at the
    K to serve."""
    threads: int | None = None
    """torch CPU threads during evaluation, and the CPU engine server's OMP_NUM_THREADS (None: leave as is)."""
    dtype: str = "auto"
    """Target numerics of the evaluation. ``auto`` on CPU: bfloat16 with row-exact attention
    (:mod:`eyas.serving.models.exact_attention`) where the CPU has bf16 units and a probe finds every verify row bitwise
    equal to one-token decoding, so greedy chain output must equal plain decoding's token for token (a mismatch
    is a bug) while a multi-token verify costs what it costs in serving (7 tokens ~1.1x one; in fp32 on a small
    CPU ~1.9x, compute-bound); float32 otherwise. ``auto`` elsewhere: the loaded target's dtype and attention
    (bf16 on GPU, where near-tie divergence is expected). Or ``bfloat16``, ``float16``, ``float32``, ``target``
    (the loaded target's, whatever it is), with the target's attention."""
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

    def numerics(self, target: Target) -> tuple[Target, str]:
        """The target to evaluate (see ``dtype``) and one line saying which numerics were chosen and why."""
        dtype = self.resolve_dtype(target)
        if self.dtype != "auto" or target.device.type != "cpu":
            chosen = target.with_dtype(dtype)
            return chosen, f"{dtype} with {chosen.attention} attention"
        if dtype != torch.bfloat16:
            return target.with_dtype(torch.float32), "torch.float32 (this CPU has no bf16 units)"
        exact = target.with_dtype(torch.bfloat16, EXACT)
        sizes = sorted({2, self.chain_length + 1, min(self.tree.total_tokens + 1, MAX_ROWS)})
        problem = probe(exact, sizes)
        if problem is None:
            return exact, (
                f"torch.bfloat16 with row-exact attention (probe: verify forwards of {sizes} tokens give logits "
                "bitwise equal to one-token decoding)"
            )
        log.warning("bf16 row-exact probe failed, evaluating in float32: %s", problem)
        return target.with_dtype(torch.float32), f"torch.float32 (the bf16 row-exact probe failed: {problem})"

    def method_specs(self) -> list[MethodSpec]:
        return [m for m in default_methods(self.chain_length, self.tree) if m.name in self.methods]


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
    from eyas.eval.prompts import load_prompt_ids
    from eyas.eval.report import print_engine_table, print_table, write_report
    from eyas.serving.load import load_drafter, load_target_for_drafter

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
    numerics = None
    if target is not None:
        target, numerics = ecfg.numerics(target)
        log.info("evaluation numerics: %s", numerics)
    export_dir = Path(ecfg.export_dir) if ecfg.export_dir else None
    t0 = time.perf_counter()
    out = (
        Path(job.work_dir)
        / "eval"
        / json_hash(
            {
                "export": str(export_dir.resolve()) if export_dir else None,
                "eval": {**asdict(ecfg), "export_dir": None},
                "target": target.info.to_dict() if target is not None else asdict(job.target),
                "dtype": str(target.dtype) if target is not None else None,
                "attention": target.attention if target is not None else None,
            }
        )
    )
    if ecfg.threads:
        torch.set_num_threads(ecfg.threads)
    tokenizer = target.tokenizer if target is not None else _load_tokenizer(job.target)
    if target is None:  # an engine-only evaluation loads no weights: the tokenizer is what can be checked
        check_tokenizer(chosen.record, tokenizer_hash(tokenizer), job.target.path, ecfg.export_dir)
    prompts = {
        s.name: (s, load_prompt_ids(s, tokenizer, ecfg.seed, ecfg.max_prompt_tokens, exclude.get(s.name, ())))
        for s in ecfg.prompt_sets
    }
    acc = AcceptanceResult(results=[], sampling=asdict(SamplingConfig(ecfg.temperature, seed=ecfg.seed)))
    prof = None
    if target is not None:
        drafter = load_drafter(
            str(export_dir), target
        ).drafter  # an export (what users ship) or a trainer checkpoint
        acc = run_acceptance(
            target,
            drafter,
            prompts,
            ecfg.method_specs(),
            SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed),
        )
        if ecfg.profile is not None:
            pcfg = ecfg.profile
            sizes = sorted({1, ecfg.chain_length + 1, ecfg.tree.total_tokens + 1, *pcfg.verify_tokens})
            # drafter forwards over 1..K+1 rows price every shorter chain (the recommended K below)
            rows = sorted({*pcfg.draft_rows, 1, ecfg.chain_length + 1})
            prof = profile_steps(
                target, drafter, ProfileConfig(**{**asdict(pcfg), "verify_tokens": sizes, "draft_rows": rows})
            )
    chain_k = recommend_chain_length(acc, prof)
    if chain_k is not None and target is not None and ecfg.measure_best_k:
        acc = add_best_k_rows(acc, chain_k.best_k, ecfg, target, drafter, prompts)
    engine = None
    if ecfg.engine != "bundled":
        engine = run_engine(job, export_dir, prompts, out)
    report = write_report(
        out,
        acc,
        prof,
        extra={
            **(extra or {}),
            **({"numerics": numerics} if numerics else {}),
            "decontamination": decontamination,
            **({"recommended_k": chain_k.to_dict()} if chain_k else {}),
        },
        sections={"Chain length to serve": chain_k.markdown()} if chain_k else None,
        title=title,
        chain_length=ecfg.chain_length,
        command=command,
        engine=engine,
    )
    if acc.results:
        print_table(acc)
    if chain_k:
        print(f"recommended chain length: K={chain_k.best_k} (see {report})")
    if engine is not None:
        print_engine_table(engine, acc)
    return EvalResult(acc, prof, Path(report), time.perf_counter() - t0, engine, chain_k)


def check_decontaminated(ecfg: EvalStageConfig) -> tuple[str, dict[str, set[str]]]:
    """The report's line and, per set, the prompt ids to leave out: every prompt is checked against
    ``ecfg.training_text`` (:func:`eval.prompts.check_prompt_sets`; raises for an out-of-distribution hit)."""
    from eyas.eval.prompts import check_prompt_sets

    if ecfg.training_text is None:
        log.warning("eval.training_text is not set: the prompts are not checked against the training text")
        return (
            "not checked (no eval.training_text: give the training records to check the prompts against)",
            {},
        )
    res = check_prompt_sets(ecfg.prompt_sets, ecfg.seed, ecfg.training_text, ecfg.decontamination_ngram)
    for name, hits in res.left_out.items():
        log.warning(
            "eval set %s: left out %d prompts found in the training text: %s",
            name,
            len(hits),
            hits[0].describe(),
        )
    line = res.describe(ecfg.training_text, ecfg.decontamination_ngram)
    return line, {s.name: res.excluded(s.name) for s in ecfg.prompt_sets}


def add_best_k_rows(
    acc: AcceptanceResult,
    best_k: int,
    ecfg: EvalStageConfig,
    target: Target,
    drafter,
    prompts: dict[str, tuple[PromptSetSpec, list[list[int]]]],
) -> AcceptanceResult:
    """``acc`` with the EAGLE-3 chain measured again at ``best_k`` (one row per set, right after that set's
    ``eagle3-chain`` row); unchanged when ``best_k`` is the K already measured."""
    if best_k == ecfg.chain_length or "eagle3-chain" not in ecfg.methods:
        return acc
    spec = MethodSpec(f"eagle3-chain-k{best_k}", "eagle3", "chain", best_k)
    plain = MethodSpec(
        "none", "none", "chain", 1
    )  # its own baseline: speedup and greedy match of the new rows
    extra = run_acceptance(
        target, drafter, prompts, [spec, plain], SamplingConfig(temperature=ecfg.temperature, seed=ecfg.seed)
    )
    by_set = {r.prompt_set: r for r in extra.results if r.method == spec.name}
    rows = []
    for r in acc.results:
        rows.append(r)
        if r.method == "eagle3-chain" and r.prompt_set in by_set:
            rows.append(by_set.pop(r.prompt_set))
    rows.extend(by_set.values())
    return replace(acc, results=rows)


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
        client = EngineClient(ecfg.server_url, ecfg.engine, ecfg.server.request_timeout_s)
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
        client = EngineClient(server.url, ecfg.engine, ecfg.server.request_timeout_s)
        return measure(client, prompts, ecfg.temperature, ecfg.seed)


def _load_tokenizer(tcfg: TargetConfig):
    from transformers import AutoTokenizer

    from eyas.serving.models.target import model_source

    path, _ = model_source(tcfg)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=tcfg.trust_remote_code)
