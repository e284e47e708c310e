"""Data-parallel extraction: ``world`` processes, on one node or several, write one feature store together.

Any launcher that sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` starts it (``accelerate
launch``, ``torchrun``, ``srun`` around either); ``python -m eyas.data.extract`` reads them (:meth:`Ranks.from_env`).

Design decisions:
- Shard k is extracted by rank ``k % world``. A shard's bytes depend only on its samples and the settings (see
  :mod:`eyas.data.extract`), so the store equals a single-process store shard for shard, whatever the world size.
- Every rank reads the whole samples file (small next to the features it becomes) and skips the shards of the
  others: no rank waits for another's input, and all of them count the same shards.
- The ranks share the store directory (a shared filesystem when they are on several nodes). Rank 0 alone holds
  the store's lock, checks or creates the manifest before any rank starts, and writes the final manifest. Every
  rank writes its shard files and its part file ``manifest.rank{r}.json`` (the shards it has finished, rewritten
  after each), so a killed job resumes from what every rank finished, with the same or another world size.
- At the end the ranks send their entries to rank 0 over a gloo group (kilobytes, whatever device the target runs
  on); rank 0 lists every shard in order, marks the store complete and deletes the part files. An error on one
  rank travels the same way, so every rank stops with it instead of waiting for the others.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock
from tqdm.auto import tqdm

from eyas.common import atomic_write_bytes
from eyas.data.store import (
    MANIFEST,
    FeatureCodec,
    Manifest,
    ShardEntry,
    StoreConfigError,
    StoreError,
    check_shard_file,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from eyas.data.extract import ExtractConfig, ExtractResult
    from eyas.data.types import Sample

log = logging.getLogger(__name__)

PART_GLOB = "manifest.rank*.json"


def part_name(rank: int) -> str:
    """The part file of ``rank``: the shards it has finished, until rank 0 folds them into the manifest."""
    return f"manifest.rank{rank:05d}.json"


@dataclass(frozen=True)
class Ranks:
    """This process's place among the extraction processes."""

    rank: int = 0
    """0 .. world - 1 (global, across nodes)."""
    world: int = 1
    """Number of extraction processes."""
    local_rank: int = 0
    """Index on this node (picks the GPU)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world} processes")

    @classmethod
    def from_env(cls) -> Ranks:
        """From the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (one process when they are unset)."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )

    def owns(self, shard: int) -> bool:
        return shard % self.world == self.rank


class _Group:
    """Object collectives among the ranks over gloo (the default group when this module starts it)."""

    def __init__(self, ranks: Ranks, timeout_s: float):
        import torch.distributed as dist

        self.dist, self.ranks = dist, ranks
        self.owned = not dist.is_initialized()
        if self.owned:  # MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE from the launcher
            dist.init_process_group(
                "gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=timeout_s)
            )
            self.pg = None
        else:
            self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (in rank order) on rank 0; None elsewhere."""
        out = [None] * self.ranks.world if self.ranks.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.pg)

    def close(self) -> None:
        if self.owned:
            self.dist.destroy_process_group()


@dataclass
class _RankReport:
    """What one rank sends rank 0 at the end."""

    entries: dict[int, ShardEntry]
    """Its shards (written now or found finished), by index."""
    num_chunks: int
    written: int
    computed_tokens: int
    error: str | None = None


def _load_parts(out_dir: Path) -> dict[int, ShardEntry]:
    found: dict[int, ShardEntry] = {}
    for p in sorted(out_dir.glob(PART_GLOB)):
        try:
            d = json.loads(p.read_text())
            found.update({int(k): ShardEntry(**v) for k, v in d["shards"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:  # a hint only: its shards are redone
            log.warning("ignoring unreadable part file %s (%s)", p, e)
    return found


def extract_ranks(
    samples: Iterable[Sample],
    target,
    out_dir: Path,
    cfg: ExtractConfig,
    codec: FeatureCodec,
    fresh: Manifest,
    ranks: Ranks,
) -> ExtractResult:
    """This rank's share of the extraction of ``samples`` into ``out_dir`` (see the module doc); the job's
    :class:`~eyas.data.extract.ExtractResult`, the same on every rank."""
    group = _Group(ranks, cfg.rank_timeout_s)
    try:
        return _extract(samples, target, out_dir, cfg, codec, fresh, ranks, group)
    finally:
        group.close()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _extract(
    samples: Iterable[Sample],
    target,
    out_dir: Path,
    cfg: ExtractConfig,
    codec: FeatureCodec,
    fresh: Manifest,
    ranks: Ranks,
    group: _Group,
) -> ExtractResult:
    from eyas.data.extract import (
        ExtractResult,
        _chunks,
        _open_for_writing,
        _ShardWriter,
        acquire_store_lock,
        features_of,
        shard_fingerprint,
    )

    t0 = time.perf_counter()
    lock: FileLock | None = None
    failure: BaseException | None = None
    error = None
    if ranks.rank == 0:  # rank 0 opens the store before any rank writes into it
        try:
            lock = acquire_store_lock(out_dir)
            for tmp in out_dir.glob("*.tmp"):
                tmp.unlink()  # a killed job's partial shard or manifest: never listed, never read
            _open_for_writing(out_dir, fresh)
        except Exception as e:
            failure, error = e, _describe(e)
    error = group.broadcast(error)
    try:
        if error is not None:
            if failure is not None:
                raise failure
            raise StoreError(f"rank 0 could not open the feature store {out_dir}: {error}")
        manifest = Manifest.load(out_dir)
        known = {k: e for k, e in enumerate(manifest.shards)} | _load_parts(out_dir)
        group.barrier()  # every rank has read the part files before any rewrites its own

        done: dict[int, ShardEntry] = {}
        skipped: list[int] = []
        done_lock = threading.Lock()  # the writer thread records written shards, this one skipped ones
        part = out_dir / part_name(ranks.rank)

        def record(index: int, entry: ShardEntry) -> None:
            with done_lock:
                done[index] = entry
                text = json.dumps({"shards": {str(k): asdict(v) for k, v in sorted(done.items())}}, indent=1)
            atomic_write_bytes(part, (text + "\n").encode())

        report = _RankReport(entries=done, num_chunks=0, written=0, computed_tokens=0)
        bar = tqdm(
            unit="sample",
            desc=f"extract {cfg.store.label} rank {ranks.rank}/{ranks.world}",
            disable=not cfg.progress,
            dynamic_ncols=True,
        )

        def progress(n_samples: int, n_tokens: int) -> None:
            report.computed_tokens += n_tokens
            bar.update(n_samples)

        writer = _ShardWriter(out_dir, record, cfg.writer_thread)
        try:
            for k, chunk in enumerate(_chunks(samples, cfg.shard_size)):
                report.num_chunks = k + 1
                if not ranks.owns(k):
                    continue
                old = known.get(k)
                sha = shard_fingerprint(chunk, k, target, old, out_dir)
                if old is not None:
                    problem = check_shard_file(out_dir, k, old, full=cfg.verify_resume == "full")
                    if problem is None:
                        record(k, old)  # into this rank's part file too: the old one may be overwritten
                        skipped.append(k)
                        bar.update(len(chunk))
                        continue
                    log.warning("re-extracting shard %d: %s", k, problem)
                block = features_of(target, chunk, codec, cfg, on_progress=progress)
                writer.submit(k, block, sha)
            writer.wait()
        finally:
            writer.close()
            bar.close()
        report.written = writer.written
        log.info(
            "rank %d/%d: extracted shards %s, found shards %s finished",
            ranks.rank,
            ranks.world,
            sorted(set(done) - set(skipped)),
            skipped,
        )
    except Exception as e:
        if failure is None:
            failure = e
        report = _RankReport(entries={}, num_chunks=0, written=0, computed_tokens=0, error=_describe(e))
    reports = group.gather(report)

    outcome: dict[str, Any] | None = None
    if reports is not None:  # rank 0: fold every rank's shards into the manifest
        try:
            outcome = _finish(out_dir, reports)
        except Exception as e:
            outcome = {"error": _describe(e)}
            if failure is None:
                failure = e
        finally:
            if lock is not None:
                lock.release()
    outcome = group.broadcast(outcome)
    if failure is not None:
        raise failure
    if "error" in outcome:
        raise StoreError(f"data-parallel extraction into {out_dir} failed: {outcome['error']}")
    tot = outcome["totals"]
    return ExtractResult(
        out_dir=out_dir,
        num_shards=tot["num_shards"],
        num_samples=tot["num_samples"],
        num_tokens=tot["num_tokens"],
        num_loss_tokens=tot["num_loss_tokens"],
        shards_written=outcome["written"],
        shards_skipped=tot["num_shards"] - outcome["written"],
        bytes=tot["bytes"],
        bytes_per_token=codec.bytes_per_token(),
        computed_tokens=outcome["computed_tokens"],
        seconds=time.perf_counter() - t0,
    )


def _finish(out_dir: Path, reports: list[_RankReport]) -> dict[str, Any]:
    """Rank 0: list every rank's shards in the manifest (complete), delete the part files; the totals."""
    errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error is not None]
    if errors:
        return {"error": "; ".join(errors)}
    n = reports[0].num_chunks
    counts = {rep.num_chunks for rep in reports}
    if len(counts) != 1:  # never: every rank reads the same file
        raise StoreError(f"the ranks read different numbers of shards from the input: {sorted(counts)}")
    entries: dict[int, ShardEntry] = {}
    for rep in reports:
        entries.update(rep.entries)
    missing = [k for k in range(n) if k not in entries]
    if missing:  # never: rank k % world writes shard k
        raise StoreError(f"no rank wrote shards {missing[:10]} of {out_dir}")
    manifest = Manifest.load(out_dir)
    if len(manifest.shards) > n:
        raise StoreConfigError(
            f"{out_dir} holds {len(manifest.shards)} shards but the input now fills only {n}: the input changed "
            "since the store was started"
        )
    manifest.shards = [entries[k] for k in range(n)]
    manifest.complete = True
    manifest.save(out_dir)
    for p in out_dir.glob(PART_GLOB):
        p.unlink()
    d = manifest.to_dict()
    log.info(
        "feature store %s: %d samples, %d tokens in %d shards from %d ranks (%s)",
        out_dir,
        d["totals"]["num_samples"],
        d["totals"]["num_tokens"],
        n,
        len(reports),
        MANIFEST,
    )
    return {
        "totals": d["totals"],
        "written": sum(rep.written for rep in reports),
        "computed_tokens": sum(rep.computed_tokens for rep in reports),
    }
