"""Evaluation prompt sets loaded by name."""

from __future__ import annotations

import os
from pathlib import Path

from eyas.data.corpora.config import CorpusConfig, SourceConfig, load_corpus_config
from eyas.data.corpora.mixtures import hash01, split_of
from eyas.data.corpora.records import prompt_only
from eyas.data.corpora.sources import NATIVE_SPLIT_KINDS, read_source
from eyas.data.types import Conversation


# ---------------------------------------------------------------------------------------------------------------
# evaluation prompt sets
# ---------------------------------------------------------------------------------------------------------------
def load_prompt_set(
    name: str | SourceConfig | CorpusConfig,
    n: int | None = None,
    seed: int = 0,
) -> list[Conversation]:
    """Evaluation prompts (system and user turns only; the assistant turns are what the model will write).

    name: ``mt_bench``, ``humaneval``, ``reasoning_gym`` (held-out seeds; ``reasoning_gym/<task>`` for one task),
    a ``conf/corpus`` name or a config object (its eval split, same split rule as training), a local
    .jsonl/.json/.parquet path (every record), or ``hf:<dataset>[:<split>]``.
    n: how many (None: all); chosen by a seeded hash of the id, returned in the source's order.
    """
    convs = _prompt_source(name, seed)
    if n is not None and n < len(convs):
        keep = {c.id for c in sorted(convs, key=lambda c: (hash01(seed, "prompt", c.id), c.id))[:n]}
        convs = [c for c in convs if c.id in keep]
    return [prompt_only(c) for c in convs]


def _prompt_source(name: str | SourceConfig | CorpusConfig, seed: int) -> list[Conversation]:
    if isinstance(name, SourceConfig):
        name = CorpusConfig(name=name.name, sources=[name], seed=seed)
    if isinstance(name, CorpusConfig):
        return _eval_split(name)
    if name in ("mt_bench", "humaneval"):
        return list(read_source(SourceConfig(name=name, kind=name)))
    if name == "reasoning_gym" or name.startswith("reasoning_gym/"):
        tasks = name.split("/", 1)[1].split(",") if "/" in name else []
        src = SourceConfig(name="reasoning_gym", kind="reasoning_gym", subsets=tasks, size=1, eval_size=50)
        return list(read_source(src, "eval"))
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
