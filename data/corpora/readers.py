"""File readers: JSONL, streamed JSON arrays (:class:`JsonArrayStream`) and Parquet, with the stats they keep."""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.data.corpora.config import CorpusError

log = logging.getLogger(__name__)


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
def utf8_error(path: Path, line: int, column: int, e: UnicodeDecodeError) -> CorpusError:
    """The one-line error for bytes that are not UTF-8, naming the file, line and column (1-based)."""
    bad = e.object[e.start : e.start + 1].hex()
    return CorpusError(
        f"{path}:{line}: not valid UTF-8 (byte 0x{bad} at column {column}); re-encode the file as UTF-8, "
        "e.g. iconv -f latin1 -t utf-8"
    )


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
        strict_utf8: bool = False,
    ):
        self.path = Path(path)
        self.strict_utf8 = strict_utf8
        """Bytes that are not UTF-8 raise :func:`utf8_error` (user files); False replaces them with U+FFFD."""
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
            utf8 = codecs.getincrementaldecoder("utf-8")(errors="strict" if self.strict_utf8 else "replace")
            read = 0  # bytes of the file read so far
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
                nonlocal read
                data = fb.read(self.chunk_bytes)
                eof = not data
                try:
                    buf += utf8.decode(data, final=eof)
                except UnicodeDecodeError as e:
                    at = (
                        read + e.start
                    )  # byte offset of the bad byte (a sequence started in a chunk before is
                    # reported at this chunk's start)
                    with open(self.path, "rb") as f2:
                        before = f2.read(max(at, 0))
                    line = before.count(b"\n") + 1
                    raise utf8_error(self.path, line, at - (before.rfind(b"\n") + 1) + 1, e) from None
                read += len(data)

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
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise utf8_error(path, lineno, e.start + 1, e) from None
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


def expand_paths(path: str) -> list[Path]:
    """The corpus files ``path`` names: itself, the data files of a directory, or a glob's matches."""
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
        stream = JsonArrayStream(path, strict_utf8=not tolerant)
        for i, rec in enumerate(stream, 1):
            yield f"{path}: record {i}", rec
        if stats is not None:
            stats.json_array.append(stream.stats)
    else:
        raise CorpusError(f"{path}: unsupported file type (use .jsonl, .jsonl.gz, .json or .parquet)")
