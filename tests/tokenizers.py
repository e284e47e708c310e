"""Tiny chat tokenizers for tests: a byte-level BPE trained in milliseconds, with real chat-template styles.

``make_chat_tokenizer(style)`` for style in ``STYLES`` returns a ``PreTrainedTokenizerFast`` whose special
tokens and chat template mimic a model family (no downloads). Ids: 0 = pad, 1 = bos, 2 = the end-of-turn token,
which is also ``eos_token`` (as in chat models, so generation stops at the end of the turn); this matches
``serving.tiny.tiny_config``'s pad/bos/eos ids. ``END_OF_TURN[style]`` is the text every assistant turn must end
with in the loss mask, for tests to check masks against.
"""

from __future__ import annotations

from functools import cache

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and think step by step.",
    "What is two plus two? Two plus two is four.",
    "Hello! How can I help you today? Tell me a story about a cat.",
    "Once upon a time a small cat lived in a big house near the sea.",
    "Compute 12 * 7 = 84, then subtract 4 to get 80. The answer is 80.",
    "system user assistant model think reason answer question",
    "0123456789 +-*/=()[]{}<>.,:;!?'\"\n\t",
]

SPECIALS = {
    "chatml": ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"],
    "llama3": ["<pad>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
    "gemma": ["<pad>", "<bos>", "<end_of_turn>", "<start_of_turn>"],
    "qwen3": ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"],
}

TEMPLATES = {
    # ChatML (SmolLM2, Qwen2): every turn is <|im_start|>role\n...<|im_end|>\n
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 3: bos, header ids, trimmed content, <|eot_id|> with no newline after it
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # Gemma: no system role (folded into the first user turn), assistant is called "model"
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}"
        "{% endif %}{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + m['content']) | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    # Qwen3-like: reads `reasoning_content`, and shows reasoning only on the last turn (history is rewritten)
    "qwen3": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
        "{% if loop.last and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}

END_OF_TURN = {
    "chatml": "<|im_end|>\n",
    "llama3": "<|eot_id|>",
    "gemma": "<end_of_turn>\n",
    "qwen3": "<|im_end|>\n",
}
STYLES = tuple(TEMPLATES)


@cache
def make_chat_tokenizer(style: str = "chatml", vocab_size: int = 320):
    """A fast byte-level BPE tokenizer with ``style``'s special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], bos_token=specials[1], eos_token=specials[2]
    )
    fast.chat_template = TEMPLATES[style]
    assert [fast.convert_tokens_to_ids(t) for t in specials[:3]] == [0, 1, 2]
    return fast
