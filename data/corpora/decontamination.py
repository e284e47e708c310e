"""Decontamination: refuse evaluation prompts whose text the drafter was trained on.

Design decisions:
- Text is compared lower-cased, so spacing and case do not hide a copy: a question as its tokens (runs of word
  characters, and every other non-space character on its own, so ``9 * 5`` and ``9 + 5`` differ), a span as words
  only (so a code list such as ``[1, 2, 3, 4, 5, 6]`` is 6 words, not 13 tokens). The training text is every turn
  of every training record (system, user, assistant, reasoning): the prepared corpus a run trained on,
  regenerated answers included.
- An evaluation prompt is its system and user turns as evaluated. Two rules:
  1. its question (the user turns) occurs verbatim in a training record: refused for every set;
  2. any ``ngram`` consecutive words of it (13 by default, the GPT-3 paper's decontamination length) occur in a
     training record: refused for sets that claim to be out of distribution. A set marked in-distribution is
     template siblings of the training data by design (other seeds of the training generators share whole
     sentences with it), so only rule 1 applies to it.
- The training text is streamed once against an index of the prompts' n-grams (a few thousand), so memory stays
  that of the prompts whatever the corpus size; a record is reported by its id.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from eyas.common import ConfigError
from eyas.data.corpora.config import CorpusError
from eyas.data.types import Conversation

NGRAM = 13
"""Default span length of rule 2 (words)."""
_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")
_SEP = "\x00"
"""Marks a turn boundary in a token sequence: no span crosses from one turn into the next."""
_EVERY_ROLE = ("system", "user", "assistant")


class ContaminationError(CorpusError, ConfigError):
    """An evaluation prompt occurs in the training text (the message names the prompt and the record); a
    :class:`~eyas.common.ConfigError`, so commands end with its one line."""


@dataclass
class Contamination:
    """One evaluation prompt found in the training text."""

    prompt_set: str
    prompt_id: str
    record_id: str
    """Id of the first training record that holds it."""
    rule: str
    """``question`` (the whole question, verbatim) or ``ngram`` (a span of ``ngram`` words)."""
    text: str
    """The matching tokens, space-separated."""

    def describe(self) -> str:
        what = "question" if self.rule == "question" else "word span"
        shown = self.text.replace(_SEP, "/")
        shown = shown if len(shown) <= 120 else shown[:117] + "..."
        return (
            f'prompt {self.prompt_id!r} of eval prompt set {self.prompt_set!r}: its {what} "{shown}" occurs in '
            f"training record {self.record_id!r}"
        )


def tokens(text: str) -> list[str]:
    """The lower-cased tokens of ``text`` (words, and symbols one by one): what a question is compared as."""
    return _TOKEN.findall(text.lower())


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``: what a span is compared as."""
    return _WORD.findall(text.lower())


def _turns(conv: Conversation, roles: Collection[str], split: Callable[[str], list[str]]) -> list[str]:
    """``split`` of the turns of ``roles`` (content and reasoning), turns separated by :data:`_SEP`."""
    out: list[str] = []
    for m in conv.messages:
        if m["role"] in roles:
            for text in (m.get("content") or "", m.get("reasoning") or ""):
                if text:
                    out += [*split(text), _SEP]
    return out[:-1]


def find_contamination(
    prompt_sets: Mapping[str, Sequence[Conversation]],
    training: Iterable[Conversation],
    ngram: int = NGRAM,
    in_distribution: Collection[str] = (),
) -> list[Contamination]:
    """Every prompt of ``prompt_sets`` (name -> prompts as evaluated) that occurs in ``training`` by the rules of
    the module docstring, once each (with the first record found), in the order of ``prompt_sets``;
    ``in_distribution``: names of sets exempt from rule 2. Streams ``training`` once."""
    if ngram < 1:
        raise ValueError(f"decontamination n-gram length must be >= 1, not {ngram}")
    questions: dict[str, list[tuple[str, str]]] = {}  # " ".join(question tokens) -> [(set, prompt id)]
    grams: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for name, prompts in prompt_sets.items():
        for p in prompts:
            q = _turns(p, ("user",), tokens)
            if q:
                questions.setdefault(" ".join(q), []).append((name, p.id))
            if name in in_distribution:
                continue
            text = _turns(p, ("system", "user"), words)
            for i in range(len(text) - ngram + 1):
                g = tuple(text[i : i + ngram])
                if _SEP not in g:
                    grams.setdefault(g, []).append((name, p.id))
    first_words = {g[0] for g in grams}
    found: dict[tuple[str, str], Contamination] = {}
    for rec in training:
        if questions:
            joined = " " + " ".join(_turns(rec, _EVERY_ROLE, tokens)) + " "
            for q, owners in questions.items():
                if f" {q} " in joined:
                    for name, pid in owners:
                        found.setdefault((name, pid), Contamination(name, pid, rec.id, "question", q))
        if grams:
            ws = _turns(rec, _EVERY_ROLE, words)
            for i in range(len(ws) - ngram + 1):
                if ws[i] in first_words:
                    g = tuple(ws[i : i + ngram])
                    for name, pid in grams.get(g, ()):
                        found.setdefault((name, pid), Contamination(name, pid, rec.id, "ngram", " ".join(g)))
    order = {
        (name, p.id): i for i, (name, p) in enumerate((n, p) for n, ps in prompt_sets.items() for p in ps)
    }
    return sorted(found.values(), key=lambda c: order[(c.prompt_set, c.prompt_id)])


def check_decontaminated(
    prompt_sets: Mapping[str, Sequence[Conversation]],
    training: Iterable[Conversation],
    ngram: int = NGRAM,
    in_distribution: Collection[str] = (),
    where: str = "the training text",
) -> None:
    """Raise :class:`ContaminationError` naming the first contaminated prompt and its training record (and how many
    others) if :func:`find_contamination` finds any; ``where`` says what the training text is (a path)."""
    hits = find_contamination(prompt_sets, training, ngram, in_distribution)
    if not hits:
        return
    more = f"; {len(hits) - 1} more: {', '.join(h.prompt_id for h in hits[1:6])}" if len(hits) > 1 else ""
    raise ContaminationError(
        f"{hits[0].describe()} ({where}){more}. Evaluate on prompts the drafter was not trained on (another set "
        "or seed), or mark the set `in_distribution: true` if it is meant to measure the training distribution "
        "(then only a verbatim question is refused)"
    )
