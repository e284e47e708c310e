"""Prompts at a given context length: real chat turns (``filler``) put before each prompt, through the target's chat template."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.data.long_prefixes import pad_to_context, turn_pairs
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
    """(user, assistant) turn pairs from the first conversations of a corpus, to pad contexts with
    (:func:`data.long_context.turn_pairs`)."""
    try:
        return turn_pairs(corpus, limit)
    except ValueError as e:
        raise DiagnoseError(str(e)) from None


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
