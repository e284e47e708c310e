"""What the training loop consumes: an iterable of :class:`data.types.Batch` whose position can be saved.

Design decisions:
- The loop needs only :class:`BatchSource`: ``__iter__`` (the rest of the current epoch), ``state_dict()`` and
  ``load_state_dict()``. The state taken right after a batch was yielded must resume at the next batch; the
  feature-store loader (``data.loader``) and :class:`ListSource` both work that way. Each process holds its own
  source (its shard of the data); the loop saves every rank's state.
- An epoch ends when ``__iter__`` stops; the loop then calls ``iter()`` again for the next one. A source that
  yields nothing twice in a row is empty, which is an error, not an infinite loop.
- :func:`collate` pads per-sample features into one Batch (no packing), the layout the synthetic data and the
  tests use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from eyas.data.types import Batch


@runtime_checkable
class BatchSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ListSource:
    """Batches held in memory; each epoch visits them in a permutation drawn from ``(seed, epoch)``."""

    def __init__(self, batches: Sequence[Batch], *, shuffle: bool = True, seed: int = 0):
        self.batches = list(batches)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.pos = 0

    def __len__(self) -> int:
        return len(self.batches)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.batches)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.batches), generator=g).tolist()

    def __iter__(self) -> Iterator[Batch]:
        if self.batches and self.pos >= len(self.batches):
            self.epoch, self.pos = self.epoch + 1, 0
        order = self._order()
        while self.pos < len(order):
            i = order[self.pos]
            self.pos += 1  # the state after this yield points at the next batch
            yield self.batches[i]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "num_batches": len(self.batches), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_batches") != len(self.batches) or state.get("seed") != self.seed:
            raise ValueError(
                f"data state was saved for {state.get('num_batches')} batches (seed {state.get('seed')}), this "
                f"source has {len(self.batches)} (seed {self.seed}): the data changed since the checkpoint"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


@dataclass
class SampleFeatures:
    """One sample's tokens and target features (what a store row or an online forward gives)."""

    id: str
    input_ids: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool
    aux: torch.Tensor  # [n, A*H]
    target_hidden: torch.Tensor | None = None  # [n, H]
    topk_logprobs: torch.Tensor | None = None  # [n, k]
    topk_ids: torch.Tensor | None = None  # [n, k]


def collate(samples: Sequence[SampleFeatures]) -> Batch:
    """Right-pad samples into a Batch (one sample per row; padding has segment 0 and no loss)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    b, t = len(samples), max(int(s.input_ids.numel()) for s in samples)
    first = samples[0]

    def pad(name: str, fill: float | int = 0) -> torch.Tensor | None:
        x = getattr(first, name)
        if x is None:
            return None
        out = torch.full((b, t, *x.shape[1:]), fill, dtype=x.dtype)
        for i, s in enumerate(samples):
            v = getattr(s, name)
            out[i, : v.shape[0]] = v
        return out

    n = torch.tensor([int(s.input_ids.numel()) for s in samples])
    real = torch.arange(t)[None, :] < n[:, None]  # [B, T]
    return Batch(
        input_ids=pad("input_ids").long(),
        loss_mask=pad("loss_mask").bool() & real,
        position_ids=torch.arange(t).expand(b, t).clone() * real,
        segment_ids=real.long(),
        aux=pad("aux"),
        target_hidden=pad("target_hidden"),
        topk_logprobs=pad("topk_logprobs"),
        topk_ids=pad("topk_ids"),
        sample_ids=[[s.id] for s in samples],
    )
