"""Long contexts from real text: earlier conversation turns put before a prompt, and long training conversations.

Design decisions:
- The prefix is real chat: (user, assistant) turn pairs of a corpus eyas already reads (ShareGPT by default),
  never filler tokens, so prompt lookup and the drafter see the repetition statistics of real long chats.
- Everything goes through the target's chat template (:func:`data.chat.format_prompt`): the context length is
  the token count of the prompt the target really receives, system turn and assistant header included.
- To hit a length, whole pairs are added while they fit, then the next answer is cut (at a token boundary,
  longest cut that fits, by bisection). A prompt longer than the length is never cut: it is returned bare.
- ``offset`` rotates through the pairs so different prompts get different prefixes, deterministically.
- Evaluation draws the prefix from the held-out split (``split="eval"``) of the mixture the drafter was trained
  on, split by that mixture's own seed and eval fraction (a standalone corpus's split is another one whenever
  they differ), so a drafter is not measured on text it was trained on; long *training* conversations
  (:func:`long_conversations`) come from the training split. Packed rows do not teach long positions (positions
  restart per sample): a long sample must be one conversation, which is what these are.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.data.types import Conversation

if TYPE_CHECKING:
    from eyas.data.corpora.config import CorpusConfig

SPLITS = ("all", "train", "eval")


def corpus_of(corpus: str | CorpusConfig) -> CorpusConfig:
    """The mixture ``corpus`` names: a config, a ``conf/corpus`` name (or .yaml path), or a prepare stage's output
    directory (its ``corpus.json`` holds the mixture exactly as prepared, seed included)."""
    from eyas.data.corpora.config import CorpusConfig, corpus_config_from_dict, load_corpus_config

    if isinstance(corpus, CorpusConfig):
        return corpus
    recorded = Path(corpus) / "corpus.json"
    if recorded.is_file():
        return corpus_config_from_dict(json.loads(recorded.read_text())["config"])
    return load_corpus_config(corpus)


def split_conversations(corpus: str | CorpusConfig, split: str = "all") -> Iterator[Conversation]:
    """The conversations of a corpus's ``split`` (``all``, or its own ``train``/``eval`` split): the hash split
    with the mixture's seed and eval fraction, exactly as :func:`data.corpora.load_corpus` splits them for
    training, source after source. Generated sources (reasoning-gym) are not chat and are skipped."""
    from eyas.data.corpora.mixtures import split_of
    from eyas.data.corpora.sources import NATIVE_SPLIT_KINDS, read_source

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    cfg = corpus_of(corpus)
    for src in cfg.sources:
        if src.kind in NATIVE_SPLIT_KINDS:
            continue
        for conv in read_source(src):
            if split == "all" or split_of(conv.id, cfg.seed, cfg.eval_fraction) == split:
                yield conv


def turn_pairs(
    corpus: str | CorpusConfig = "sharegpt", limit: int | None = 64, split: str = "all"
) -> list[list[dict[str, str]]]:
    """(user, assistant) turn pairs of a corpus (:func:`corpus_of`), in its order: from the first ``limit``
    conversations of its ``split`` (:func:`split_conversations`). For prefixes held out from a drafter's training,
    give the mixture it was trained on (or its prepare directory) and ``split="eval"``."""
    pairs: list[list[dict[str, str]]] = []
    for conv in itertools.islice(split_conversations(corpus, split), limit):
        msgs = [m for m in conv.messages if m["role"] in ("user", "assistant")]
        for u, a in zip(msgs, msgs[1:]):
            if u["role"] == "user" and a["role"] == "assistant" and u["content"] and a["content"]:
                pairs.append(
                    [
                        {"role": "user", "content": u["content"]},
                        {"role": "assistant", "content": a["content"]},
                    ]
                )
    if not pairs:
        name = corpus.name if not isinstance(corpus, str) else corpus
        raise ValueError(f"corpus {name!r} ({split}) has no user/assistant turn pairs to build contexts from")
    return pairs


def pad_to_context(
    messages: Sequence[dict[str, Any]],
    pairs: list[list[dict[str, str]]],
    tokenizer,
    length: int,
    offset: int = 0,
) -> list[int]:
    """Token ids of earlier turns + ``messages`` under the chat template, at most ``length`` tokens (the last
    earlier answer cut to fit), or the bare prompt when it alone is longer."""
    from eyas.data.chat import format_prompt

    messages = list(messages)
    system = [m for m in messages[:1] if m["role"] == "system"]  # a system turn stays first
    rest = messages[len(system) :]
    ids = format_prompt(messages, tokenizer)
    if len(ids) >= length:
        return ids
    chosen: list[dict[str, str]] = []
    for j in range(len(pairs)):  # each pair once: repeated text would flatter prompt lookup
        user, answer = pairs[(offset + j) % len(pairs)]
        full = format_prompt(system + chosen + [user, answer] + rest, tokenizer)
        if len(full) <= length:
            chosen += [user, answer]
            ids = full
            if len(full) == length:
                return ids
            continue
        words = tokenizer(answer["content"], add_special_tokens=False)["input_ids"]
        lo, hi, best = 1, len(words) - 1, None
        while lo <= hi:  # the longest cut of this answer that still fits
            mid = (lo + hi) // 2
            cut = {"role": "assistant", "content": tokenizer.decode(words[:mid])}
            trial = format_prompt(system + chosen + [user, cut] + rest, tokenizer)
            if len(trial) <= length:
                best, lo = trial, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return best
        # even the question alone is too long: try the next pair
    return ids


def long_conversations(
    pairs: list[list[dict[str, str]]], tokenizer, length: int, n: int, offset: int = 0
) -> list[Conversation]:
    """``n`` training conversations of whole turn pairs, each as long as fits in ``length`` tokens under the chat
    template (at least one pair), taking the pairs in order from ``offset`` (wrapping around)."""
    from eyas.data.chat import format_conversation

    def tokens(conv: Conversation) -> int:
        s = format_conversation(conv, tokenizer, max_len=1 << 30)
        return 0 if s is None else s.num_tokens

    out = []
    j = offset
    for i in range(n):
        conv = Conversation(
            id=f"long{length}-{offset}-{i}", messages=list(pairs[j % len(pairs)]), source="long"
        )
        j += 1
        for _ in range(len(pairs) - 1):
            nxt = Conversation(conv.id, conv.messages + pairs[j % len(pairs)], conv.source)
            if tokens(nxt) > length:
                break
            conv = nxt
            j += 1
        out.append(conv)
    return out
