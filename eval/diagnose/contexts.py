"""Prompts at a given context length: real chat turns (``filler``) put before each prompt, through the target's chat template."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from eyas.eval.acceptance import (
    PromptSetSpec,
)
from eyas.eval.diagnose.config import DiagnoseConfig, DiagnoseError
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401


# -- prompts -----------------------------------------------------------------------------------------------------
@dataclass
class ContextPrompts:
    """One prompt set's token-id prompts at every measured context length."""

    spec: PromptSetSpec
    by_context: dict[int, list[list[int]]]
    """Nominal context length L -> prompts of about L tokens (never shorter than the bare prompt)."""

    def __post_init__(self) -> None:
        empty = [c for c, p in self.by_context.items() if not p]
        if not self.by_context or empty:
            raise DiagnoseError(f"prompt set {self.spec.name} ({self.spec.source}) has no prompts")
        if any(len(p) == 0 for ps in self.by_context.values() for p in ps):
            raise DiagnoseError(f"prompt set {self.spec.name}: a prompt has no tokens")


def filler_pairs(corpus: str, limit: int = 64) -> list[list[dict[str, str]]]:
    """(user, assistant) turn pairs from the first conversations of a corpus, to pad contexts with."""
    from eyas.data.corpora.config import load_corpus_config
    from eyas.data.corpora.sources import read_source

    pairs: list[list[dict[str, str]]] = []
    for src in load_corpus_config(corpus).sources:
        for conv in itertools.islice(read_source(src), limit):
            msgs = [m for m in conv.messages if m["role"] in ("user", "assistant")]
            for u, a in zip(msgs, msgs[1:]):
                if u["role"] == "user" and a["role"] == "assistant" and u["content"] and a["content"]:
                    pairs.append(
                        [
                            {"role": "user", "content": u["content"]},
                            {"role": "assistant", "content": a["content"]},
                        ]
                    )
        if len(pairs) >= limit:
            break
    if not pairs:
        raise DiagnoseError(f"filler corpus {corpus!r} has no user/assistant turn pairs to pad contexts with")
    return pairs


def pad_to_context(
    messages: list[dict[str, Any]], pairs: list[list[dict[str, str]]], tokenizer, length: int, offset: int = 0
) -> list[int]:
    """Token ids of earlier filler turns + ``messages`` under the chat template, at most ``length`` tokens
    (the last filler answer cut to fit), or the bare prompt when it alone is longer."""
    from eyas.data.chat import format_prompt

    ids = format_prompt(messages, tokenizer)
    if len(ids) >= length:
        return ids
    chosen: list[dict[str, str]] = []
    for j in range(4 * len(pairs)):
        user, answer = pairs[(offset + j) % len(pairs)]
        full = format_prompt(chosen + [user, answer] + messages, tokenizer)
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
            trial = format_prompt(chosen + [user, cut] + messages, tokenizer)
            if len(trial) <= length:
                best, lo = trial, mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return best
        # even the question alone is too long: try the next pair
    return ids


def build_prompts(cfg: DiagnoseConfig, tokenizer) -> dict[str, ContextPrompts]:
    """Every set's prompts at every context length of ``cfg`` (chat template + filler)."""
    pairs = filler_pairs(cfg.filler)
    out = {}
    for spec in cfg.prompt_sets:
        msgs = prompt_messages(spec, cfg.seed)
        by_context = {
            length: [pad_to_context(m, pairs, tokenizer, length, offset=3 * i) for i, m in enumerate(msgs)]
            for length in cfg.contexts
        }
        out[spec.name] = ContextPrompts(spec, by_context)
    return out


def prompts_from_ids(
    spec: PromptSetSpec, prompts: list[list[int]], filler: list[int], contexts: list[int]
) -> ContextPrompts:
    """Targets without a chat template: each prompt prefixed by the tail of ``filler`` ids to reach L tokens."""
    if not prompts:
        raise DiagnoseError(f"prompt set {spec.name} is empty: no prompts to measure")
    by_context = {}
    for length in contexts:
        rows = []
        for p in prompts:
            need = max(length - len(p), 0)
            if need > len(filler):
                raise DiagnoseError(f"filler of {len(filler)} ids cannot pad a prompt to {length} tokens")
            rows.append(list(filler[len(filler) - need :]) + list(p) if need else list(p))
        by_context[length] = rows
    return ContextPrompts(spec, by_context)
