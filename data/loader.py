"""The training loader: batches of :class:`data.types.Batch` from the feature store (or the online mode).

Design decisions:
- One loader for both modes. It reads samples through a small :class:`FeatureSource` interface (ids, lengths,
  loss counts, ``fetch(indices) -> SampleRows``); :class:`data.store.FeatureStore` is one, the online mode's
  target runner (``data.online.OnlineSource``) is the other. Planning, packing, padding and decoding are this
  module's alone, so the trainer cannot tell which source ran.
- An epoch's plan is a pure function of (seed, epoch, the sample set, the config): a permutation from
  ``numpy.random.default_rng([seed, epoch])``, then packing (first-fit into ``batch_rows`` rows of
  ``max_tokens``; a sample that fits no open row closes the batch) or padding (one sample per row). Every rank
  computes the same global plan and takes batches ``rank, rank + W, ...``: ranks are disjoint and together
  complete. With ``even_batches`` the plan is topped up from its own start so every rank runs the same number
  of steps (as accelerate does); otherwise ranks may differ by one batch.
- The position is (epoch, batches already yielded on this rank), counted *before* a batch is handed out, so
  ``state_dict()`` taken after consuming batch i resumes at batch i + 1, exactly.
- Held-out split by a hash of the sample id (independent of order, store layout and world size).
- Samples longer than ``max_tokens`` are truncated to it; samples with fewer than ``min_loss_tokens`` loss tokens
  are skipped (nothing to learn from).
- Long rows: ``max_tokens: window`` in the trainer's settings means the target's context window
  (:func:`resolve_max_tokens`); a row never holds more than the window, since the drafter serves no position past
  it. Packed samples keep their own positions (they restart per sample): only samples that are long themselves
  teach the drafter long positions (``data.long_context`` builds such samples from the corpora).
- ``length_mix`` makes one epoch a mixture of row lengths with a given share of tokens each: a sample goes to the
  shortest length that holds it whole, each length's samples are packed into rows of that length (so a batch
  has one row length and no padding to the longest), the epoch's tokens are split by the weights (a length's
  samples repeat, reshuffled, to fill its share, or the rest wait for the next epoch), and the lengths' batches
  are interleaved by largest deficit so every stretch of training keeps the shares.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from eyas.data.store import FeatureCodec, SampleRows
from eyas.data.types import Batch

log = logging.getLogger(__name__)

PACKING = ("packed", "padded")
SPLITS = ("train", "eval", "all")
LOSS_ON = ("assistant", "all")
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoaderConfig:
    """How samples become batches."""

    batch_rows: int = 8
    """Rows per batch (B)."""
    max_tokens: int = 2048
    """Tokens per row: the packing capacity, and the truncation length of longer samples."""
    packing: str = "packed"
    """``packed`` (several samples per row, positions restart, segment ids) or ``padded`` (one sample per row)."""
    pad_to_multiple: int = 8
    """Row length T is the longest row rounded up to this (capped at ``max_tokens``)."""
    shuffle: bool = True
    """Shuffle samples every epoch (deterministic in seed and epoch)."""
    seed: int = 0
    """Seed of the shuffle."""
    even_batches: bool = True
    """Top the epoch's plan up from its start so every data-parallel rank gets the same number of batches."""
    dtype: str = "float32"
    """Dtype of the float features handed out (aux, target_hidden): float32, bfloat16 or float16."""
    eval_fraction: float = 0.0
    """Fraction of samples (by a hash of their id) held out for evaluation."""
    split: str = "train"
    """Which samples to load: ``train`` (not held out), ``eval`` (held out) or ``all``."""
    min_loss_tokens: int = 1
    """Skip samples with fewer loss-masked tokens than this."""
    pad_token_id: int = 0
    """input_ids value at padding positions (segment id 0; never a loss position)."""
    loss_on: str = "assistant"
    """Which tokens carry loss: ``assistant`` (the sample's own mask: the assistant's tokens) or ``all`` (every
    token, the user's turns and the template too; the target's distribution is stored at every position)."""
    length_mix: dict[int, float] | None = None
    """Row lengths and the share of each epoch's tokens in rows of that length, e.g. ``{1024: 0.75, 8192: 0.25}``
    (weights are normalized). Rows are then as long as these lengths and ``max_tokens`` is not used; samples
    longer than the longest are truncated to it. ``None``: every row is ``max_tokens`` long."""

    def __post_init__(self) -> None:
        if self.length_mix is not None:
            try:
                mix = {int(k): float(v) for k, v in self.length_mix.items()}
            except (TypeError, ValueError):
                raise ValueError(
                    f"loader.length_mix must map row lengths to weights, not {self.length_mix!r}"
                ) from None
            if not mix or min(mix) < 1 or min(mix.values()) < 0 or sum(mix.values()) <= 0:
                raise ValueError(
                    f"loader.length_mix needs positive row lengths and weights >= 0 with a positive sum: {mix}"
                )
            total = sum(mix.values())
            self.length_mix = {k: mix[k] / total for k in sorted(mix) if mix[k] > 0}
        if self.packing not in PACKING:
            raise ValueError(f"loader.packing must be one of {PACKING}, not {self.packing!r}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loader.loss_on must be one of {LOSS_ON}, not {self.loss_on!r}")
        if self.split not in SPLITS:
            raise ValueError(f"loader.split must be one of {SPLITS}, not {self.split!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"loader.dtype must be one of {sorted(FLOAT_DTYPES)}, not {self.dtype!r}")
        if self.batch_rows < 1 or self.max_tokens < 1 or self.pad_to_multiple < 1:
            raise ValueError("loader.batch_rows, loader.max_tokens and loader.pad_to_multiple must be >= 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"loader.eval_fraction must be in [0, 1), not {self.eval_fraction}")
        if self.split == "eval" and self.eval_fraction == 0.0:
            raise ValueError("loader.split=eval needs loader.eval_fraction > 0")

    @property
    def row_limit(self) -> int:
        """The longest row (and the truncation length of samples)."""
        return max(self.length_mix) if self.length_mix else self.max_tokens


WINDOW = "window"
"""``max_tokens`` value (in the trainer's settings) for the target's context window."""


def resolve_max_tokens(settings: dict[str, Any], window: int) -> dict[str, Any]:
    """The loader settings with ``max_tokens: window`` replaced by ``window`` (the target's
    ``max_position_embeddings``); refuses rows longer than the window."""
    out = dict(settings)
    if out.get("max_tokens") == WINDOW:
        out["max_tokens"] = int(window)
    mix = out.get("length_mix")
    longest = max(int(k) for k in mix) if mix else out.get("max_tokens", LoaderConfig.max_tokens)
    if isinstance(longest, int) and longest > window:
        raise ValueError(
            f"train.data.loader: rows of {longest} tokens exceed the target's context window ({window}); "
            "the drafter would train on positions it never serves"
        )
    return out


class FeatureSource(Protocol):
    """Where the loader gets samples' features: the feature store, or the target run on the fly."""

    codec: FeatureCodec
    sample_ids: list[str]
    lengths: np.ndarray  # [num_samples] tokens per sample

    def loss_counts(self) -> np.ndarray: ...

    def fetch(self, indices: Sequence[int]) -> list[SampleRows]: ...


def in_eval_split(sample_id: str, eval_fraction: float) -> bool:
    """True when ``sample_id`` is held out: a uniform hash of the id below ``eval_fraction``."""
    h = int.from_bytes(hashlib.sha256(b"eyas-split:" + sample_id.encode()).digest()[:8], "big")
    return h / 2.0**64 < eval_fraction


def select_samples(source: FeatureSource, cfg: LoaderConfig) -> np.ndarray:
    """Indices of the samples this loader serves (split and loss-token filter), in source order."""
    keep = np.ones(len(source.sample_ids), dtype=bool)
    if cfg.split != "all" and cfg.eval_fraction > 0:
        held = np.array([in_eval_split(i, cfg.eval_fraction) for i in source.sample_ids], dtype=bool)
        keep &= held if cfg.split == "eval" else ~held
    if cfg.min_loss_tokens > 0:
        keep &= source.loss_counts() >= cfg.min_loss_tokens
    keep &= source.lengths > 0
    return np.flatnonzero(keep)


def plan_epoch(
    lengths: np.ndarray, candidates: np.ndarray, cfg: LoaderConfig, epoch: int
) -> list[list[list[int]]]:
    """The global batch plan of one epoch: batches of rows of sample indices."""
    rng = np.random.default_rng([cfg.seed, epoch])
    order = candidates[rng.permutation(len(candidates))] if cfg.shuffle else candidates
    if not cfg.length_mix:
        return pack_rows(lengths, order, cfg.batch_rows, cfg.max_tokens, cfg.packing)
    caps = sorted(cfg.length_mix)
    used = np.minimum(lengths[order], caps[-1])
    home = np.searchsorted(caps, used)  # the shortest row length that holds each sample whole
    total = float(used.sum())
    plans: list[list[list[list[int]]]] = []
    for c, cap in enumerate(caps):
        own = order[home == c]
        if len(own) == 0:
            raise ValueError(
                f"loader.length_mix gives rows of {cap} tokens a share, but no sample is {cap} tokens or shorter "
                f"and longer than {caps[c - 1] if c else 0}"
            )
        quota, taken, got = cfg.length_mix[cap] * total, [], 0.0
        while got < quota:  # repeat the length's samples (reshuffled) until its share is filled
            for i in own:
                if got >= quota:
                    break
                taken.append(i)
                got += min(int(lengths[i]), cap)
            own = own[rng.permutation(len(own))] if cfg.shuffle else own
        plans.append(pack_rows(lengths, np.asarray(taken), cfg.batch_rows, cap, cfg.packing))
    batches: list[list[list[int]]] = []
    emitted, nxt = [0.0] * len(caps), [0] * len(caps)
    while any(n < len(p) for n, p in zip(nxt, plans)):
        # the length furthest below its share of what was handed out so far goes next
        c = min(
            (c for c in range(len(caps)) if nxt[c] < len(plans[c])),
            key=lambda c: emitted[c] / cfg.length_mix[caps[c]],
        )
        batch = plans[c][nxt[c]]
        nxt[c] += 1
        emitted[c] += sum(min(int(lengths[i]), caps[c]) for row in batch for i in row)
        batches.append(batch)
    return batches


def pack_rows(
    lengths: np.ndarray, order: np.ndarray, batch_rows: int, cap: int, packing: str
) -> list[list[list[int]]]:
    """Samples in ``order`` as batches of ``batch_rows`` rows of at most ``cap`` tokens: first-fit packing (a
    sample that fits no open row closes the batch), or one sample per row (``padded``)."""
    b = batch_rows
    batches: list[list[list[int]]] = []
    if packing == "padded":
        idx = [int(i) for i in order]
        return [[[i] for i in idx[s : s + b]] for s in range(0, len(idx), b)]
    rows: list[list[int]] = [[] for _ in range(b)]
    free = [cap] * b
    for i in order:
        n = min(int(lengths[i]), cap)
        r = next((r for r in range(b) if free[r] >= n), None)
        if r is None:  # no open row has room: close the batch (all its rows hold samples)
            batches.append(rows)
            rows, free, r = [[] for _ in range(b)], [cap] * b, 0
        rows[r].append(int(i))
        free[r] -= n
    last = [row for row in rows if row]
    if last:
        batches.append(last)
    return batches


def collate(
    rows: list[list[int]], fetched: dict[int, SampleRows], codec: FeatureCodec, cfg: LoaderConfig
) -> Batch:
    """Assemble one Batch from the samples of each row (packed in order; positions restart per sample)."""
    dtype = FLOAT_DTYPES[cfg.dtype]
    limit = cfg.row_limit
    used = [sum(min(fetched[i].num_tokens, limit) for i in row) for row in rows]
    m = cfg.pad_to_multiple
    t = min(-(-max(used) // m) * m, limit)  # every row fits: rows hold at most their row length
    b = len(rows)
    dev = next(iter(fetched.values())).input_ids.device
    width = codec.num_aux * codec.hidden_size
    out: dict[str, Any] = dict(
        input_ids=torch.full((b, t), cfg.pad_token_id, dtype=torch.long, device=dev),
        loss_mask=torch.zeros(b, t, dtype=torch.bool, device=dev),
        position_ids=torch.zeros(b, t, dtype=torch.long, device=dev),
        segment_ids=torch.zeros(b, t, dtype=torch.long, device=dev),
        aux=torch.zeros(b, t, width, dtype=dtype, device=dev),
    )
    topk = codec.options.distribution == "topk"
    if topk:
        k = codec.options.topk
        out["topk_logprobs"] = torch.zeros(b, t, k, dtype=torch.float32, device=dev)
        out["topk_ids"] = torch.zeros(b, t, k, dtype=torch.long, device=dev)
    else:
        out["target_hidden"] = torch.zeros(b, t, codec.hidden_size, dtype=dtype, device=dev)
    sample_ids: list[list[str]] = []
    for r, row in enumerate(rows):
        pos = 0
        sample_ids.append([])
        for seg, i in enumerate(row, start=1):
            s = fetched[i]
            n = min(s.num_tokens, limit)
            sl = slice(pos, pos + n)
            feats = {name: v[:n] for name, v in s.features.items()}
            out["input_ids"][r, sl] = s.input_ids[:n]
            out["loss_mask"][r, sl] = True if cfg.loss_on == "all" else s.loss_mask[:n].bool()
            out["position_ids"][r, sl] = torch.arange(n, device=dev)
            out["segment_ids"][r, sl] = seg
            out["aux"][r, sl] = codec.decode_aux(feats, dtype)
            if topk:
                out["topk_logprobs"][r, sl] = feats["topk_logprobs"]
                out["topk_ids"][r, sl] = feats["topk_ids"].long()
            else:
                out["target_hidden"][r, sl] = feats["hidden"].to(dtype)
            sample_ids[-1].append(s.id)
            pos += n
    return Batch(**out, sample_ids=sample_ids)


class FeatureLoader:
    """Deterministic, rank-sharded, resumable batches over a :class:`FeatureSource`.

    ``for batch in loader`` yields the rest of the current epoch and then moves to the next epoch; breaking out
    keeps the position. ``len(loader)`` is this rank's number of batches in the current epoch (packing makes it
    vary slightly between epochs).
    """

    def __init__(
        self, source: FeatureSource, cfg: LoaderConfig | None = None, *, rank: int = 0, world_size: int = 1
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.source = source
        self.cfg = cfg or LoaderConfig()
        self.rank = rank
        self.world_size = world_size
        self.candidates = select_samples(source, self.cfg)
        if len(self.candidates) == 0:
            raise ValueError(
                f"no samples to load (split={self.cfg.split}, eval_fraction={self.cfg.eval_fraction}, "
                f"min_loss_tokens={self.cfg.min_loss_tokens}, {len(source.sample_ids)} samples in the source)"
            )
        truncated = int((source.lengths[self.candidates] > self.cfg.row_limit).sum())
        if truncated:
            log.warning(
                "%d samples are longer than the longest row (%d tokens) and will be truncated",
                truncated,
                self.cfg.row_limit,
            )
        self.epoch = 0
        self.step = 0
        self._plan: tuple[int, list[list[list[int]]]] | None = None

    # -- plan ---------------------------------------------------------------------------------------------------
    def global_plan(self, epoch: int) -> list[list[list[int]]]:
        """Every rank's batches of ``epoch``, before sharding (with the ``even_batches`` top-up)."""
        plan = plan_epoch(self.source.lengths, self.candidates, self.cfg, epoch)
        if self.cfg.even_batches and len(plan) % self.world_size:
            extra = self.world_size - len(plan) % self.world_size
            plan = plan + [plan[j % len(plan)] for j in range(extra)]
        return plan

    def rank_plan(self, epoch: int) -> list[list[list[int]]]:
        """This rank's batches of ``epoch``."""
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.global_plan(epoch)[self.rank :: self.world_size])
        return self._plan[1]

    def __len__(self) -> int:
        return len(self.rank_plan(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self.epoch, self.step = int(epoch), 0

    # -- iteration ----------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        plan = self.rank_plan(self.epoch)
        while self.step < len(plan):
            rows = plan[self.step]
            self.step += 1  # counted before handing out: a state saved now resumes after this batch
            yield self.make_batch(rows)
        self.epoch, self.step = self.epoch + 1, 0

    def forever(self) -> Iterator[Batch]:
        """Batches across epochs without end."""
        while True:
            yield from self

    def make_batch(self, rows: list[list[int]]) -> Batch:
        wanted = sorted({i for row in rows for i in row})
        fetched = dict(zip(wanted, self.source.fetch(wanted)))
        return collate(rows, fetched, self.source.codec, self.cfg)

    # -- resume -------------------------------------------------------------------------------------------------
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for i in self.candidates:
            h.update(self.source.sample_ids[i].encode() + b"\0")
        h.update(
            repr((self.cfg.batch_rows, self.cfg.max_tokens, self.cfg.packing, self.cfg.shuffle)).encode()
        )
        if self.cfg.length_mix:
            h.update(repr(sorted(self.cfg.length_mix.items())).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """The exact position: a loader given this state yields the batches this one would yield next."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.cfg.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diff = [k for k in ("seed", "rank", "world_size", "samples") if state.get(k) != mine[k]]
        if diff:
            parts = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in diff)
            raise ValueError(
                f"loader state does not belong to this loader ({parts}); resume with the same data, config, seed "
                "and world size"
            )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
