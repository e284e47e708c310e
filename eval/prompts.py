"""Evaluation prompt sets: what eval and diagnose feed the serving loop.

- Any :func:`data.corpora.load_prompt_set` source (MT-bench, HumanEval, held-out reasoning-gym seeds, a corpus's
  eval split, a JSONL/Parquet file, ``hf:<id>``), reduced to the system turn and the first user turn.
- ``builtin:predictable``: prompts whose answers are fixed by the prompt or a trivial rule (copy a HumanEval
  function verbatim, count, write a multiplication table). Any competent drafter predicts most of their tokens;
  the ratio of τ on hard reasoning to τ here is the number the field's deployments care about.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eyas.eval.acceptance import PromptSetSpec

BUILTIN_PREDICTABLE = "builtin:predictable"


def builtin_predictable(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Prompts whose answers are fixed by the prompt or a trivial rule (see the module docstring)."""
    from eyas.data.corpora.prompt_sets import load_prompt_set

    rng = random.Random(seed)
    code = [c.meta.get("code_prompt", "") for c in load_prompt_set("humaneval", n=max(n, 4), seed=seed)]
    code = [c.strip("\n") for c in code if c.strip()]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0 and code:
            text = (
                "Copy this Python code exactly, without any change and without comments of your own:\n\n"
                f"```python\n{code[(i // 3) % len(code)]}\n```"
            )
        elif kind in (0, 1):
            a = rng.randint(1, 400)
            text = f"Count from {a} to {a + 60}, one number per line, and write nothing else."
        else:
            m = rng.randint(2, 19)
            text = (
                f"Write the multiplication table of {m} from {m} x 1 to {m} x 20, one line each, "
                f"in the form '{m} x 1 = {m}'."
            )
        out.append([{"role": "user", "content": text}])
    return out


def prompt_messages(spec: PromptSetSpec, seed: int = 0) -> list[list[dict[str, Any]]]:
    """The chat messages (system and first user turn) of a set's prompts."""
    from eyas.data.corpora.prompt_sets import load_prompt_set

    if spec.source == BUILTIN_PREDICTABLE:
        convs = builtin_predictable(spec.n, seed)
    else:
        convs = []
        for c in load_prompt_set(spec.source, n=spec.n, seed=seed):
            msgs = []
            for m in c.messages:
                msgs.append(m)
                if m["role"] == "user":
                    break
            convs.append(msgs)
    if not convs:
        raise ValueError(f"prompt set {spec.name} ({spec.source}) is empty: no prompts to measure")
    return convs


def load_prompt_ids(
    spec: PromptSetSpec,
    tokenizer,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
) -> list[list[int]]:
    """Token-id prompts of a set under the target's chat template; prompts over ``max_prompt_tokens`` are left
    out (raises if none remain)."""
    from eyas.data.chat import format_prompt

    out = [format_prompt(msgs, tokenizer) for msgs in prompt_messages(spec, seed)]
    if max_prompt_tokens is not None:
        out = [ids for ids in out if len(ids) <= max_prompt_tokens]
        if not out:
            raise ValueError(
                f"prompt set {spec.name}: every prompt is longer than {max_prompt_tokens} tokens"
            )
    return out
