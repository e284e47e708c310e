"""Evaluation prompt sets: what eval and diagnose feed the serving loop.

The default lists (``conf/eval/demo.yaml``, ``conf/eval/bench.yaml``) measure, in this order:

- out-of-distribution reasoning first: ``ood_reasoning`` (reasoning-gym tasks no training mixture uses) and
  ``word_problems`` (hand-written arithmetic word problems), from their ``report`` half;
- ``builtin:predictable``: prompts whose answers are fixed by the prompt or a trivial rule (copy a HumanEval
  function verbatim, count, write a multiplication table). Any competent drafter predicts most of their tokens;
  the ratio of τ on hard reasoning to τ here is the number the field's deployments care about;
- chat and code (MT-bench, HumanEval), which no training mixture may hold;
- in-distribution sets last, named ``*_in_dist``: ``reasoning_gym`` is other seeds of the training generators,
  template siblings of the training data, so its τ flatters a drafter that memorised the templates.

Any :func:`data.corpora.load_prompt_set` source works (a corpus's eval split, a JSONL/Parquet file, ``hf:<id>``),
reduced to the system turn and the first user turn. :func:`check_prompt_sets` refuses prompts found in the
training text (:mod:`data.corpora.decontamination`).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eyas.data.corpora.decontamination import Contamination, ContaminationError
from eyas.data.types import Conversation

if TYPE_CHECKING:
    from eyas.eval.acceptance import PromptSetSpec

BUILTIN_PREDICTABLE = "builtin:predictable"


def builtin_predictable(n: int, seed: int = 0, half: str | None = None) -> list[list[dict[str, str]]]:
    """Prompts whose answers are fixed by the prompt or a trivial rule (see the module docstring); ``half``: the
    HumanEval functions of that half, and numbers from a stream of their own."""
    from eyas.data.corpora.prompt_sets import load_prompt_set

    rng = random.Random(seed if half is None else f"{seed}/{half}")
    code = [
        c.meta.get("code_prompt", "") for c in load_prompt_set("humaneval", n=max(n, 4), seed=seed, half=half)
    ]
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


def load_prompts(spec: PromptSetSpec, seed: int = 0, exclude: Collection[str] = ()) -> list[Conversation]:
    """A set's prompts as evaluated (system turn and first user turn), with their ids; ``exclude``: prompt ids
    left out before the ``n`` are drawn."""
    from eyas.data.corpora.prompt_sets import load_prompt_set

    if spec.source == BUILTIN_PREDICTABLE:
        return [
            Conversation(f"{BUILTIN_PREDICTABLE}/{i}", msgs, BUILTIN_PREDICTABLE)
            for i, msgs in enumerate(builtin_predictable(spec.n, seed, spec.half))
        ]
    out = []
    for c in load_prompt_set(spec.source, n=spec.n, seed=seed, half=spec.half, exclude=exclude):
        msgs = []
        for m in c.messages:
            msgs.append(m)
            if m["role"] == "user":
                break
        out.append(Conversation(c.id, msgs, c.source, c.meta))
    if not out:
        raise ValueError(f"prompt set {spec.name} ({spec.source}) is empty: no prompts to measure")
    return out


def prompt_messages(
    spec: PromptSetSpec, seed: int = 0, exclude: Collection[str] = ()
) -> list[list[dict[str, Any]]]:
    """The chat messages (system and first user turn) of a set's prompts."""
    return [c.messages for c in load_prompts(spec, seed, exclude)]


def load_prompt_ids(
    spec: PromptSetSpec,
    tokenizer,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
    exclude: Collection[str] = (),
) -> list[list[int]]:
    """Token-id prompts of a set under the target's chat template; prompts over ``max_prompt_tokens`` are left
    out (raises if none remain); ``exclude``: prompt ids left out before the ``n`` are drawn."""
    from eyas.data.chat import format_prompt

    out = [format_prompt(msgs, tokenizer) for msgs in prompt_messages(spec, seed, exclude)]
    if max_prompt_tokens is not None:
        out = [ids for ids in out if len(ids) <= max_prompt_tokens]
        if not out:
            raise ValueError(
                f"prompt set {spec.name}: every prompt is longer than {max_prompt_tokens} tokens"
            )
    return out


@dataclass
class DecontaminationResult:
    """What :func:`check_prompt_sets` did."""

    left_out: dict[str, list[Contamination]] = field(default_factory=dict)
    """In-distribution set -> its prompts whose question is verbatim a training question (a generator can make the
    same question from another seed): left out, and other prompts of the set drawn in their place."""
    checked: int = 0
    """Prompts found clean (the ones evaluated, in every set)."""

    def excluded(self, name: str) -> set[str]:
        """The prompt ids of set ``name`` to leave out (``load_prompt_ids(..., exclude=)``)."""
        return {c.prompt_id for c in self.left_out.get(name, [])}

    def describe(self, where: str, ngram: int) -> str:
        """The report's line."""
        s = (
            f"{self.checked} prompts checked against {where}: none has its question there, nor (out-of-distribution "
            f"sets) any {ngram}-word span"
        )
        for name, hits in self.left_out.items():
            s += (
                f"; {name}: left out {len(hits)} whose question is a training question ({hits[0].describe()})"
            )
        return s


def check_prompt_sets(
    specs: Sequence[PromptSetSpec],
    seed: int,
    training: str | Iterable[Conversation],
    ngram: int | None = None,
    max_rounds: int = 4,
) -> DecontaminationResult:
    """Check every prompt of ``specs`` against the training text (:mod:`data.corpora.decontamination`): a hit in an
    out-of-distribution set raises ``ContaminationError`` naming the prompt and the training record; a verbatim
    training question in an in-distribution set is left out and replaced (then the replacements are checked, up to
    ``max_rounds`` passes). ``training``: a file of training records (a prepared ``train/conversations.jsonl``,
    or any .jsonl/.json/.parquet/directory/glob the corpus file reader takes) or the records themselves."""
    from eyas.data.corpora.config import SourceConfig
    from eyas.data.corpora.decontamination import NGRAM, check_decontaminated, find_contamination
    from eyas.data.corpora.sources import read_source

    if isinstance(training, str):
        where = training

        def records() -> Iterable[Conversation]:
            return read_source(SourceConfig(name="training", kind="file", path=where))
    else:
        where, kept = "the training records", list(training)

        def records() -> Iterable[Conversation]:
            return kept

    ngram = ngram or NGRAM
    res = DecontaminationResult()
    ood = {s.name: load_prompts(s, seed) for s in specs if not s.in_distribution}
    if ood:
        check_decontaminated(ood, records(), ngram, where=where)  # raises on the first hit
        res.checked += sum(map(len, ood.values()))
    in_dist = [s for s in specs if s.in_distribution]
    for _ in range(max_rounds):
        if not in_dist:
            return res
        sets = {s.name: load_prompts(s, seed, res.excluded(s.name)) for s in in_dist}
        hits = find_contamination(sets, records(), ngram, in_distribution=set(sets))
        for h in hits:
            res.left_out.setdefault(h.prompt_set, []).append(h)
        if not hits:
            res.checked += sum(map(len, sets.values()))
            return res
    raise ContaminationError(
        f"eval prompt sets {sorted(res.left_out)}: still hold training questions after {max_rounds} rounds of "
        f"replacement ({where}); use another eval.seed or fewer prompts"
    )
