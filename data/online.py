"""Online mode: the target runs on the fly and the trainer gets the same :class:`data.types.Batch` as from a store.

Design decisions:
- The online mode is only another :class:`data.loader.FeatureSource`: :class:`OnlineSource` computes a batch's
  features with the extraction code (:func:`data.extract.compute_features`: same micro-batching, same
  encoding) and :class:`data.loader.FeatureLoader` plans, packs, pads and decodes exactly as for the store. The
  two paths share every line after the target forward.
- The features go through the store's codec (bf16, fp8 or int4 aux; hidden or top-k distribution) and back,
  so a store-fed and an online run see the same rounding; they differ only where the target's own arithmetic
  depends on how samples were grouped into forwards (last-bit noise, then the store dtype's rounding).
- Features stay on the target's device (no round trip through host memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eyas.data.extract import codec_for, compute_features
from eyas.data.loader import FeatureLoader, LoaderConfig
from eyas.data.store import SampleRows, StoreOptions
from eyas.data.types import Sample


class OnlineSource:
    """A :class:`data.loader.FeatureSource` that runs ``target`` over the requested samples when fetched."""

    def __init__(
        self,
        samples: Sequence[Sample],
        target,
        options: StoreOptions | None = None,
        *,
        max_batch_tokens: int = 16384,
        max_batch_rows: int = 256,
    ):
        self.samples = list(samples)
        self.target = target
        self.codec = codec_for(target, options or StoreOptions())
        self.sample_ids = [s.id for s in self.samples]
        self.lengths = np.array([s.num_tokens for s in self.samples], dtype=np.int64)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows

    def loss_counts(self) -> np.ndarray:
        return np.array([s.num_loss_tokens for s in self.samples], dtype=np.int64)

    def fetch(self, indices: Sequence[int]) -> list[SampleRows]:
        block = compute_features(
            self.target,
            [self.samples[i] for i in indices],
            self.codec,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_rows=self.max_batch_rows,
            out_device=self.target.device,
        )
        return [block.rows(j) for j in range(len(indices))]


def online_loader(
    samples: Sequence[Sample],
    target,
    cfg: LoaderConfig | None = None,
    options: StoreOptions | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    max_batch_tokens: int = 16384,
) -> FeatureLoader:
    """The online counterpart of ``FeatureLoader(FeatureStore(path), cfg)``: same batches, target run on the fly."""
    source = OnlineSource(samples, target, options, max_batch_tokens=max_batch_tokens)
    return FeatureLoader(source, cfg, rank=rank, world_size=world_size)
