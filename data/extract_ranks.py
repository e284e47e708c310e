"""The ranks of an extraction: ``world`` processes, on one node or several, write one feature store together, and a
single process is the world of one. :func:`eyas.data.extract.extract` drives every rank through the same loop; this
module holds what differs with the world size: where a rank records its finished shards, the collectives, and rank
0's final manifest.

Any launcher that sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` starts several
(``accelerate launch``, ``torchrun``, ``srun`` around either); ``python -m eyas.data.extract`` reads them
(:meth:`Ranks.from_env`).

Design decisions:
- Shard k is extracted by rank ``k % world``. A shard's bytes depend only on its samples and the settings (see
  :mod:`eyas.data.extract`), so the store equals a single-process store shard for shard, whatever the world size.
- Every rank reads the whole samples file (small next to the features it becomes) and skips the shards of the
  others: no rank waits for another's input, and all of them count the same shards.
- The ranks share the store directory (a shared filesystem when they are on several nodes). Rank 0 alone holds
  the store's lock, checks or creates the manifest before any rank starts, and writes the final manifest.
- Where a finished shard is recorded (:class:`ShardLog`): a world of one lists it in the manifest at once (a
  reader with ``allow_incomplete`` sees the shards of a running or killed job); with several ranks each one
  rewrites its part file ``manifest.rank{r}.json`` (the shards it has finished) after each shard. Every rank reads
  the manifest and all part files on start, so a killed job resumes from what every rank finished, with the same or
  another world size (one process included).
- At the end the ranks send their entries to rank 0 over a gloo group (kilobytes, whatever device the target runs
  on); rank 0 lists every shard in order, marks the store complete and deletes the part files. An error on one
  rank travels the same way, so every rank stops with it instead of waiting for the others. A world of one starts
  no process group: its collectives return their argument.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from eyas.common import atomic_write_bytes
from eyas.data.store import Manifest, ShardEntry, StoreConfigError, StoreError

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


class RankGroup:
    """Object collectives among the ranks: over gloo (the default group when this class starts it) for several
    ranks; a world of one starts nothing and each collective returns its argument. A context manager."""

    def __init__(self, ranks: Ranks, timeout_s: float):
        self.ranks = ranks
        self.dist: Any = None
        self.owned = False
        self.pg = None
        if ranks.world == 1:
            return
        import torch.distributed as dist

        self.dist = dist
        self.owned = not dist.is_initialized()
        if self.owned:  # MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE from the launcher
            dist.init_process_group(
                "gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=timeout_s)
            )
        else:
            self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.dist is None:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (in rank order) on rank 0; None elsewhere."""
        if self.dist is None:
            return [obj]
        out = [None] * self.ranks.world if self.ranks.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier(group=self.pg)

    def close(self) -> None:
        if self.owned:
            self.dist.destroy_process_group()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RankReport:
    """What one rank sends rank 0 at the end."""

    entries: dict[int, ShardEntry] = field(default_factory=dict)
    """Its shards (written now or found finished), by index."""
    num_chunks: int = 0
    """Shards the whole input fills (every rank counts them all)."""
    written: int = 0
    """Shards this rank computed and wrote."""
    computed_tokens: int = 0
    """Tokens this rank ran through the target."""
    error: str | None = None
    """Why this rank stopped, when it failed."""


@dataclass
class StoreTotals:
    """What rank 0 tells every rank once it has written the final manifest (or why it could not)."""

    totals: dict[str, Any] = field(default_factory=dict)
    """The manifest's ``totals`` (shards, samples, tokens, loss tokens, bytes)."""
    written: int = 0
    """Shards computed by this job, all ranks together."""
    computed_tokens: int = 0
    """Tokens run through the target by this job, all ranks together."""
    error: str | None = None
    """Set when a rank failed or the manifest could not be finished."""


def load_parts(out_dir: Path) -> dict[int, ShardEntry]:
    """The shards listed in the part files a data-parallel run left in ``out_dir``, by index."""
    found: dict[int, ShardEntry] = {}
    for p in sorted(out_dir.glob(PART_GLOB)):
        try:
            d = json.loads(p.read_text())
            found.update({int(k): ShardEntry(**v) for k, v in d["shards"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:  # a hint only: its shards are redone
            log.warning("ignoring unreadable part file %s (%s)", p, e)
    return found


class ShardLog:
    """Records this rank's finished shards (written now or found finished): in ``manifest`` itself, saved after each,
    when it is the only rank; else in its part file. Called from the writer thread and the compute thread, in shard
    order (the manifest lists shards in order)."""

    def __init__(self, out_dir: Path, ranks: Ranks, manifest: Manifest):
        self.out_dir, self.ranks, self.manifest = out_dir, ranks, manifest
        self.done: dict[int, ShardEntry] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int, entry: ShardEntry) -> None:
        with self._lock:
            self.done[index] = entry
            if self.ranks.world == 1:
                self._list(index, entry)
            else:  # rewritten even for a shard found finished: the part file that listed it may be overwritten
                text = json.dumps(
                    {"shards": {str(k): asdict(v) for k, v in sorted(self.done.items())}}, indent=1
                )
                atomic_write_bytes(self.out_dir / part_name(self.ranks.rank), (text + "\n").encode())

    def _list(self, index: int, entry: ShardEntry) -> None:
        shards = self.manifest.shards
        if index < len(shards):
            if shards[index] == entry:
                return  # already listed as it is
            shards[index] = entry
        elif index == len(shards):
            shards.append(entry)
            self.manifest.complete = False  # growing: complete again only once the input is exhausted
        else:  # never: shards are recorded in order
            raise AssertionError(f"shard {index} recorded before shard {len(shards)}")
        self.manifest.save(self.out_dir)


def finish_store(out_dir: Path, reports: list[RankReport]) -> StoreTotals:
    """Rank 0: list every rank's shards in the manifest (complete), delete the part files; the job's totals."""
    errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error is not None]
    if errors:
        return StoreTotals(error="; ".join(errors))
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
    shards = [entries[k] for k in range(n)]
    if manifest.shards != shards or not manifest.complete:  # a finished store is left as it is
        manifest.shards, manifest.complete = shards, True
        manifest.save(out_dir)
    for p in out_dir.glob(PART_GLOB):  # also those of a killed data-parallel run that fewer ranks finished
        p.unlink()
    return StoreTotals(
        totals=manifest.to_dict()["totals"],
        written=sum(rep.written for rep in reports),
        computed_tokens=sum(rep.computed_tokens for rep in reports),
    )
