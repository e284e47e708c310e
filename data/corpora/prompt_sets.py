"""Evaluation prompt sets loaded by name.

Design decisions:
- Out-of-distribution reasoning comes from sources no training mixture draws from: ``ood_reasoning`` (reasoning-gym
  tasks outside every ``conf/corpus`` mixture, :data:`OOD_REASONING_GYM_TASKS`; a test keeps it so) and
  ``word_problems`` (hand-written arithmetic word problems, :data:`WORD_PROBLEMS_FILE`). ``reasoning_gym`` is other
  seeds of the training generators: template siblings of the training data, in distribution.
- Generated sets (reasoning-gym) draw their items from the eval seed interval of the given ``seed``, from
  :data:`PROMPT_ITEM_OFFSET` on: two seeds never share an item, and a corpus's own eval split (its first
  ``eval_size`` items, on which training picks ``best/``) never reaches them.
- Every set splits into a ``calib`` half (to choose settings on, e.g. the K to serve) and a ``report`` half (to
  report on), by a hash of the id within each stratum (a generator's task; a hand-written set's difficulty),
  independent of the seed: a choice made on one half is never reported on the prompts it was made on.
- ``n`` prompts are taken round-robin over the strata (each one's items in seeded-hash order), so a small ``n``
  covers the tasks (difficulties) evenly.
- A set is the same in every process: reasoning-gym items are generated under a fixed hash seed
  (:func:`data.corpora.sources.reasoning_gym_tasks`), since some generators iterate over sets and their items
  followed Python's per-process hash randomisation (one of ``ood_reasoning``'s 12 report prompts differed between
  two runs, so their results would not pair).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Sequence
from pathlib import Path

from eyas.data.corpora.config import (
    DEFAULT_REASONING_GYM_TASKS,
    REASONING_GYM_SEED_STRIDE,
    CorpusConfig,
    CorpusError,
    SourceConfig,
    load_corpus_config,
)
from eyas.data.corpora.mixtures import hash01, split_of
from eyas.data.corpora.records import prompt_only
from eyas.data.corpora.sources import NATIVE_SPLIT_KINDS, read_source, reasoning_gym_seed, reasoning_gym_tasks
from eyas.data.types import Conversation

OOD_REASONING_GYM_TASKS = (
    "aiw",
    "dice",
    "decimal_arithmetic",
    "complex_arithmetic",
    "polynomial_multiplication",
    "simple_integration",
    "simple_geometry",
    "propositional_logic",
    "color_cube_rotation",
    "count_primes",
    "cryptarithm",
    "course_schedule",
)
"""reasoning-gym tasks of ``ood_reasoning``: none is in a training mixture of ``conf/corpus`` (a test checks every
mixture), each generates offline in milliseconds per item with no repeated question in its pool, and together they
span a word problem (``aiw``), probability (``dice``), decimal and complex arithmetic, algebra and calculus,
geometry, propositional logic, spatial reasoning (``color_cube_rotation``), number theory (``count_primes``), a
cryptarithm and a scheduling (graph) problem."""
WORD_PROBLEMS_FILE = Path(__file__).with_name("word_problems.jsonl")
"""24 hand-written arithmetic word problems (easy / medium / hard in ``meta.difficulty``, answer in
``meta.answer``), written for eyas: no generator or public data set made them."""
PROMPT_ITEM_OFFSET = REASONING_GYM_SEED_STRIDE // 2
"""Generated prompt sets take item seeds ``reasoning_gym_seed(seed, "eval") + PROMPT_ITEM_OFFSET + i``."""
PROMPT_POOL = 50
"""Items generated per task of a generated prompt set (each half holds about half of them)."""
HALVES = ("calib", "report")
GENERATED_SETS = {"reasoning_gym": DEFAULT_REASONING_GYM_TASKS, "ood_reasoning": OOD_REASONING_GYM_TASKS}
"""Generated prompt sets by name, with their default tasks (``<name>/<task>,<task>`` picks others)."""


# ---------------------------------------------------------------------------------------------------------------
# evaluation prompt sets
# ---------------------------------------------------------------------------------------------------------------
def load_prompt_set(
    name: str | SourceConfig | CorpusConfig,
    n: int | None = None,
    seed: int = 0,
    half: str | None = None,
    exclude: Collection[str] = (),
) -> list[Conversation]:
    """Evaluation prompts (system and user turns only; the assistant turns are what the model will write).

    name: ``ood_reasoning`` (reasoning-gym tasks no training mixture uses; ``ood_reasoning/<task>[,<task>]`` for
    some), ``word_problems`` (hand-written), ``reasoning_gym`` (held-out seeds of the training generators, in
    distribution; ``reasoning_gym/<task>`` for one task), ``mt_bench``, ``humaneval``, a ``conf/corpus`` name or a
    config object (its eval split, same split rule as training), a local .jsonl/.json/.parquet path (every
    record), or ``hf:<dataset>[:<split>]``.
    n: how many (None: all); taken round-robin over the tasks (difficulties), each in a seeded hash order of the
    id, and returned in the source's order.
    seed: which prompts; generated sets (reasoning-gym) generate other items for every seed.
    half: ``calib`` or ``report``: only that half of the set (see the module docstring); None: the whole set.
    exclude: ids left out before the ``n`` are drawn (the halves stay those of the whole set).
    """
    if half is not None and half not in HALVES:
        raise ValueError(f"prompt set half must be one of {HALVES} or None, not {half!r}")
    convs = _dedupe(_prompt_source(name, seed))
    if half is not None:
        convs = split_half(convs, half)
    if exclude:
        convs = [c for c in convs if c.id not in exclude]
    if n is not None and n < len(convs):
        keep = {c.id for c in _round_robin(convs, seed)[:n]}
        convs = [c for c in convs if c.id in keep]
    return [prompt_only(c) for c in convs]


def _stratum(c: Conversation) -> str:
    """What halves and small draws keep balanced: the generator task, else the hand-written difficulty."""
    return str(c.meta.get("task", c.meta.get("difficulty", "")))


def split_half(convs: Sequence[Conversation], half: str) -> list[Conversation]:
    """The ``half`` (``calib`` or ``report``) of ``convs``: within each stratum (:func:`_stratum`), the first half of
    the items in a seed-independent hash order of the id (the larger half when odd) is ``calib``, the rest
    ``report``."""
    by_stratum: dict[str, list[Conversation]] = {}
    for c in convs:
        by_stratum.setdefault(_stratum(c), []).append(c)
    keep: set[str] = set()
    for items in by_stratum.values():
        ranked = sorted(items, key=lambda c: (hash01(0, "half", c.id), c.id))
        cut = (len(ranked) + 1) // 2
        keep.update(c.id for c in (ranked[:cut] if half == "calib" else ranked[cut:]))
    return [c for c in convs if c.id in keep]


def _round_robin(convs: Sequence[Conversation], seed: int) -> list[Conversation]:
    """All of ``convs``, one stratum (:func:`_stratum`) after the other, each one's items in seeded-hash order; the
    strata too in a seeded order, so a small ``n`` covers other tasks at other seeds."""
    by_stratum: dict[str, list[Conversation]] = {}
    for c in sorted(convs, key=lambda c: (hash01(seed, "prompt", c.id), c.id)):
        by_stratum.setdefault(_stratum(c), []).append(c)
    queues = [by_stratum[t] for t in sorted(by_stratum, key=lambda t: (hash01(seed, "task", t), t))]
    out: list[Conversation] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def _dedupe(convs: list[Conversation]) -> list[Conversation]:
    """Drop repeated prompts (same user turns): a generator can produce the same question from two seeds."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for c in convs:
        key = tuple(m["content"] for m in c.messages if m["role"] in ("system", "user"))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


@functools.lru_cache(maxsize=8)  # eval loads a set twice (decontamination, then the prompts); never mutated
def _reasoning_gym_prompts(tasks: tuple[str, ...], seed: int, source: str) -> tuple[Conversation, ...]:
    """:data:`PROMPT_POOL` items of every task, from the eval interval of ``seed`` past its corpus eval split."""
    from reasoning_gym.factory import DATASETS

    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise CorpusError(
            f"{source}: unknown reasoning-gym tasks {unknown}; known: {', '.join(sorted(DATASETS))}"
        )
    base = reasoning_gym_seed(seed, "eval") + PROMPT_ITEM_OFFSET
    return tuple(reasoning_gym_tasks(tasks, base, PROMPT_POOL, source=source, split="eval"))


def _prompt_source(name: str | SourceConfig | CorpusConfig, seed: int) -> list[Conversation]:
    if isinstance(name, SourceConfig):
        name = CorpusConfig(name=name.name, sources=[name], seed=seed)
    if isinstance(name, CorpusConfig):
        return _eval_split(name)
    if name in ("mt_bench", "humaneval"):
        return list(read_source(SourceConfig(name=name, kind=name)))
    head, _, tail = name.partition("/")
    if head in GENERATED_SETS:
        return list(
            _reasoning_gym_prompts(tuple(tail.split(",") if tail else GENERATED_SETS[head]), seed, head)
        )
    if name == "word_problems":
        return list(
            read_source(SourceConfig(name="word_problems", kind="file", path=str(WORD_PROBLEMS_FILE)))
        )
    if name.startswith("hf:"):
        parts = name[3:].split(":")
        src = SourceConfig(
            name=parts[0], kind="hf", dataset=parts[0], split=parts[1] if len(parts) > 1 else "test"
        )
        return list(read_source(src))
    if Path(os.path.expanduser(name)).suffix in (".jsonl", ".json", ".parquet", ".gz") or Path(name).exists():
        return list(read_source(SourceConfig(name=Path(name).stem, kind="file", path=name)))
    return _eval_split(load_corpus_config(name))


def _eval_split(cfg: CorpusConfig) -> list[Conversation]:
    """The eval split of a corpus (eval-only sources contribute all their records)."""
    out: list[Conversation] = []
    for src in cfg.sources:
        if src.eval_only:
            out.extend(read_source(src))
        elif src.kind in NATIVE_SPLIT_KINDS:
            out.extend(read_source(src, "eval", eval_fraction=cfg.eval_fraction))
        else:
            out.extend(c for c in read_source(src) if split_of(c.id, cfg.seed, cfg.eval_fraction) == "eval")
    return out
