"""The data types that flow between eyas stages.

- :class:`Conversation`: one chat record, the docs/DESIGN.md conversation format.
- :class:`Sample`: a conversation rendered by the target's chat template: token ids + assistant-only loss mask.
- :class:`Batch`: what the trainer consumes, from the feature store or from the online mode alike.

Position conventions (used everywhere): ``aux[t]``, ``target_hidden[t]`` and the top-k entries at ``t`` are the
target's features and next-token distribution after reading ``input_ids[0..t]``, i.e. the distribution of token
``t + 1``. ``loss_mask[t]`` is True when token ``t`` was written by the assistant (a prediction target).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    """``{"id", "conversations": [{"role", "content", "reasoning"?}]}``."""

    id: str
    messages: list[dict[str, Any]]
    source: str = ""
    """Name of the corpus it came from (for mixtures and reports)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Anything else worth keeping (reference answer of a reasoning task, regeneration info...)."""

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"id": self.id, "conversations": self.messages}
        if self.source:
            rec["source"] = self.source
        if self.meta:
            rec["meta"] = self.meta
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Conversation:
        return cls(
            id=str(rec["id"]),
            messages=list(rec["conversations"]),
            source=str(rec.get("source", "")),
            meta=dict(rec.get("meta") or {}),
        )


@dataclass
class Sample:
    """A formatted training sample."""

    id: str
    input_ids: list[int]
    loss_mask: list[bool]
    source: str = ""
    tokenizer: str | None = None
    """Fingerprint (``serving.target.tokenizer_hash``) of the tokenizer that made ``input_ids``; None: unknown
    (samples made outside ``data.prepare``). Extraction refuses samples of another tokenizer."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"sample {self.id}: {len(self.input_ids)} ids but {len(self.loss_mask)} mask entries"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class Batch:
    """A training batch (padded or packed). Shapes: B rows of T tokens.

    The target distribution comes in one of two forms: ``target_hidden`` (final normed hidden state; the trainer
    applies the frozen target head) or ``topk_logprobs``/``topk_ids`` (log-probabilities of the k most likely
    target tokens over the full vocabulary; the mass outside them is ``1 - sum(exp(topk_logprobs))``).
    """

    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    position_ids: torch.Tensor  # [B, T] long; restarts at 0 for every packed sample
    segment_ids: torch.Tensor  # [B, T] long; 0 = padding, k > 0 = k-th sample in the row
    aux: torch.Tensor  # [B, T, n_aux * H] float
    target_hidden: torch.Tensor | None = None  # [B, T, H]
    topk_logprobs: torch.Tensor | None = None  # [B, T, k] fp32
    topk_ids: torch.Tensor | None = None  # [B, T, k] long
    sample_ids: list[list[str]] = field(default_factory=list)
    """Per row, the ids of the samples packed into it (in segment order): names the culprit of a NaN loss."""

    def __post_init__(self) -> None:
        if self.target_hidden is None and self.topk_logprobs is None:
            raise ValueError("a Batch needs the target distribution: target_hidden or topk_logprobs")

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        """Move tensors; ``dtype`` applies to the float features (aux, target_hidden)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device, non_blocking=True)
                if dtype is not None and f.name in ("aux", "target_hidden"):
                    v = v.to(dtype)
            out[f.name] = v
        return Batch(**out)

    @property
    def num_tokens(self) -> int:
        return int((self.segment_ids > 0).sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())
