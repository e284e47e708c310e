"""Chat formatting: a conversation rendered by the target's own chat template, with an assistant-only loss mask.

Design decisions:
- The text is the tokenizer's chat template applied to the whole conversation, tokenized once with the
  tokenizer's offsets (``add_special_tokens=False``: templates write their own BOS, as transformers'
  ``apply_chat_template`` does).
- The loss mask comes from character spans, not from separators: for assistant message i, the text of the
  conversation up to message i with the generation prompt (``P``) and up to and including message i (``Q``)
  are rendered by the same template; when ``P`` ⊂ ``Q`` ⊂ full text (prefix-wise), the assistant wrote exactly
  ``full[len(P):len(Q)]``: its content *and* the template's end-of-turn text (``<|im_end|>``, ``<|eot_id|>``,
  ``<end_of_turn>``...), which the drafter must learn to predict. A token is in the mask when its character
  span overlaps an assistant span. This works for any template that renders history the same way as the
  latest turn (Llama 3, ChatML, Gemma, Mistral, SmolLM2...).
- Templates that rewrite history (Qwen3 drops earlier turns' reasoning) break the prefix property; then the
  span starts where ``P`` and the full text part ways and covers the longest tail of the turn's own rendering
  (``Q[len(P):]``) found there, i.e. what the history rendering kept of the turn.
- Reasoning traces go where the template expects them: ``reasoning_content`` (or ``thinking``) when the
  template reads that key, else a ``<think>…</think>`` block before the content.
- Over-long samples are cut at ``max_len`` (mask cut with them); samples left without any loss token, empty
  conversations, conversations without an assistant turn and ones the template rejects are skipped and
  counted in :class:`FormatStats`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from eyas.data.types import Conversation, Sample

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations (no chat template, or no offsets)."""


@dataclass
class FormatStats:
    """Counts of a batch of formatted conversations."""

    seen: int = 0
    formatted: int = 0
    skipped_empty: int = 0
    """No message with any text."""
    skipped_no_assistant: int = 0
    """No assistant turn with content or reasoning (nothing to learn)."""
    skipped_template_error: int = 0
    """The chat template raised (e.g. roles that do not alternate)."""
    skipped_unmaskable: int = 0
    """An assistant turn could not be located in the rendered text."""
    truncated: int = 0
    """Samples cut at ``max_len`` (and kept)."""
    skipped_truncated_no_loss: int = 0
    """Samples whose assistant tokens all lay beyond ``max_len``."""
    tokens: int = 0
    loss_tokens: int = 0
    history_rewritten: int = 0
    """Samples whose template renders earlier turns differently (span located by the fallback)."""

    def merge(self, other: FormatStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class FormatResult:
    """Samples of a batch of conversations, with counts."""

    samples: list[Sample]
    stats: FormatStats = field(default_factory=FormatStats)


# -- template helpers ----------------------------------------------------------------------------------------
def _template_text(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "\n".join(str(v) for v in tpl.values())
    if not tpl:
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} has no chat template; eyas renders conversations with the target's own "
            "template (set tokenizer.chat_template, or use the instruct/chat variant of the model)"
        )
    return str(tpl)


def reasoning_key(tokenizer) -> str | None:
    """The message key the template reads reasoning from (``reasoning_content``/``thinking``), or None."""
    tpl = _template_text(tokenizer)
    if re.search(r"\breasoning_content\b", tpl):
        return "reasoning_content"
    if re.search(r"""message\s*(\.\s*thinking\b|\[\s*['"]thinking['"]\s*\])""", tpl):
        return "thinking"
    return None


def template_messages(messages: Sequence[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
    """Messages as the template expects them (reasoning under the template's key, or as a ``<think>`` block)."""
    key = reasoning_key(tokenizer)
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        r = m.get("reasoning")
        if r and m["role"] == "assistant":
            if key:
                msg[key] = r
            else:
                msg["content"] = f"{THINK_OPEN}\n{r}\n{THINK_CLOSE}\n\n{msg['content']}"
        out.append(msg)
    return out


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise ChatTemplateError(
            f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text"
        )
    return text


def _encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} is a slow tokenizer; loss masks need character offsets, which only fast "
            "tokenizers give (load it with use_fast=True / convert it with PreTrainedTokenizerFast)"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def assistant_char_spans(
    messages: list[dict[str, Any]], tokenizer
) -> tuple[str, list[tuple[int, int]], bool]:
    """(full text, [start, end) character span of every assistant turn, history rewritten?)."""
    full = _render(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    rewritten = False
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        p = _render(tokenizer, messages[:i], True)
        q = _render(tokenizer, messages[: i + 1], False)
        if q.startswith(p) and full.startswith(q):
            spans.append((len(p), len(q)))
            continue
        rewritten = True
        start = len(os.path.commonprefix([p, full]))
        body = q[len(p) :] if q.startswith(p) else q[len(os.path.commonprefix([p, q])) :]
        rest = full[start:]
        content = (m.get("content") or "").strip()
        at = body.find(content) if content else -1
        last_k = at if at >= 0 else len(body) - 1  # the kept tail must hold the turn's content
        k = next((k for k in range(last_k + 1) if body[k].strip() and rest.startswith(body[k:])), None)
        if k is None:
            raise _Unmaskable(f"assistant turn {i} not found in the rendered conversation")
        spans.append((start, start + len(body) - k))
    return full, spans, rewritten


class _Unmaskable(ValueError):
    pass


def mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for every token whose character span overlaps one of ``spans`` (both sorted by position)."""
    mask = [False] * len(offsets)
    j = 0
    for t, (s, e) in enumerate(offsets):
        e = max(e, s + 1)  # zero-width tokens count as the character they sit on
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and spans[j][0] < e:
            mask[t] = True
    return mask


# -- public API ----------------------------------------------------------------------------------------------
def format_conversation(
    conv: Conversation, tokenizer, max_len: int, stats: FormatStats | None = None
) -> Sample | None:
    """Token ids + assistant-only loss mask of ``conv``, or None when it is skipped (counted in ``stats``)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, not {max_len}")
    st = stats if stats is not None else FormatStats()
    st.seen += 1
    msgs = conv.messages
    if not any((m.get("content") or "").strip() or m.get("reasoning") for m in msgs):
        st.skipped_empty += 1
        return None
    if not any(
        m["role"] == "assistant" and ((m.get("content") or "").strip() or m.get("reasoning")) for m in msgs
    ):
        st.skipped_no_assistant += 1
        return None
    tmsgs = template_messages(msgs, tokenizer)
    try:
        full, spans, rewritten = assistant_char_spans(tmsgs, tokenizer)
    except _Unmaskable as e:
        st.skipped_unmaskable += 1
        log.debug("conversation %s skipped: %s", conv.id, e)
        return None
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja2 TemplateError and friends: the template rejects this conversation
        st.skipped_template_error += 1
        log.debug("conversation %s skipped: the chat template raised %s: %s", conv.id, type(e).__name__, e)
        return None
    ids, offsets = _encode_with_offsets(tokenizer, full)
    mask = mask_from_spans(offsets, spans)
    if len(ids) > max_len:
        st.truncated += 1
        ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        st.skipped_truncated_no_loss += 1
        return None
    st.history_rewritten += int(rewritten)
    st.formatted += 1
    st.tokens += len(ids)
    st.loss_tokens += sum(mask)
    return Sample(id=conv.id, input_ids=ids, loss_mask=mask, source=conv.source)


def format_conversations(
    convs: Iterable[Conversation], tokenizer, max_len: int, *, progress: bool = False
) -> FormatResult:
    """Format many conversations; skips are counted in the result's stats."""
    from tqdm.auto import tqdm

    res = FormatResult(samples=[])
    items = tqdm(convs, desc="format", unit="conv", disable=not progress)
    for conv in items:
        s = format_conversation(conv, tokenizer, max_len, res.stats)
        if s is not None:
            res.samples.append(s)
    return res


def prompt_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a generation prompt is built from: everything before the trailing assistant turn(s)."""
    msgs = list(messages)
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    return msgs


def format_prompt(conv: Conversation | Sequence[dict[str, Any]], tokenizer) -> list[int]:
    """Token ids of the generation prompt: the conversation up to (not including) its last assistant turn,
    followed by the template's assistant header."""
    messages = conv.messages if isinstance(conv, Conversation) else conv
    msgs = template_messages(prompt_messages(messages), tokenizer)
    if not msgs:
        raise ValueError("a prompt needs at least one message before the assistant turn")
    text = _render(tokenizer, msgs, True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of generated text holding a ``<think>…</think>`` block (the opening tag may be in
    the prompt already); (None, text) when there is none."""
    if THINK_CLOSE not in text:
        return None, text
    head, _, tail = text.partition(THINK_CLOSE)
    head = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
    return head.strip(), tail.strip()
