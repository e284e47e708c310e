"""Acceptance measured inside a real serving engine (vLLM, SGLang) on the same prompts as the bundled loop.

``python -m eyas.eval eval.export_dir=<export> eval.engine=vllm``: eyas starts the engine from its own venv
(``make vllm``) with the target and the export as its EAGLE-3 drafter at K = ``eval.chain_length``, sends every
prompt set through the HTTP API one request at a time, and reports τ, acceptance per draft position, tokens/s and
time to first token per set, beside the bundled loop's numbers. ``eval.server_url=<url>`` measures a server
someone already runs instead (read-only: it only sends prompts and reads counters).

Design decisions:
- The server itself (its venv, command line, environment, lifecycle) is :mod:`eyas.serving.engine_process`, shared with
  extraction through the engine; this module is the client and the measurement. Nothing imports vLLM or SGLang.
- Prompts go in as token ids (the target's chat template already applied by :func:`eval.prompts.load_prompt_ids`),
  so the engine and the bundled loop verify the very same sequences; no second chat template in the way.
- τ counts what the bundled loop counts: tokens emitted per verify step, the bonus token included and the first
  token (the prefill's) not. vLLM: from the spec-decode counters of ``/metrics`` read around every prompt
  (``1 + Δaccepted / Δdrafts``; acceptance at position i is ``Δaccepted_per_pos[i] / Δdrafts``), read until
  they stop moving, since the engine publishes stats asynchronously. SGLang: from each response's
  ``meta_info``, since its metrics hold only a rolling average: ``(completion_tokens - 1) / spec_verify_ct``
  (its completion tokens include the prefill's token, which no verify step emitted).
- Per-prompt counts, so τ and tokens/s carry 95% intervals over prompts (:mod:`eval.intervals`), as the bundled
  loop's do.
- Requests are streamed: time to first token is the first streamed chunk, tokens/s is completion tokens over the
  whole request (prefill included, as the bundled loop's tokens/s).
- Requests name the model eyas launched the server with (or, at a ``server_url``, the one named or the server's
  only one), never the first ``/v1/models`` happens to list.
- The agreement check (:func:`check_agreement`) can fail: the engine's τ must be within 5% of the bundled loop's
  and its acceptance per position within 0.05, and a drafter too weak to tell a broken export from a working one
  (bundled τ below 1.8: a broken export serves τ ≈ 1.0) gives "inconclusive", never a pass. It is judged on the
  prompts both decoded to the same tokens (each side fingerprints its output; vLLM returns the ids with
  ``return_token_ids``) when at least three did: two engines' greedy bf16 decoding parts on some prompts, and past
  that point each counts acceptance on another text.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from eyas.eval.acceptance import SetMethodResult, prompt_fingerprint
from eyas.eval.intervals import Interval, ratio_interval
from eyas.serving.engine_process import EngineError, http_get, post_stream, served_model_name

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- /metrics parsing


@dataclass(frozen=True)
class MetricSample:
    name: str
    labels: dict[str, str]
    value: float


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[MetricSample]:
    """The samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.encode().decode("unicode_escape") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append(MetricSample(m.group(1), labels, value))
    return out


def _counter(samples: list[MetricSample], name: str) -> list[MetricSample]:
    """Samples of counter ``name`` (prometheus_client exposes counters as ``<name>_total``)."""
    return [s for s in samples if s.name in (name, name + "_total")]


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines and models."""

    drafts: float
    """Verify steps that carried a draft (``vllm:spec_decode_num_drafts``)."""
    draft_tokens: float
    """Draft tokens proposed (``vllm:spec_decode_num_draft_tokens``)."""
    accepted: float
    """Draft tokens accepted (``vllm:spec_decode_num_accepted_tokens``)."""
    accepted_per_pos: list[float]
    """Accepted draft tokens at draft position i (``vllm:spec_decode_num_accepted_tokens_per_pos``)."""

    @classmethod
    def from_metrics(cls, text: str) -> SpecCounters:
        """Read the counters from a ``/metrics`` page; raises :class:`EngineError` if the server has none (it
        does not run speculative decoding, or it is not vLLM)."""
        samples = parse_prometheus(text)
        drafts = _counter(samples, "vllm:spec_decode_num_drafts")
        if not drafts:
            names = sorted({s.name for s in samples if "spec" in s.name})
            raise EngineError(
                "the server's /metrics has no vllm:spec_decode_num_drafts counter: it does not run speculative "
                f"decoding (spec metrics found: {names or 'none'})"
            )
        per_pos: dict[int, float] = {}
        for s in _counter(samples, "vllm:spec_decode_num_accepted_tokens_per_pos"):
            pos = int(s.labels.get("position", "0"))
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
        n = max(per_pos) + 1 if per_pos else 0
        return cls(
            drafts=sum(s.value for s in drafts),
            draft_tokens=sum(s.value for s in _counter(samples, "vllm:spec_decode_num_draft_tokens")),
            accepted=sum(s.value for s in _counter(samples, "vllm:spec_decode_num_accepted_tokens")),
            accepted_per_pos=[per_pos.get(i, 0.0) for i in range(n)],
        )

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = [0.0] * n

        def at(xs: list[float], i: int) -> float:
            return (xs + pad)[i]

        delta = SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            accepted_per_pos=[
                at(self.accepted_per_pos, i) - at(before.accepted_per_pos, i) for i in range(n)
            ],
        )
        if min(delta.drafts, delta.accepted, delta.draft_tokens, *delta.accepted_per_pos, 0.0) < 0:
            raise EngineError("the spec-decode counters went backwards: was the server restarted mid-set?")
        return delta

    @property
    def tau(self) -> float:
        """Tokens per verify step: accepted drafts + the bonus token (NaN without drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else math.nan

    def acceptance_by_position(self) -> list[float]:
        """Entry i: the fraction of drafts whose first i+1 tokens were accepted."""
        return [a / self.drafts if self.drafts else math.nan for a in self.accepted_per_pos]


# ------------------------------------------------------------------------------------------------- the client


@dataclass
class Completion:
    """One streamed request."""

    tokens: int
    """Completion tokens the server reports."""
    text: str
    ttft_s: float
    """Seconds from sending the request to its first streamed token."""
    total_s: float
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    """SGLang's ``meta_info`` of the last chunk (``spec_verify_ct`` ...); empty for vLLM."""
    token_ids: list[int] | None = None
    """The completion's token ids (vLLM's ``return_token_ids``, SGLang's ``output_ids``); None when the server
    does not return them."""


class EngineClient:
    """Requests and counters of one server (vLLM's OpenAI API, or SGLang's native ``/generate``)."""

    def __init__(self, url: str, engine: str, timeout_s: float = 600.0, model: str | None = None):
        if engine not in ("vllm", "sglang"):
            raise ValueError(f"engine must be vllm or sglang, got {engine!r}")
        self.url = url.rstrip("/")
        self.engine = engine
        self.timeout_s = timeout_s
        self._expected = model
        self._model: str | None = None

    @property
    def model(self) -> str:
        """The model requests go to: the one given (the name eyas launched the server with), once checked
        against ``/v1/models``; else the server's only model (an error when it lists several)."""
        if self._model is None:
            self._model = served_model_name(self.url, self._expected)
        return self._model

    def metrics(self) -> str:
        return http_get(self.url + "/metrics")

    def counters(self) -> SpecCounters:
        return SpecCounters.from_metrics(self.metrics())

    def settled_counters(
        self, quiet_s: float = 1.0, timeout_s: float = 30.0, poll_s: float = 0.2
    ) -> SpecCounters:
        """Counters once they have not moved for ``quiet_s`` (the engine publishes its stats a little after it
        answers, so a read right after a response can miss that response's steps)."""
        last = self.counters()
        quiet_since = start = time.monotonic()
        while time.monotonic() - quiet_since < quiet_s:
            if time.monotonic() - start > timeout_s:
                raise EngineError(f"the spec-decode counters of {self.url} kept moving for {timeout_s:.0f} s: "
                                  "is someone else sending requests to this server?")  # fmt: skip
            time.sleep(poll_s)
            now = self.counters()
            if asdict(now) != asdict(last):
                last, quiet_since = now, time.monotonic()
        return last

    def complete(
        self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> Completion:
        """Generate from token ids, streamed; stops at the target's EOS as the bundled loop does."""
        if self.engine == "sglang":
            return self._complete_sglang(prompt_ids, max_tokens, temperature, seed)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(map(int, prompt_ids)),
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM >= 0.10: each chunk carries its tokens' ids
        }
        if seed is not None and temperature > 0:
            body["seed"] = int(seed)
        t0 = time.perf_counter()
        ttft = None
        text, tokens, finish = [], None, None
        ids: list[int] | None = None
        for ev in post_stream(self.url + "/v1/completions", body, self.timeout_s):
            for ch in ev.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
                if ch.get("token_ids") is not None:
                    ids = ids if ids is not None else []
                    ids.extend(int(t) for t in ch["token_ids"])
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
        total = time.perf_counter() - t0
        if tokens is None:
            raise EngineError(f"{self.url}/v1/completions streamed no usage (completion_tokens)")
        return Completion(
            tokens, "".join(text), ttft if ttft is not None else total, total, finish, token_ids=ids
        )

    def _complete_sglang(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None
    ) -> Completion:
        params: dict[str, Any] = {"max_new_tokens": int(max_tokens), "temperature": float(temperature)}
        if seed is not None and temperature > 0:
            params["sampling_seed"] = int(seed)
        body = {"input_ids": list(map(int, prompt_ids)), "sampling_params": params, "stream": True}
        t0 = time.perf_counter()
        ttft, last = None, None
        for ev in post_stream(self.url + "/generate", body, self.timeout_s):
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = ev
        total = time.perf_counter() - t0
        if last is None or "meta_info" not in last:
            raise EngineError(f"{self.url}/generate returned no meta_info")
        meta = last["meta_info"]
        finish = meta.get("finish_reason")
        finish = finish.get("type") if isinstance(finish, dict) else finish
        ids = last.get("output_ids")
        return Completion(
            int(meta["completion_tokens"]), last.get("text", ""), ttft or total, total, finish, meta,
            [int(t) for t in ids] if isinstance(ids, list) else None,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------- measurement


@dataclass
class EnginePromptRecord:
    """One prompt through the engine: what the intervals resample."""

    tokens: int
    """Completion tokens (the first one, from prefill, included)."""
    seconds: float
    """Request wall time, prefill included."""
    drafts: float
    """Verify steps that carried a draft."""
    accepted: float
    """Draft tokens accepted."""
    prompt: str = ""
    """The prompt's fingerprint (:func:`eval.acceptance.prompt_fingerprint`)."""
    output: str = ""
    """The fingerprint of the completion's token ids, as the bundled loop's ``PromptRecord.output`` ("": the
    server returned no ids)."""
    accepted_per_pos: list[float] = field(default_factory=list)
    """Accepted draft tokens at draft position i during this prompt (vLLM's counters; empty for SGLang)."""


@dataclass
class EngineSetResult:
    """One prompt set through the engine."""

    prompt_set: str
    engine: str
    prompts: int
    tokens: int
    """Completion tokens over the set."""
    tau: float
    """Tokens per verify step (accepted drafts + the bonus token; the prefill's token not counted)."""
    acceptance_by_position: list[float]
    tokens_per_s: float
    """Completion tokens over the summed request wall time (prefill included)."""
    mean_ttft_ms: float
    drafts: float
    """Verify steps with a draft (vLLM's counter, SGLang's ``spec_verify_ct``)."""
    accepted: float
    seconds: float
    per_prompt: list[EnginePromptRecord] = field(default_factory=list)
    """Each prompt's counts, in the set's prompt order."""
    tau_ci: Interval | None = None
    """95% interval of ``tau`` (bootstrap over the set's prompts)."""
    tokens_per_s_ci: Interval | None = None
    """95% interval of ``tokens_per_s``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sglang_record(c: Completion, prompt: str) -> EnginePromptRecord:
    """A prompt's counts from SGLang's ``meta_info``: its completion tokens include the prefill's token, which no
    verify step emitted, so ``completion_tokens - 1`` tokens came from ``spec_verify_ct`` steps."""
    verify = float(int(c.meta.get("spec_verify_ct", 0)))
    return EnginePromptRecord(
        c.tokens, c.total_s, verify, max(c.tokens - 1 - verify, 0.0), prompt, _output_mark(c)
    )


def _output_mark(c: Completion) -> str:
    return prompt_fingerprint(c.token_ids) if c.token_ids else ""


def measure_set(
    client: EngineClient,
    name: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> EngineSetResult:
    """Every prompt of a set, one request at a time; τ from the counters' change around each prompt (vLLM) or
    from the responses' verify counts (SGLang)."""
    if not prompts:
        raise ValueError(f"prompt set {name}: no prompts")
    vllm = client.engine == "vllm"
    first = before = client.settled_counters() if vllm else None
    done, records = [], []
    for i, p in enumerate(prompts):
        c = client.complete(p, max_new_tokens, temperature, seed + i if temperature > 0 else None)
        done.append(c)
        if before is None:
            records.append(_sglang_record(c, prompt_fingerprint(p)))
            continue
        after = client.settled_counters()
        delta = after - before
        records.append(
            EnginePromptRecord(
                c.tokens,
                c.total_s,
                delta.drafts,
                delta.accepted,
                prompt_fingerprint(p),
                _output_mark(c),
                delta.accepted_per_pos,
            )
        )
        before = after
    drafts = sum(r.drafts for r in records)
    accepted = sum(r.accepted for r in records)
    if not vllm and not drafts:
        raise EngineError("the SGLang server reports no spec_verify_ct: does it run speculative decoding?")
    by_pos = (before - first).acceptance_by_position() if first is not None and before is not None else []
    tokens = sum(c.tokens for c in done)
    seconds = sum(c.total_s for c in done)
    return EngineSetResult(
        prompt_set=name,
        engine=client.engine,
        prompts=len(done),
        tokens=tokens,
        tau=1.0 + accepted / drafts if drafts else math.nan,
        acceptance_by_position=by_pos,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        mean_ttft_ms=1e3 * sum(c.ttft_s for c in done) / len(done),
        drafts=drafts,
        accepted=accepted,
        seconds=seconds,
        per_prompt=records,
        tau_ci=ratio_interval([r.drafts + r.accepted for r in records], [r.drafts for r in records]),
        tokens_per_s_ci=ratio_interval([r.tokens for r in records], [r.seconds for r in records]),
    )


def measure(
    client: EngineClient,
    prompt_sets: dict[str, tuple[Any, list[list[int]]]],
    temperature: float = 0.0,
    seed: int = 0,
    warmup: bool = True,
) -> list[EngineSetResult]:
    """Every prompt set (name -> (spec with ``max_new_tokens``, token-id prompts)) through the engine."""
    first = next((p for _, ps in prompt_sets.values() for p in ps), None)
    if first is None:
        raise ValueError("no evaluation prompts for the engine")
    if warmup:  # the first request pays one-time costs (graph capture, kernel compilation)
        client.complete(first, 8, temperature, seed)
    out = []
    for name, (spec, prompts) in prompt_sets.items():
        r = measure_set(client, name, prompts, spec.max_new_tokens, temperature, seed)
        log.info(
            "engine %s / %s: tau %.2f, %.1f tok/s, ttft %.0f ms", client.engine, name, r.tau, r.tokens_per_s,
            r.mean_ttft_ms,
        )  # fmt: skip
        out.append(r)
    return out


# ----------------------------------------------------------------------------------------- agreement check


@dataclass
class AgreementRule:
    """When an engine serves the export as the bundled loop runs it (same prompts, same K, greedy)."""

    tau_rtol: float = 0.05
    """The engine's τ within this fraction of the bundled loop's (vLLM measured 1.87 against 1.85 on the demo's
    export: 1%)."""
    position_atol: float = 0.05
    """Acceptance at every draft position within this (absolute) of the bundled loop's."""
    min_bundled_tau: float = 1.8
    """Below this bundled τ the check is inconclusive: an export served wrong runs at τ ≈ 1.0, which a drafter
    at τ 1.1 cannot be told from."""
    min_same_outputs: int = 3
    """Judge on the prompts whose outputs the engine and the bundled loop decoded identically when there are at
    least this many: on those both verified the very same tokens, so a difference in τ is the drafter's serving
    and not the target's numerics (greedy decoding in two engines' bf16 kernels drifts apart after a few dozen
    tokens on some prompts, and from there on the two count acceptance on different texts)."""


@dataclass
class Agreement:
    """The verdict of :func:`check_agreement` on one prompt set."""

    prompt_set: str
    verdict: Literal["agree", "disagree", "inconclusive"]
    reasons: list[str] = field(default_factory=list)
    """Why it disagrees or is inconclusive (empty when it agrees)."""
    basis: Literal["same outputs", "all prompts"] = "all prompts"
    """Which prompts the verdict was judged on (:attr:`AgreementRule.min_same_outputs`)."""
    prompts: int = 0
    same_outputs: int = 0
    """Prompts whose output the engine and the bundled loop decoded identically (0 where the engine returns no
    token ids)."""
    tau_engine: float = math.nan
    """The engine's τ over the judged prompts."""
    tau_bundled: float = math.nan
    acceptance_engine: list[float] = field(default_factory=list)
    """Acceptance per draft position over the judged prompts."""
    acceptance_bundled: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def same_output_pairs(
    engine: EngineSetResult, bundled: SetMethodResult
) -> list[tuple[EnginePromptRecord, Any]]:
    """(engine record, bundled record) of every prompt both decoded to the same tokens, matched by the prompt's
    fingerprint (records without fingerprints, or without the bundled loop's acceptance per position, are not
    matched)."""
    by_prompt = {b.prompt: b for b in bundled.per_prompt if b.prompt and b.output and b.accepted_by_position}
    return [
        (e, by_prompt[e.prompt])
        for e in engine.per_prompt
        if e.prompt in by_prompt and e.output and e.output == by_prompt[e.prompt].output
    ]


def _judged(
    engine: EngineSetResult, bundled: SetMethodResult, pairs: list, rule: AgreementRule
) -> tuple[Literal["same outputs", "all prompts"], float, float, list[float], list[float]]:
    """The basis and the τ and acceptance per position of each side over it."""
    if len(pairs) < rule.min_same_outputs:
        return (
            "all prompts", engine.tau, bundled.tau, list(engine.acceptance_by_position),
            list(bundled.acceptance_by_position),
        )  # fmt: skip
    drafts = sum(e.drafts for e, _ in pairs)
    steps = sum(b.steps for _, b in pairs)
    e_tau = 1.0 + sum(e.accepted for e, _ in pairs) / drafts if drafts else math.nan
    # counted as vLLM counts, 1 + accepted drafts per verify step: the bundled loop's own τ counts the tokens each
    # step emitted, and the step that ends a generation (at EOS or max_new_tokens) emits no bonus token after it,
    # about one token per prompt less (2.79 against 2.86 on 4 of the demo export's training prompts)
    b_tau = 1.0 + sum(sum(b.accepted_by_position) for _, b in pairs) / steps if steps else math.nan
    e_pos = _rates([e.accepted_per_pos for e, _ in pairs], drafts)
    b_pos = _rates([b.accepted_by_position for _, b in pairs], steps)
    return "same outputs", e_tau, b_tau, e_pos, b_pos


def _rates(counts: list[list[float]], steps: float) -> list[float]:
    """Acceptance per draft position over several prompts: each position's accepted count summed over the
    prompts (a shorter list counts 0 there), over their verify steps; none when a prompt has no counts."""
    if not steps or not all(counts):
        return []
    return [sum(c[i] for c in counts if i < len(c)) / steps for i in range(max(map(len, counts)))]


def check_agreement(
    engine: EngineSetResult, bundled: SetMethodResult, rule: AgreementRule | None = None
) -> Agreement:
    """Whether the engine serves the export as the bundled loop runs it (:class:`AgreementRule`): judged on the
    prompts both decoded identically when there are enough of them, else on the whole set."""
    rule = rule or AgreementRule()
    pairs = same_output_pairs(engine, bundled)
    basis, e_tau, b_tau, ea, ba = _judged(engine, bundled, pairs, rule)
    out = Agreement(
        engine.prompt_set, "agree", basis=basis, prompts=engine.prompts, same_outputs=len(pairs),
        tau_engine=e_tau, tau_bundled=b_tau, acceptance_engine=ea, acceptance_bundled=ba,
    )  # fmt: skip
    on = f" (on the {len(pairs)} prompts with the same output)" if basis == "same outputs" else ""
    if not b_tau >= rule.min_bundled_tau:
        out.verdict = "inconclusive"
        out.reasons.append(
            f"bundled τ {b_tau:.2f}{on} is below {rule.min_bundled_tau}: a broken export (τ ≈ 1) would not show"
        )
        return out
    if not abs(e_tau - b_tau) <= rule.tau_rtol * b_tau:
        out.reasons.append(
            f"τ {e_tau:.3f} in {engine.engine} against {b_tau:.3f} bundled{on}: more than {rule.tau_rtol:.0%} apart"
        )
    if ea and len(ea) != len(ba):
        out.reasons.append(
            f"{engine.engine} drafts {len(ea)} positions, the bundled loop {len(ba)}: not the same K"
        )
    for i, (e, b) in enumerate(zip(ea, ba), start=1):
        if not abs(e - b) <= rule.position_atol:
            out.reasons.append(
                f"acceptance at position {i}: {e:.3f} in {engine.engine} against {b:.3f} bundled{on}"
            )
    out.verdict = "disagree" if out.reasons else "agree"
    return out
