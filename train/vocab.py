"""The draft vocabulary: the N most frequent loss-masked target tokens of the training data.

Design decisions:
- Only loss-masked tokens count (``loss_mask[t]``: token t was written by the assistant), since those are the
  tokens the drafter will have to propose.
- Ties are broken by the smaller target id, and tokens never seen fill the remaining slots in id order, so the
  vocabulary is a pure function of the counts.
- The map is returned sorted by target id (``d2t`` is then non-decreasing); the order carries no meaning.
- Coverage (share of loss-masked tokens whose id is in the vocabulary) is the number to look at when choosing
  N: every uncovered token is a guaranteed rejection at serving time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import atomic_write_bytes


@dataclass
class DraftVocab:
    """A draft vocabulary and its statistics."""

    draft_to_target: torch.Tensor
    """[N] long, sorted ascending: target id of draft token i (what ``Eagle3Drafter.set_vocab_map`` takes)."""
    target_vocab_size: int
    loss_tokens: int
    """Loss-masked tokens counted."""
    covered_tokens: int
    """Of those, the ones whose id is in the vocabulary."""
    distinct_seen: int
    """Distinct loss-masked token ids in the data."""

    @property
    def size(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def coverage(self) -> float:
        """Fraction of loss-masked tokens covered (1.0 on empty data)."""
        return self.covered_tokens / self.loss_tokens if self.loss_tokens else 1.0

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: draft id of each target id, -1 outside the vocabulary."""
        t2d = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        t2d[self.draft_to_target] = torch.arange(self.size)
        return t2d

    def stats(self) -> dict[str, Any]:
        return {
            "draft_vocab_size": self.size,
            "target_vocab_size": self.target_vocab_size,
            "loss_tokens": self.loss_tokens,
            "covered_tokens": self.covered_tokens,
            "coverage": round(self.coverage, 6),
            "distinct_seen": self.distinct_seen,
        }

    def save(self, path: str | os.PathLike) -> None:
        """JSON with the statistics and the id list (atomic)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {**self.stats(), "draft_to_target": self.draft_to_target.tolist()}
        atomic_write_bytes(path, json.dumps(payload).encode())

    @classmethod
    def load(cls, path: str | os.PathLike, target_vocab_size: int | None = None) -> DraftVocab:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
            ids = torch.tensor(d["draft_to_target"], dtype=torch.long)
            v = cls(
                ids,
                int(d["target_vocab_size"]),
                int(d["loss_tokens"]),
                int(d["covered_tokens"]),
                int(d["distinct_seen"]),
            )
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a draft vocabulary file written by DraftVocab.save ({e})") from e
        if target_vocab_size is not None and v.target_vocab_size != target_vocab_size:
            raise ValueError(
                f"{path}: draft vocabulary built for a target vocabulary of {v.target_vocab_size}, but the target has "
                f"{target_vocab_size}; rebuild it for this target (drafter.vocab_file=null)"
            )
        return v


def count_loss_tokens(items: Iterable[Any], vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of loss-masked token ids.

    ``items`` yields anything with ``input_ids`` and ``loss_mask`` (``data.types.Sample``, ``Batch``, a store's
    ``SampleRows``; lists, numpy arrays or tensors of any shape) or ``(input_ids, loss_mask)`` pairs.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i, item in enumerate(items):
        ids, mask = item if isinstance(item, tuple) else (item.input_ids, item.loss_mask)
        ids = (
            torch.as_tensor(np.asarray(ids) if not isinstance(ids, torch.Tensor) else ids).reshape(-1).long()
        )
        mask = (
            torch.as_tensor(np.asarray(mask) if not isinstance(mask, torch.Tensor) else mask)
            .reshape(-1)
            .bool()
        )
        if ids.shape != mask.shape:
            raise ValueError(f"item {i}: {ids.numel()} token ids but {mask.numel()} loss-mask entries")
        sel = ids[mask]
        if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= vocab_size):
            raise ValueError(
                f"item {i}: token id {int(sel.max())} outside the target vocabulary [0, {vocab_size}); "
                "was the data tokenized for another target?"
            )
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """The ``size`` most frequent ids of ``counts`` ([V]); ties and unseen fillers by ascending id."""
    counts = torch.as_tensor(counts).long().reshape(-1)
    vocab_size = counts.numel()
    if size > vocab_size:
        raise ValueError(
            f"draft vocabulary of {size} tokens requested, but the target vocabulary has only {vocab_size}; "
            f"set drafter.draft_vocab_size <= {vocab_size}"
        )
    if size < 1:
        raise ValueError(f"draft vocabulary size must be positive, not {size}")
    # stable sort on -count keeps ascending id order inside each count
    order = torch.sort(-counts, stable=True).indices
    chosen = order[:size].sort().values
    total = int(counts.sum())
    return DraftVocab(
        draft_to_target=chosen,
        target_vocab_size=vocab_size,
        loss_tokens=total,
        covered_tokens=int(counts[chosen].sum()),
        distinct_seen=int((counts > 0).sum()),
    )
