"""Mixtures: deterministic hash splits, bottom-k budgets, deduplication across sources."""

from __future__ import annotations

import hashlib
import heapq
import logging
from dataclasses import dataclass
from typing import Any

from eyas.data.corpora.config import SPLITS, CorpusConfig, CorpusError
from eyas.data.corpora.readers import SourceStats
from eyas.data.corpora.sources import NATIVE_SPLIT_KINDS, read_source
from eyas.data.types import Conversation

log = logging.getLogger(__name__)


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
