"""Chat formatting: assistant-only loss masks from the tokenizer's own template, for several template families."""

from __future__ import annotations

import pytest

from eyas.data.chat import (
    THINK_CLOSE,
    THINK_OPEN,
    FormatStats,
    format_conversation,
    format_conversations,
    format_prompt,
    reasoning_key,
    split_reasoning,
)
from eyas.data.types import Conversation
from tests.tokenizers import END_OF_TURN, STYLES, make_chat_tokenizer

SYSTEM = "You are a helpful assistant."
U1, A1, R1 = "What is two plus two?", "Two plus two is four.", "Add 2 and 2 step by step."
U2, A2, R2 = (
    "Tell me a story about a cat.",
    "Once upon a time a small cat lived in a big house.",
    "Think of a cat.",
)


def _conv(reasoning_on: int | None = None) -> Conversation:
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": U1},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": U2},
        {"role": "assistant", "content": A2},
    ]
    if reasoning_on is not None:
        msgs[2 + 2 * reasoning_on]["reasoning"] = (R1, R2)[reasoning_on]
    return Conversation(id="c", messages=msgs)


def _runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def _think(r: str, a: str) -> str:
    return f"{THINK_OPEN}\n{r}\n{THINK_CLOSE}\n\n{a}"


@pytest.mark.parametrize("style", [s for s in STYLES if s != "qwen3"])
def test_mask_covers_exactly_the_assistant_turns_and_their_end_of_turn(style):
    tok = make_chat_tokenizer(style)
    eot = END_OF_TURN[style]
    s = format_conversation(_conv(reasoning_on=0), tok, max_len=4096)
    assert _runs(tok, s.input_ids, s.loss_mask) == [_think(R1, A1) + eot, A2 + eot]
    # the ids are the template's rendering, tokenized as transformers does (no extra special tokens)
    text = tok.apply_chat_template(template_input(tok, _conv(reasoning_on=0)), tokenize=False)
    assert tok.decode(s.input_ids) == text
    unmasked = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask) if not m])
    assert A1 not in unmasked and A2 not in unmasked and U1 in unmasked and U2 in unmasked


def template_input(tok, conv):
    from eyas.data.chat import template_messages

    return template_messages(conv.messages, tok)


def test_first_masked_token_follows_the_generation_prompt_exactly():
    """Independent of offsets: the generation prompt's own tokenization ends where the mask starts."""
    for style in ("chatml", "llama3", "gemma"):
        tok = make_chat_tokenizer(style)
        conv = _conv()
        s = format_conversation(conv, tok, max_len=4096)
        prompt = format_prompt(conv.messages[:2], tok)  # system + first user turn, then the assistant header
        assert s.input_ids[: len(prompt)] == prompt
        assert not any(s.loss_mask[: len(prompt)]) and s.loss_mask[len(prompt)]


def test_template_with_reasoning_content_and_rewritten_history():
    """Qwen3-style: reasoning goes in `reasoning_content`, and earlier turns are rendered without it."""
    tok = make_chat_tokenizer("qwen3")
    assert reasoning_key(tok) == "reasoning_content" and reasoning_key(make_chat_tokenizer("chatml")) is None
    eot = END_OF_TURN["qwen3"]
    stats = FormatStats()
    # reasoning on the last turn: rendered (prefix property holds)
    s = format_conversation(_conv(reasoning_on=1), tok, 4096, stats)
    assert _runs(tok, s.input_ids, s.loss_mask) == [A1 + eot, _think(R2, A2) + eot]
    assert stats.history_rewritten == 0
    # reasoning on an earlier turn: the template drops it from history; the mask follows what is rendered
    s = format_conversation(_conv(reasoning_on=0), tok, 4096, stats)
    assert R1 not in tok.decode(s.input_ids)
    assert _runs(tok, s.input_ids, s.loss_mask) == [A1 + eot, A2 + eot]
    assert stats.history_rewritten == 1


def test_truncation_keeps_ids_and_mask_consistent():
    tok = make_chat_tokenizer("chatml")
    full = format_conversation(_conv(), tok, 4096)
    first_loss = full.loss_mask.index(True)
    cut = first_loss + 3
    stats = FormatStats()
    s = format_conversation(_conv(), tok, cut, stats)
    assert s.input_ids == full.input_ids[:cut] and s.loss_mask == full.loss_mask[:cut]
    assert stats.truncated == 1 and s.num_loss_tokens == 3
    # cut before any assistant token: nothing to learn, skipped and counted
    assert format_conversation(_conv(), tok, first_loss, stats) is None
    assert stats.skipped_truncated_no_loss == 1 and stats.formatted == 1


def test_skips_are_counted():
    tok = make_chat_tokenizer("chatml")
    raising = make_chat_tokenizer.__wrapped__("chatml")
    raising.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    convs = [
        Conversation("empty", []),
        Conversation("blank", [{"role": "user", "content": "  "}, {"role": "assistant", "content": ""}]),
        Conversation("prompt-only", [{"role": "user", "content": "Hi"}]),
        _conv(),
        Conversation(
            "double-user",
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"},
            ],
        ),
    ]
    res = format_conversations(convs, tok, 4096)
    assert [s.id for s in res.samples] == ["c", "double-user"]
    st = res.stats
    assert (st.seen, st.formatted, st.skipped_empty, st.skipped_no_assistant) == (5, 2, 2, 1)
    assert st.tokens == sum(s.num_tokens for s in res.samples)
    assert st.loss_tokens == sum(s.num_loss_tokens for s in res.samples)
    res = format_conversations(convs, raising, 4096)
    assert [s.id for s in res.samples] == ["c"] and res.stats.skipped_template_error == 1


def test_format_prompt_stops_before_the_last_assistant_turn():
    tok = make_chat_tokenizer("llama3")
    conv = _conv()
    expected = tok.apply_chat_template(conv.messages[:4], tokenize=False, add_generation_prompt=True)
    assert tok.decode(format_prompt(conv, tok)) == expected
    assert format_prompt(conv.messages[:4], tok) == format_prompt(conv, tok)


def test_split_reasoning():
    assert split_reasoning("<think>\nabc\n</think>\n\nAnswer") == ("abc", "Answer")
    assert split_reasoning("abc</think>Answer") == ("abc", "Answer")  # opening tag was in the prompt
    assert split_reasoning("Just an answer") == (None, "Just an answer")


@pytest.mark.slow
def test_embedded_smollm2_template_masks():
    from transformers import AutoTokenizer

    from eyas.serving.models.embedded import ensure_embedded

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded()))
    conv = _conv(reasoning_on=1)
    conv.messages = conv.messages[1:]  # no system prompt: SmolLM2's template inserts its default one
    s = format_conversation(conv, tok, 4096)
    eot = "<|im_end|>\n"
    assert _runs(tok, s.input_ids, s.loss_mask) == [A1 + eot, _think(R2, A2) + eot]
    assert "SmolLM" in tok.decode(s.input_ids[:30]) and not any(s.loss_mask[:30])
