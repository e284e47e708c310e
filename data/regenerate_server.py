"""Regeneration through a serving engine: the target's answers from an OpenAI-compatible HTTP server.

``python -m eyas.data.prepare target=hf target.path=Qwen/Qwen3-8B prepare.regenerate=true
prepare.regen.engine=server`` starts vLLM from ``.venv-vllm`` (``make vllm``) with the target and stops it at the
end; ``prepare.regen.server_url=http://host:8000`` (or a list, data parallel) asks servers someone already runs —
vLLM, SGLang or a production deployment. The target's weights are never loaded here: the tokenizer, its chat
template and the config are all eyas reads.

Design decisions:
- Two request modes. ``tokens``: eyas renders the chat template (:func:`data.chat.format_prompt`, exactly as the
  in-process engines and training do) and sends the ids to ``/v1/completions``, so the target answers the very
  text the drafter trains on; where the server echoes the prompt ids it used, they must equal the ids sent.
  ``chat``: the messages go to ``/v1/chat/completions`` (endpoints that take only messages); the prompt the server
  reports it rendered is compared with the target template's rendering and a difference is refused, naming the
  first differing token (answers to a prompt the drafter never sees would teach it other text).
- Answers are decoded by eyas from the generated ids when the server returns them, as in-process regeneration
  decodes its own, so a ``<think>…</think>`` span lands in the record's ``reasoning`` field either way; without
  ids, the server's text (``skip_special_tokens=false``) and its separate reasoning field are used.
- vLLM's fields (read in vLLM's source, ``vllm/entrypoints/openai/completion/protocol.py`` and
  ``chat_completion/protocol.py`` + ``chat_completion/serving.py``): requests carry ``return_token_ids: true``
  (answer: ``choices[0].token_ids``; completions echo ``choices[0].prompt_token_ids``, chat returns a top-level
  ``prompt_token_ids``), ``skip_special_tokens``, ``stop_token_ids``, ``seed``; the chat message's reasoning is
  ``reasoning`` (``reasoning_content`` in older releases; both read); ``usage.prompt_tokens`` is the fallback
  check (a count) for chat servers that report no ids; ``GET /v1/models`` gives the served name and
  ``max_model_len``; errors are ``{"error": {"message": ...}}`` or, in older releases, ``{"message": ...}``.
- Concurrency: conversations are independent, the turns of one are asked in order (each sees the answers before
  it). ``concurrency`` conversations per server are in flight; a request takes a free slot of any server (a queue
  holding each URL ``concurrency`` times), so a faster server takes more of the work.
- Resume: the records, the fixed (length-sorted) order, ``max_batches``/``time_budget_s`` and the resume rules
  are in-process regeneration's (:mod:`eyas.data.regenerate`). A record is appended and flushed as soon as its
  conversation is answered (fsynced every 64 records and at the end), so a killed job loses only conversations in
  flight, and a restart skips every id already written. Each turn's sampling seed derives from the seed, the
  conversation id and the turn, so a resumed run asks what an uninterrupted one would.
- Failures: connection errors, timeouts and HTTP 408/429/5xx are retried ``retries`` times with exponential
  backoff; a 4xx answer (a bad request will not get better) and exhausted retries raise
  :class:`RegenServerError` naming the conversation, the turn, the server and the server's own message, after
  the conversations already in flight are written.
- The server eyas starts runs with ``--generation-config vllm``: the model's ``generation_config.json`` would
  otherwise add its own sampling defaults (top_k, repetition penalty) to every request; what is asked is what
  ``prepare.regen`` says.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.data.chat import format_prompt, prompt_messages, template_messages
from eyas.data.corpora.mixtures import hash01
from eyas.data.regenerate import (
    Pending,
    RegenerateConfig,
    RegenerateResult,
    answer_message,
    cut_at_stop,
    load_done_ids,
    log_already_done,
    log_written,
    pending_items,
    pending_record,
    stop_ids_of,
)
from eyas.data.types import Conversation
from eyas.serving.engine_process import (
    EngineError,
    EngineServer,
    engine_env,
    engine_python,
    free_port,
    http_get,
    vllm_server_command,
)

log = logging.getLogger(__name__)

SERVED_NAME = "eyas-regen"
RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 60.0
FSYNC_EVERY = 64


class RegenServerError(EngineError):
    """A server could not answer a conversation; the message names the conversation and quotes the server."""


class PromptMismatchError(RegenServerError):
    """The server answered another prompt than the target's chat template renders."""


# -- the target, without its weights -----------------------------------------------------------------------------
@dataclass
class ServerTarget:
    """What regeneration through a server needs of the target: its tokenizer (chat template), the tokens that end
    an answer, its context window, and where an engine loads it from."""

    name: str
    """Display name (recorded as ``meta.regenerated_by``, part of the prepare stage's hash)."""
    source: str
    """Directory or hub id the engine eyas starts loads."""
    tokenizer: Any
    stop_ids: set[int]
    max_position_embeddings: int | None = None


def load_server_target(cfg) -> ServerTarget:
    """The :class:`ServerTarget` of a :class:`serving.target.TargetConfig`: tokenizer and configs only."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from eyas.serving.models.target import model_source

    path, name = model_source(cfg)
    kwargs: dict[str, Any] = dict(trust_remote_code=cfg.trust_remote_code)
    if cfg.revision and not Path(path).exists():
        kwargs["revision"] = cfg.revision
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    config = AutoConfig.from_pretrained(path, **kwargs)
    try:
        gen = GenerationConfig.from_pretrained(path, **kwargs)
    except OSError:  # no generation_config.json: transformers derives one from the model config, as here
        gen = GenerationConfig.from_model_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "max_position_embeddings", None)
    return ServerTarget(name, path, tokenizer, stop_ids_of(gen, tokenizer), int(window) if window else None)


# -- HTTP --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerInfo:
    """One server to ask."""

    url: str
    model: str
    """The served model name requests carry."""
    max_model_len: int | None = None
    """Longest prompt + answer the server takes (vLLM lists it under ``/v1/models``), when known."""


def server_info(url: str, timeout_s: float = 30.0) -> ServerInfo:
    """The first model ``url`` serves (``GET /v1/models``)."""
    url = url.rstrip("/")
    try:
        data = json.loads(http_get(url + "/v1/models", timeout_s)).get("data") or []
    except json.JSONDecodeError as e:
        raise RegenServerError(
            f"{url}/v1/models did not answer JSON ({e}): is it an OpenAI-compatible server?"
        ) from e
    if not data:
        raise RegenServerError(f"{url}/v1/models lists no model")
    window = data[0].get("max_model_len")
    return ServerInfo(url, str(data[0]["id"]), int(window) if window else None)


def server_message(body: str) -> str:
    """The error message of a server's error body (vLLM, SGLang, FastAPI, or plain text)."""
    try:
        d = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:1000] or "(empty body)"
    if isinstance(d, dict):
        err = d.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if d.get(key):
                return str(d[key])
    return body.strip()[:1000]


class _Transient(Exception):
    """A failure worth retrying (connection, timeout, HTTP 408/429/5xx)."""


class _Final(Exception):
    """A failure no retry mends (HTTP 4xx)."""


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}: {server_message(e.read().decode(errors='replace'))}"
        raise (_Transient if e.code in RETRY_STATUS else _Final)(why) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise _Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise _Final(f"the answer is not JSON: {raw[:300]!r}") from None


def post_with_retries(
    url: str,
    body: dict[str, Any],
    *,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    what: str,
) -> dict[str, Any]:
    """POST ``body``; transient failures are retried ``retries`` times after ``backoff_s * 2**k`` seconds.
    :class:`RegenServerError` names ``what`` (the conversation and turn), the server and its message."""
    for attempt in range(retries + 1):
        try:
            return _post(url, body, timeout_s)
        except _Final as e:
            raise RegenServerError(f"{what}: {url} refused the request ({e})") from None
        except _Transient as e:
            if attempt == retries:
                raise RegenServerError(f"{what}: {url} failed {retries + 1} times, last: {e}") from None
            wait_s = min(MAX_BACKOFF_S, backoff_s * 2**attempt)
            log.warning(
                "%s: %s failed (%s); retry %d of %d in %.1f s", what, url, e, attempt + 1, retries, wait_s
            )
            time.sleep(wait_s)
    raise AssertionError("unreachable")


# -- one turn ----------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """One generated turn."""

    message: dict[str, Any]
    """The assistant message (``content``, and ``reasoning`` where the target reasoned)."""
    tokens: int
    """Generated tokens (the end-of-turn token included when the server returns it)."""
    finish: str
    """``stop`` or ``length``."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of the
    other); None when they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_prompt(expected: Sequence[int], reported: Sequence[int], tokenizer, what: str, how: str) -> None:
    """Refuse (:class:`PromptMismatchError`) a prompt the server reports that is not the target template's, naming
    the first differing token of each."""
    i = first_difference(expected, reported)
    if i is None:
        return

    def tok(ids: Sequence[int]) -> str:
        if i >= len(ids):
            return "(end of prompt)"
        return f"{ids[i]} {tokenizer.decode([ids[i]], skip_special_tokens=False)!r}"

    raise PromptMismatchError(
        f"{what}: the server's prompt is not the target's ({how}): first difference at token {i} of "
        f"{len(expected)} (eyas, the target's chat template) / {len(reported)} (the server): eyas {tok(expected)}, "
        f"server {tok(reported)}. Serve the target's own chat template, or use prepare.regen.request_mode=tokens"
    )


class RegenClient:
    """Asks the servers for one turn at a time; a request takes a free slot of any server."""

    def __init__(self, target: ServerTarget, cfg: RegenerateConfig, servers: Sequence[ServerInfo]):
        if not servers:
            raise ValueError("no server to ask")
        self.target, self.cfg = target, cfg
        self.timeout_s = cfg.server.request_timeout_s
        self.slots: queue.Queue[ServerInfo] = queue.Queue()
        for _ in range(cfg.concurrency):
            for s in servers:
                self.slots.put(s)
        self._count_only_warned = False

    def answer(
        self, conv_id: str, turn: int, msgs: list[dict[str, Any]], prompt: list[int], seed: int
    ) -> Answer:
        """The target's answer to ``msgs`` (whose rendering is ``prompt``)."""
        server = self.slots.get()
        try:
            what = f"conversation {conv_id!r} turn {turn + 1}"
            if self.cfg.request_mode == "tokens":
                return self._tokens(server, prompt, seed, what)
            return self._chat(server, msgs, prompt, seed, what)
        finally:
            self.slots.put(server)

    def _sampling(self, server: ServerInfo, seed: int) -> dict[str, Any]:
        c = self.cfg
        body: dict[str, Any] = {
            "model": server.model,
            "max_tokens": int(c.max_new_tokens),
            "temperature": float(c.temperature),
            "top_p": float(c.top_p),
            "stop_token_ids": sorted(self.target.stop_ids),
            "skip_special_tokens": False,  # the <think> tags of reasoning models are special in some vocabularies
            "return_token_ids": True,
        }
        if c.temperature > 0:
            body["seed"] = int(seed)
        return body

    def _post(self, server: ServerInfo, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        return post_with_retries(
            server.url + path,
            body,
            timeout_s=self.timeout_s,
            retries=self.cfg.retries,
            backoff_s=self.cfg.retry_backoff_s,
            what=what,
        )

    def _tokens(self, server: ServerInfo, prompt: list[int], seed: int, what: str) -> Answer:
        ans = self._post(server, "/v1/completions", {**self._sampling(server, seed), "prompt": prompt}, what)
        choice = _first_choice(ans, server, what)
        echoed = choice.get("prompt_token_ids")
        if echoed is not None:
            check_prompt(
                prompt, echoed, self.target.tokenizer, what, "the ids it echoes are not the ids sent"
            )
        return self._answer(choice, choice.get("text"), None, ans, server, what)

    def _chat(
        self, server: ServerInfo, msgs: list[dict[str, Any]], prompt: list[int], seed: int, what: str
    ) -> Answer:
        tok = self.target.tokenizer
        body = {
            **self._sampling(server, seed),
            "messages": template_messages(prompt_messages(msgs), tok),
            "add_generation_prompt": True,
        }
        ans = self._post(server, "/v1/chat/completions", body, what)
        choice = _first_choice(ans, server, what)
        reported = ans.get("prompt_token_ids")
        if reported is not None:
            check_prompt(prompt, reported, tok, what, "its chat template renders the messages differently")
        else:
            n = (ans.get("usage") or {}).get("prompt_tokens")
            if n is None:
                raise PromptMismatchError(
                    f"{what}: {server.url} reports neither prompt_token_ids nor usage.prompt_tokens, so eyas cannot "
                    "check that it rendered the target's chat template; use prepare.regen.request_mode=tokens"
                )
            if int(n) != len(prompt):
                raise PromptMismatchError(
                    f"{what}: the server's prompt is not the target's: it reports {n} prompt tokens, the target's "
                    f"chat template renders {len(prompt)} (the server returns no prompt ids, so the first difference "
                    "cannot be named). Serve the target's own chat template, or use prepare.regen.request_mode=tokens"
                )
            if not self._count_only_warned:
                self._count_only_warned = True
                log.warning(
                    "%s returns no prompt_token_ids: chat prompts are checked by their length only",
                    server.url,
                )
        message = choice.get("message") or {}
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        return self._answer(choice, message.get("content"), reasoning, ans, server, what)

    def _answer(
        self, choice: dict, text: str | None, reasoning: str | None, ans: dict, server: ServerInfo, what: str
    ) -> Answer:
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise RegenServerError(
                f"{what}: {server.url} ended the answer with finish_reason {finish!r} (expected stop or length)"
            )
        ids = choice.get("token_ids")
        stop = self.target.stop_ids
        if ids is not None:
            g = cut_at_stop([int(t) for t in ids], stop, self.cfg.max_new_tokens)
            decoded = self.target.tokenizer.decode(
                [t for t in g.token_ids if t not in stop], skip_special_tokens=False
            )
            return Answer(answer_message(decoded), len(g.token_ids), finish)
        tokens = (ans.get("usage") or {}).get("completion_tokens")
        if (text is None and reasoning is None) or tokens is None:
            raise RegenServerError(
                f"{what}: {server.url} answered without text or usage.completion_tokens: {ans!r:.300}"
            )
        return Answer(answer_message(text or "", reasoning), int(tokens), finish)


def _first_choice(ans: dict[str, Any], server: ServerInfo, what: str) -> dict[str, Any]:
    choices = ans.get("choices") or []
    if not choices:
        raise RegenServerError(f"{what}: {server.url} answered without choices: {json.dumps(ans)[:300]}")
    return choices[0]


# -- a conversation ----------------------------------------------------------------------------------------------
def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    return int(hash01(seed, f"regen-server-turn-{turn}", conv_id) * (2**31 - 1))


def answer_conversation(item: Pending, client: RegenClient, cfg: RegenerateConfig, max_len: int) -> Pending:
    """Every user turn of ``item`` answered in order (each seeing the answers before it), until one has no room
    for ``max_new_tokens`` within ``max_len``."""
    tok = client.target.tokenizer
    item.msgs, item.tokens, item.finish, item.open = list(item.system), [], [], True
    for turn, user in enumerate(item.users):
        item.msgs.append(user)
        prompt = item.first_prompt if turn == 0 else format_prompt(item.msgs, tok)
        if len(prompt) + cfg.max_new_tokens > max_len:
            item.msgs.pop()
            item.open = False  # no room for another answer: the conversation ends here
            break
        a = client.answer(item.conv.id, turn, item.msgs, prompt, turn_seed(cfg.seed, item.conv.id, turn))
        item.msgs.append(a.message)
        item.tokens.append(a.tokens)
        item.finish.append(a.finish)
    return item


# -- the run -----------------------------------------------------------------------------------------------------
def regenerate_via_server(
    convs: Sequence[Conversation],
    target: ServerTarget,
    cfg: RegenerateConfig,
    out_path: str | os.PathLike,
    servers: Sequence[ServerInfo],
    *,
    progress: bool = True,
) -> RegenerateResult:
    """Answer every user turn of ``convs`` through ``servers``; append the records to ``out_path`` (resumable,
    the same records and rules as :func:`data.regenerate.regenerate`)."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    res = RegenerateResult(path=out_path)
    done = load_done_ids(out_path)
    max_len = _max_len(target, cfg, servers)
    items, res.skipped_no_user = pending_items(convs, cfg, target.tokenizer)
    if cfg.max_batches is not None:  # the same fixed prefix of the order as the in-process engines take
        cut = items[cfg.max_batches * cfg.batch_size :]
        if any(it.conv.id not in done for it in cut):
            log.info(
                "regenerate: only the first %d batches (max_batches); a later run continues", cfg.max_batches
            )
        res.past_max_batches = sum(it.conv.id not in done for it in cut)
        res.remaining += res.past_max_batches
        items = items[: cfg.max_batches * cfg.batch_size]
    todo = [it for it in items if it.conv.id not in done]
    res.already_done = len(items) - len(todo)
    log_already_done(res, len(items), len(todo))
    client = RegenClient(target, cfg, servers)
    finish: Counter[str] = Counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress)
    t0 = time.perf_counter()
    budget_hit = threading.Event()

    def one(it: Pending) -> Pending | None:
        if cfg.time_budget_s is not None and time.perf_counter() - t0 >= cfg.time_budget_s:
            budget_hit.set()
            return None  # not started: a later run answers it
        return answer_conversation(it, client, cfg, max_len)

    def written(item: Pending) -> None:
        _write(fout, pending_record(item, target.name, finish), res)
        bar.update(1)
        bar.set_postfix(tok_s=f"{res.generated_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")

    with open(out_path, "a", encoding="utf-8") as fout:
        try:
            error = _run_pool(todo, one, cfg.concurrency * len(servers), written, budget_hit)
        finally:  # a KeyboardInterrupt too: what was answered stays on disk
            fout.flush()
            os.fsync(fout.fileno())
    bar.close()
    res.seconds = time.perf_counter() - t0
    res.finish = dict(finish)
    if error is not None:
        raise error
    if budget_hit.is_set() or res.written < len(todo):
        res.remaining += len(todo) - res.written
        log.info(
            "regenerate: time budget of %.0f s used; %d conversations keep their original answers (a later run "
            "continues)",
            cfg.time_budget_s or 0,
            len(todo) - res.written,
        )
    log_written(res)
    return res


def _run_pool(
    todo: Sequence[Pending],
    one: Callable[[Pending], Pending | None],
    workers: int,
    on_done: Callable[[Pending], None],
    stop: threading.Event,
) -> BaseException | None:
    """``one`` over ``todo`` on ``workers`` threads (at most twice that many queued), ``on_done`` in this thread for
    each answered conversation. The first failure stops new submissions and cancels the queued ones; the ones in
    flight finish (and are written) before it is returned. An interrupt cancels the queue and is raised."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="regen-server")
    queued, running = iter(todo), set()
    error: BaseException | None = None
    try:
        while True:
            while error is None and not stop.is_set() and len(running) < 2 * workers:
                it = next(queued, None)
                if it is None:
                    break
                running.add(pool.submit(one, it))
            if not running:
                return error
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                if fut.cancelled():
                    continue
                try:
                    item = fut.result()
                except Exception as e:  # noqa: BLE001 - returned once the conversations in flight are written
                    if error is None:
                        error = e
                        for f in running:
                            f.cancel()
                    continue
                if item is not None:
                    on_done(item)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _write(fout, record: dict[str, Any], res: RegenerateResult) -> None:
    fout.write(json.dumps(record, ensure_ascii=False) + "\n")
    fout.flush()  # in the kernel: a killed process loses nothing written
    res.written += 1
    res.turns += len(record["meta"]["finish_reasons"])
    res.generated_tokens += record["meta"]["generated_tokens"]
    if res.written % FSYNC_EVERY == 0:
        os.fsync(fout.fileno())


def _max_len(target: ServerTarget, cfg: RegenerateConfig, servers: Sequence[ServerInfo]) -> int:
    """Longest prompt + answer: ``max_len``, else the target's window, and never more than a server takes."""
    limits = [cfg.max_len or target.max_position_embeddings or 1 << 30]
    limits += [s.max_model_len for s in servers if s.max_model_len]
    return int(min(limits))


# -- the servers -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def regeneration_servers(
    target: ServerTarget, cfg: RegenerateConfig, log_path: Path, threads: int | None = None
) -> Iterator[list[ServerInfo]]:
    """The servers to ask: ``cfg.server_url``'s, or a vLLM server eyas starts (from ``.venv-vllm``) and stops on
    every exit path."""
    urls = cfg.server_urls
    if urls:
        servers = [server_info(u) for u in urls]
        log.info("regenerating through %s", ", ".join(f"{s.url} ({s.model})" for s in servers))
        yield servers
        return
    import torch

    scfg = cfg.server
    python = engine_python("vllm", scfg)
    port = scfg.port or free_port(scfg.host)
    cmd = vllm_server_command(
        python,
        target.source,
        port,
        scfg,
        "--generation-config",
        "vllm",
        served_name=SERVED_NAME,
        max_num_seqs=cfg.concurrency,
    )
    cuda = torch.cuda.is_available()
    server = EngineServer(
        cmd,
        f"http://{scfg.host}:{port}",
        log_path,
        env=engine_env("vllm", scfg, cuda, threads),
        stop_grace_s=scfg.stop_grace_s,
    )
    with server:
        server.wait_ready(scfg.startup_timeout_s)
        yield [ServerInfo(server.url, SERVED_NAME, scfg.max_model_len)]


class ServerSession:
    """The servers of one prepare run, started on first use (a run whose splits are all done starts none) and
    stopped by :meth:`close`."""

    def __init__(
        self, target: ServerTarget, cfg: RegenerateConfig, log_path: Path, threads: int | None = None
    ):
        self.target, self.cfg, self.log_path, self.threads = target, cfg, log_path, threads
        self._stack = contextlib.ExitStack()
        self._servers: list[ServerInfo] | None = None

    def servers(self) -> list[ServerInfo]:
        if self._servers is None:
            self._servers = self._stack.enter_context(
                regeneration_servers(self.target, self.cfg, self.log_path, self.threads)
            )
        return self._servers

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ServerSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- agreement ---------------------------------------------------------------------------------------------------
@dataclass
class Agreement:
    """How two regenerations of the same conversations compare, turn by turn (first turns share their prompt;
    later turns only as long as the earlier answers agree)."""

    turns: int
    """Turns compared (present in both)."""
    identical: int
    """Turns whose answer (reasoning and content) is the same text."""
    mean_common_prefix: float
    """Mean over turns of (common leading tokens) / (tokens of the longer answer)."""
    first_differences: list[tuple[str, int, int]]
    """(conversation id, turn, token position) of the first few differing turns."""

    @property
    def rate(self) -> float:
        return self.identical / self.turns if self.turns else float("nan")

    def summary(self) -> str:
        return (
            f"{self.identical}/{self.turns} turns identical ({self.rate:.1%}), mean common prefix "
            f"{self.mean_common_prefix:.1%} of the answer; first differences (id, turn, token): "
            f"{self.first_differences}"
        )


def regeneration_agreement(
    a_path: str | os.PathLike, b_path: str | os.PathLike, tokenizer, shown: int = 10
) -> Agreement:
    """Compare two regeneration JSONLs (e.g. through a server and in process) by their answers' tokens."""
    from eyas.data.regenerate import read_regenerated

    def answers(conv: Conversation) -> list[list[int]]:
        return [
            list(
                tokenizer((m.get("reasoning") or "") + "\x00" + m["content"], add_special_tokens=False)[
                    "input_ids"
                ]
            )
            for m in conv.messages
            if m["role"] == "assistant"
        ]

    a = {c.id: answers(c) for c in read_regenerated(a_path)}
    b = {c.id: answers(c) for c in read_regenerated(b_path)}
    turns = identical = 0
    prefix = 0.0
    diffs: list[tuple[str, int, int]] = []
    for cid in sorted(a.keys() & b.keys()):
        for t, (x, y) in enumerate(zip(a[cid], b[cid])):
            turns += 1
            i = first_difference(x, y)
            if i is None:
                identical += 1
                prefix += 1.0
                continue
            prefix += i / max(len(x), len(y))
            if len(diffs) < shown:
                diffs.append((cid, t + 1, i))
    return Agreement(turns, identical, prefix / turns if turns else float("nan"), diffs)
