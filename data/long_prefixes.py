"""Long contexts from real text: earlier conversation turns put before a prompt, and long training conversations.

Design decisions:
- The prefix is real chat: (user, assistant) turn pairs of a corpus eyas already reads (ShareGPT by default),
  never filler tokens, so prompt lookup and the drafter see the repetition statistics of real long chats.
- Everything goes through the target's chat template (:func:`data.chat.format_prompt`): the context length is
  the token count of the prompt the target really receives, system turn and assistant header included.
- To hit a length, whole pairs are added while they fit, then the next answer is cut (at a token boundary,
  longest cut that fits, by bisection). A prompt longer than the length is never cut: it is returned bare.
- ``offset`` rotates through the pairs so different prompts get different prefixes, deterministically.
- Evaluation draws the prefix from the corpus's held-out split (``split="eval"``) so a drafter trained on the
  corpus is not measured on text it was trained on; long *training* conversations (:func:`long_conversations`)
  come from the training split. Packed rows do not teach long positions (positions restart per sample): a
  long sample must be one conversation, which is what these are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from eyas.data.types import Conversation

SPLITS = ("all", "train", "eval")


def turn_pairs(
    corpus: str = "sharegpt", limit: int | None = 64, split: str = "all"
) -> list[list[dict[str, str]]]:
    """(user, assistant) turn pairs of a ``conf/corpus`` corpus, in its order: from its first ``limit``
    conversations of ``split`` (``all``, or the corpus's own ``train``/``eval`` hash split)."""
    from eyas.data.corpora.config import load_corpus_config
    from eyas.data.corpora.mixtures import split_of
    from eyas.data.corpora.sources import read_source

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    cfg = load_corpus_config(corpus)
    pairs: list[list[dict[str, str]]] = []
    for src in cfg.sources:
        convs = read_source(src)
        if split != "all":
            convs = (c for c in convs if split_of(c.id, cfg.seed, cfg.eval_fraction) == split)
        for conv in itertools.islice(convs, limit):
            msgs = [m for m in conv.messages if m["role"] in ("user", "assistant")]
            for u, a in zip(msgs, msgs[1:]):
                if u["role"] == "user" and a["role"] == "assistant" and u["content"] and a["content"]:
                    pairs.append(
                        [
                            {"role": "user", "content": u["content"]},
                            {"role": "assistant", "content": a["content"]},
                        ]
                    )
        if limit is not None and len(pairs) >= limit:
            break
    if not pairs:
        raise ValueError(
            f"corpus {corpus!r} ({split}) has no user/assistant turn pairs to build contexts from"
        )
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
    for j in range(4 * len(pairs)):
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
