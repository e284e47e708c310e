"""Regeneration (self-distillation): replace the assistant turns of conversations with the target's own answers.

Design decisions:
- A drafter is trained to predict the *target's* continuations, so its training answers should be the target's:
  every user turn is answered by the target, turn by turn, each turn seeing the target's own earlier answers
  (the original assistant turns are dropped, and kept in ``meta['reference']``).
- Generation is batched with left padding; conversations are sorted by prompt length first so a batch pads
  little. The batch composition is fixed by the input alone (sorted order, then chunks), and the sampling seed
  of a batch is derived from its index, so a resumed run writes what an uninterrupted one would.
- Output is a JSONL of docs/DESIGN.md conversation records, appended and flushed (fsync) once per batch. A restart
  reads it, drops a torn last line (a batch that was being written when the job died), and skips every id
  already there. Each record carries ``meta.regenerated = true``, the tokens generated and the finish reason of
  every turn (``stop``: the end-of-turn token; ``length``: ``max_new_tokens``); a conversation whose next turn
  has no room left within ``max_len`` ends there (``meta.ended_early = "context"``).
- Engine (measured on the embedded target, see the data-stage report): a plain decode loop over the model with a
  dynamic KV cache that drops rows from the batch as soon as they emit the end-of-turn token, so one long
  answer does not make the whole batch pay for its length; transformers' ``generate`` stays available
  (``engine=hf``) for architectures with exotic caches. Sampling draws from a per-batch ``torch.Generator``.
  Generated ``<think>…</think>`` text is
  split back into the ``reasoning`` field, so the chat template renders it as the model wrote it.
- ``engine=server`` answers through an OpenAI-compatible serving engine instead (a target too large for one
  process): :mod:`eyas.data.regenerate_server`, with the same records, resume rules and stopping points.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.data.chat import format_prompt, split_reasoning
from eyas.data.corpora.mixtures import hash01
from eyas.data.types import Conversation
from eyas.serving.engine_process import EngineServerConfig
from eyas.serving.verify import warp_probs

log = logging.getLogger(__name__)

ENGINES = ("loop", "hf", "server")
SERVER_ONLY_FIELDS = ("server_url", "request_mode", "concurrency", "retries", "retry_backoff_s", "server")
"""Fields only ``engine=server`` reads (kept out of the prepare stage's config hash for the other engines)."""


@dataclass
class RegenerateConfig:
    """How the target answers the prompts."""

    max_new_tokens: int = 512
    """Most tokens generated per assistant turn."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples with this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (sampling only)."""
    seed: int = 0
    """Sampling seed (each batch draws from its own seed derived from this one and the batch index)."""
    batch_size: int = 32
    """Conversations generated together."""
    max_turns: int | None = None
    """Regenerate at most this many user turns per conversation (later turns are dropped); None: all."""
    max_len: int | None = None
    """Longest prompt + answer in tokens (None: the model's ``max_position_embeddings``); a turn without room for
    ``max_new_tokens`` ends the conversation there."""
    engine: str = "loop"
    """``loop``: eyas' decode loop, which drops finished rows from the batch as it goes; ``hf``: transformers'
    ``generate`` (every row runs until the whole batch is done; for architectures the loop does not handle);
    ``server``: an OpenAI-compatible serving engine (``server_url``, else a vLLM server eyas starts from
    ``.venv-vllm``; :mod:`eyas.data.regenerate_server`), for targets that do not fit one process."""
    cache: str = "dynamic"
    """KV cache of the ``hf`` engine: ``dynamic`` or ``static``."""
    time_budget_s: float | None = None
    """Stop starting new batches after this many seconds of generation in one run (None: no limit). What is
    left keeps its original answers (see ``unfinished``); a later run with the same output continues where this one
    stopped."""
    max_batches: int | None = None
    """Regenerate only the first this many batches of the fixed (length-sorted) order of each split, counted over
    all runs (None: all). Like ``time_budget_s`` it leaves the rest unfinished, and a later run with a larger value
    continues; unlike it, the result does not depend on the machine's speed, so a benchmark's data can be remade
    exactly."""
    unfinished: str = "keep"
    """What a run stopped early (``time_budget_s`` or ``max_batches``) does with conversations not regenerated
    yet: ``keep`` their original answers in the prepared data, or ``drop`` them (train on the target's own answers
    only)."""
    server_url: str | list[str] | None = None
    """``engine=server``: the server(s) to ask (``http://host:port``); a list spreads the conversations over
    them (data parallel). None: eyas starts vLLM from ``.venv-vllm`` (``make vllm``) with ``server``'s settings."""
    request_mode: str = "tokens"
    """``engine=server``: ``tokens`` (eyas renders the chat template and sends token ids to ``/v1/completions``:
    the target sees exactly the training text) or ``chat`` (messages to ``/v1/chat/completions``, for endpoints
    that take only messages; the prompt the server reports it rendered must equal the target template's)."""
    concurrency: int = 8
    """``engine=server``: conversations in flight per server (each asks its turns one after another)."""
    retries: int = 4
    """``engine=server``: retries of a request that failed for a transient reason (connection, HTTP 408, 429,
    5xx), with exponential backoff; a 4xx answer is final."""
    retry_backoff_s: float = 1.0
    """``engine=server``: seconds before the first retry; doubled for each further one (at most 60 s)."""
    server: EngineServerConfig = field(default_factory=EngineServerConfig)
    """``engine=server`` without ``server_url``: how eyas starts vLLM (venv, timeouts, dtype, ``max_model_len``
    (the longest prompt + answer it takes), extra arguments and environment)."""

    @property
    def server_urls(self) -> list[str]:
        """``server_url`` as a list (empty: eyas starts a server)."""
        if not self.server_url:
            return []
        urls = [self.server_url] if isinstance(self.server_url, str) else list(self.server_url)
        return [u.rstrip("/") for u in urls]

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {self.batch_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or null, not {self.max_turns}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.request_mode not in ("tokens", "chat"):
            raise ValueError(f"request_mode must be 'tokens' or 'chat', not {self.request_mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {self.concurrency}")
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ValueError(
                f"retries and retry_backoff_s must be >= 0, not {self.retries}, {self.retry_backoff_s}"
            )
        if isinstance(self.server, dict):
            from eyas.common import build_config

            self.server = build_config(EngineServerConfig, self.server, "prepare.regen.server")
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"server_url must be http(s)://host:port, not {bad[0]!r}")
        if self.unfinished not in ("keep", "drop"):
            raise ValueError(f"unfinished must be 'keep' or 'drop', not {self.unfinished!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 or null, not {self.time_budget_s}")
        if self.max_batches is not None and self.max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or null, not {self.max_batches}")
        if self.cache not in ("dynamic", "static"):
            raise ValueError(f"cache must be 'dynamic' or 'static', not {self.cache!r}")


@dataclass
class RegenerateResult:
    """What a regeneration run did."""

    path: Path
    """The JSONL written (all records, earlier runs' included)."""
    written: int = 0
    """Records written by this run."""
    already_done: int = 0
    """Input conversations skipped because the output already held them."""
    skipped_no_user: int = 0
    """Conversations without a user turn (nothing to answer)."""
    turns: int = 0
    """Assistant turns generated."""
    generated_tokens: int = 0
    """Tokens generated (end-of-turn token included)."""
    seconds: float = 0.0
    """Wall time spent in generation."""
    finish: dict[str, int] = field(default_factory=dict)
    """Turns per finish reason (``context``: conversations cut short for lack of room)."""
    remaining: int = 0
    """Conversations left unanswered because ``time_budget_s`` ran out or they lie past ``max_batches`` (0: the
    output is complete)."""
    past_max_batches: int = 0
    """Of ``remaining``, those past the first ``max_batches`` batches: a rerun with the same ``max_batches`` has
    nothing to do for them (a larger one continues)."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class GeneratedTurn:
    """One generated answer."""

    token_ids: list[int]
    """Generated ids, cut after the end-of-turn token."""
    finish: str
    """``stop`` (end-of-turn token generated) or ``length``."""


# -- helpers -------------------------------------------------------------------------------------------------
def load_done_ids(path: Path) -> set[str]:
    """Ids already in the output JSONL; a torn last line (the job died while writing) is cut off the file."""
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                done.add(str(json.loads(raw)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            good_end += len(raw)
    size = path.stat().st_size
    if good_end < size:
        log.warning(
            "%s: dropping %d bytes of an incomplete last batch (the job was interrupted mid-write)",
            path,
            size - good_end,
        )
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def cut_at_stop(ids: Sequence[int], stop_ids: set[int], max_new_tokens: int) -> GeneratedTurn:
    """The generated ids up to and including the first stop token, and why generation ended."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return GeneratedTurn(list(ids[: i + 1]), "stop")
    return GeneratedTurn(list(ids[:max_new_tokens]), "length")


def _stop_ids(target) -> set[int]:
    return stop_ids_of(getattr(target.model, "generation_config", None), target.tokenizer)


def stop_ids_of(generation_config, tokenizer) -> set[int]:
    """The tokens that end an answer: the generation config's ``eos_token_id`` (one or several) and the
    tokenizer's."""
    ids: set[int] = set()
    for src in (generation_config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(int(x) for x in v)
    if not ids:
        raise ValueError(
            "the target has no eos_token_id (tokenizer or generation config): cannot tell where an "
            "answer ends"
        )
    return ids


def _user_turns(
    conv: Conversation, max_turns: int | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(leading system messages, user messages to answer in order)."""
    system = [dict(m) for m in conv.messages if m["role"] == "system"][:1]
    users = [dict(m) for m in conv.messages if m["role"] == "user"]
    return system, users[:max_turns] if max_turns else users


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token per row from fp32 logits [b, V]: argmax when temperature is 0, else a draw from
    :func:`serving.verify.warp_probs` (temperature and nucleus), the distribution speculative sampling keeps."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(warp_probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T] left-padded
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    return ids, attn


@torch.inference_mode()
def generate_batch(
    target, prompts: list[list[int]], cfg: RegenerateConfig, seed: int, stop_ids: set[int]
) -> list[GeneratedTurn]:
    """Answer a batch of tokenized prompts with the configured engine."""
    if cfg.engine == "loop":
        return _generate_loop(target, prompts, cfg, seed, stop_ids)
    return _generate_hf(target, prompts, cfg, seed, stop_ids)


def _pad_id(target, stop_ids: set[int]) -> int:
    pad = target.tokenizer.pad_token_id
    return int(pad) if pad is not None else min(stop_ids)


def _generate_loop(
    target, prompts: list[list[int]], cfg: RegenerateConfig, seed: int, stop_ids: set[int]
) -> list[GeneratedTurn]:
    """Left-padded prefill, then one token per step for the rows still generating, over a static slot cache
    (no per-step copy of the growing KV); a row that emits a stop token leaves the batch (its KV rows are
    dropped), so short answers cost nothing after they end."""
    dev = target.device
    ids, attn = _left_pad(prompts, _pad_id(target, stop_ids))
    ids, attn = ids.to(dev), attn.to(dev).bool()
    b, width = ids.shape
    gen = torch.Generator(device=dev).manual_seed(seed) if cfg.temperature > 0 else None
    stop = torch.tensor(sorted(stop_ids), device=dev)
    total = width + cfg.max_new_tokens
    cache = target.new_cache(total)
    key_ok = torch.zeros(b, total, dtype=torch.bool, device=dev)  # [B, slots]: slot holds a real token
    key_ok[:, :width] = attn
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]: positions restart after the left padding
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(width, dtype=torch.bool, device=dev)
    mask = (causal[None] & attn[:, None, :]) | eye[None]  # pad rows see themselves only: no all-masked row
    cache.prepare(torch.arange(width, device=dev), width)
    logits = target.forward(ids, position_ids=pos, attention_mask=mask[:, None], cache=cache, logits="last")
    logits = logits.logits[:, -1]  # [B, V] fp32
    live = torch.arange(b, device=dev)  # original row of each row still in the batch
    next_pos = pos[:, -1] + 1  # [b]
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(cfg.max_new_tokens):
        tok = sample_next(logits, cfg.temperature, cfg.top_p, gen)  # [b]
        for r, t in zip(live.tolist(), tok.tolist()):
            out[r].append(t)
        keep = ~torch.isin(tok, stop)
        if step == cfg.max_new_tokens - 1 or not bool(keep.any()):
            break
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(-1)
            cache.select_rows(idx)
            live, key_ok, next_pos, tok = live[idx], key_ok[idx], next_pos[idx], tok[idx]
        slot = width + step
        key_ok[:, slot] = True
        cache.prepare(torch.tensor([slot], device=dev), slot + 1)
        res = target.forward(
            tok[:, None],
            position_ids=next_pos[:, None],
            attention_mask=key_ok[:, None, None, : slot + 1],
            cache=cache,
            logits="last",
        )
        logits = res.logits[:, -1]
        next_pos = next_pos + 1
    return [cut_at_stop(row, stop_ids, cfg.max_new_tokens) for row in out]


def _generate_hf(
    target, prompts: list[list[int]], cfg: RegenerateConfig, seed: int, stop_ids: set[int]
) -> list[GeneratedTurn]:
    """One transformers ``generate`` call over the left-padded batch."""
    pad = _pad_id(target, stop_ids)
    ids, attn = _left_pad(prompts, pad)
    width = ids.shape[1]
    kwargs: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad,
        do_sample=cfg.temperature > 0,
    )
    if cfg.temperature > 0:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=None)
        torch.manual_seed(seed)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if cfg.cache == "static":
        kwargs["cache_implementation"] = "static"
    out = target.model.generate(
        input_ids=ids.to(target.device), attention_mask=attn.to(target.device), **kwargs
    )  # [B, T + new]
    new = out[:, width:].tolist()
    return [cut_at_stop(row, stop_ids, cfg.max_new_tokens) for row in new]


def _batch_seed(seed: int, index: int) -> int:
    return int(hash01(seed, "regen-batch", str(index)) * (2**31 - 1))


# -- the run -------------------------------------------------------------------------------------------------
def regenerate(
    convs: Sequence[Conversation],
    target,
    cfg: RegenerateConfig,
    out_path: str | os.PathLike,
    *,
    progress: bool = True,
) -> RegenerateResult:
    """Answer every user turn of ``convs`` with the target; append the records to ``out_path`` (resumable)."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    res = RegenerateResult(path=out_path)
    done = load_done_ids(out_path)
    tok = target.tokenizer
    stop_ids = _stop_ids(target)
    max_len = cfg.max_len or int(getattr(target.config, "max_position_embeddings", 1 << 30))

    items, res.skipped_no_user = pending_items(convs, cfg, tok)
    batches = [items[i : i + cfg.batch_size] for i in range(0, len(items), cfg.batch_size)]
    todo = sum(1 for it in items if it.conv.id not in done)
    res.already_done = len(items) - todo
    log_already_done(res, len(items), todo)

    bar = tqdm(total=todo, desc="regenerate", unit="conv", disable=not progress)
    finish: Counter[str] = Counter()
    with open(out_path, "a", encoding="utf-8") as fout:
        for b, batch in enumerate(batches):
            batch = [it for it in batch if it.conv.id not in done]
            if not batch:
                continue
            stop = None
            if cfg.max_batches is not None and b >= cfg.max_batches:
                stop = f"the first {cfg.max_batches} batches are done (max_batches)"
            elif cfg.time_budget_s is not None and res.seconds >= cfg.time_budget_s:
                stop = f"time budget of {cfg.time_budget_s:.0f} s used"
            if stop:
                res.remaining = todo - res.written
                if cfg.max_batches is not None and b >= cfg.max_batches:  # every earlier batch is done
                    res.past_max_batches = res.remaining
                log.info(
                    "regenerate: %s; %d conversations keep their original answers (a later run continues)",
                    stop,
                    res.remaining,
                )
                break
            t0 = time.perf_counter()
            records = _regenerate_batch(
                batch, target, cfg, _batch_seed(cfg.seed, b), stop_ids, max_len, finish
            )
            res.seconds += time.perf_counter() - t0
            fout.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            fout.flush()
            os.fsync(fout.fileno())
            res.written += len(records)
            for r in records:
                res.turns += len(r["meta"]["finish_reasons"])
                res.generated_tokens += r["meta"]["generated_tokens"]
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{res.tokens_per_s:.0f}")
    bar.close()
    res.finish = dict(finish)
    log_written(res)
    return res


def pending_items(
    convs: Sequence[Conversation], cfg: RegenerateConfig, tokenizer
) -> tuple[list[Pending], int]:
    """(the conversations to answer in their fixed order, how many have no user turn): sorted by first-prompt
    length over the whole input, done or not, so batches (and ``max_batches``) are the same in every run."""
    items, seen, no_user = [], set(), 0
    for conv in convs:
        if conv.id in seen:
            continue
        seen.add(conv.id)
        system, users = _user_turns(conv, cfg.max_turns)
        if not users:
            no_user += 1
            continue
        items.append(Pending(conv, system, users, format_prompt(system + users[:1], tokenizer)))
    items.sort(key=lambda it: (len(it.first_prompt), it.conv.id))
    return items, no_user


def log_already_done(res: RegenerateResult, total: int, todo: int) -> None:
    if res.already_done:
        log.info(
            "regenerate: %d of %d conversations already in %s; generating the other %d",
            res.already_done,
            total,
            res.path,
            todo,
        )


def log_written(res: RegenerateResult) -> None:
    log.info(
        "regenerate: wrote %d conversations (%d turns, %d tokens) at %.1f tok/s into %s",
        res.written,
        res.turns,
        res.generated_tokens,
        res.tokens_per_s,
        res.path,
    )


@dataclass
class Pending:
    """A conversation to regenerate, and the messages its answers are built from."""

    conv: Conversation
    system: list[dict[str, Any]]
    users: list[dict[str, Any]]
    first_prompt: list[int]
    msgs: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    open: bool = True


def _regenerate_batch(
    batch: list[Pending],
    target,
    cfg: RegenerateConfig,
    seed: int,
    stop_ids: set[int],
    max_len: int,
    finish: Counter[str],
) -> list[dict[str, Any]]:
    tok = target.tokenizer
    for s in batch:
        s.msgs, s.tokens, s.finish, s.open = list(s.system), [], [], True
    for turn in range(max(len(s.users) for s in batch)):
        active = []
        for s in batch:
            if not s.open or turn >= len(s.users):
                continue
            s.msgs.append(s.users[turn])
            prompt = s.first_prompt if turn == 0 else format_prompt(s.msgs, tok)
            if len(prompt) + cfg.max_new_tokens > max_len:
                s.msgs.pop()
                s.open = False  # no room for another answer: the conversation ends here
                continue
            active.append((s, prompt))
        if not active:
            break
        outs = generate_batch(target, [p for _, p in active], cfg, seed + turn, stop_ids)
        for (s, _), g in zip(active, outs):
            s.msgs.append(
                answer_message(
                    tok.decode([t for t in g.token_ids if t not in stop_ids], skip_special_tokens=False)
                )
            )
            s.tokens.append(len(g.token_ids))
            s.finish.append(g.finish)
    return [pending_record(s, target.info.name, finish) for s in batch]


def answer_message(text: str, reasoning: str | None = None) -> dict[str, Any]:
    """The assistant message of a generated answer: a ``<think>…</think>`` block in ``text`` (or ``reasoning``
    given apart, as a server's reasoning parser returns it) goes into the ``reasoning`` field."""
    text = text.strip()
    if reasoning is None:
        reasoning, text = split_reasoning(text)
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning and reasoning.strip():
        msg["reasoning"] = reasoning.strip()
    return msg


def pending_record(s: Pending, regenerated_by: str, finish: Counter[str]) -> dict[str, Any]:
    """The output record of a regenerated conversation (docs/DESIGN.md format, with the ``meta`` above);
    counts its finish reasons into ``finish``."""
    conv = s.conv
    meta = dict(conv.meta)
    refs = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    if refs:
        meta.setdefault("reference", refs)
    meta.update(
        regenerated=True,
        generated_tokens=sum(s.tokens),
        tokens_per_turn=s.tokens,
        finish_reasons=s.finish,
        regenerated_by=regenerated_by,
    )
    finish.update(s.finish)
    if not s.open:
        meta["ended_early"] = "context"
        finish["context"] += 1
    return Conversation(id=conv.id, messages=s.msgs, source=conv.source, meta=meta).to_record()


def read_regenerated(path: str | os.PathLike) -> list[Conversation]:
    """The conversations of a regeneration JSONL."""
    from eyas.data.corpora.readers import iter_jsonl

    return [Conversation.from_record(rec) for _, rec in iter_jsonl(path)]
