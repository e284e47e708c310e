"""Batches made by running the target over token sequences in memory (no store).

Used by smoke runs and launch tests (``train.data.source=synthetic``: random tokens), the training benchmark and
the tests (any given sequences). The features are exactly what the online mode and the store hold: aux states,
the final hidden state or top-k log-probabilities, in the target's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas.data.types import Batch
from eyas.train.config import SyntheticDataConfig
from eyas.train.sources import SampleFeatures, collate


@torch.no_grad()
def sample_features(
    target,
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_id: str,
    *,
    teacher: str = "hidden",
    topk: int = 32,
) -> SampleFeatures:
    """Run ``target`` over one sequence ``ids`` [n] and keep what a Batch needs."""
    out = target.forward(ids[None].to(target.device), logits="none")
    aux, hidden = out.aux[0].cpu(), out.hidden[0].cpu()
    feats = SampleFeatures(
        id=sample_id, input_ids=ids.long().cpu(), loss_mask=loss_mask.bool().cpu(), aux=aux
    )
    if teacher == "hidden":
        feats.target_hidden = hidden
    else:
        logprobs = torch.log_softmax(target.head(out.hidden[0]).float(), dim=-1)  # [n, V]
        top = torch.topk(logprobs, topk, dim=-1)
        feats.topk_logprobs = top.values.cpu()
        feats.topk_ids = top.indices.cpu()
    return feats


def batches_from_sequences(
    target,
    sequences: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    *,
    batch_size: int = 1,
    teacher: str = "hidden",
    topk: int = 32,
    ids: Sequence[str] | None = None,
) -> list[Batch]:
    """Features of each sequence, padded into batches of ``batch_size`` samples (in order); ``ids`` name the
    samples (default ``s0, s1, ...``)."""
    ids = list(ids) if ids is not None else [f"s{i}" for i in range(len(sequences))]
    feats = [
        sample_features(target, s, m, sid, teacher=teacher, topk=topk)
        for sid, s, m in zip(ids, sequences, loss_masks)
    ]
    return [collate(feats[i : i + batch_size]) for i in range(0, len(feats), batch_size)]


def random_sequences(
    n: int,
    seq_len: int,
    vocab_size: int,
    loss_fraction: float,
    seed: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``n`` uniform random token sequences (ids >= 3, clear of the usual special ids) and loss masks covering
    each sequence's last ``loss_fraction`` of tokens."""
    g = torch.Generator().manual_seed(seed)
    low = min(3, vocab_size - 1)
    seqs = [torch.randint(low, vocab_size, (seq_len,), generator=g) for _ in range(n)]
    start = seq_len - max(1, int(round(loss_fraction * seq_len)))
    masks = [torch.arange(seq_len) >= start for _ in range(n)]
    return seqs, masks


@dataclass
class SyntheticData:
    train: list[Batch]
    eval: list[Batch]
    vocab_counts: torch.Tensor
    """[V] loss-token counts of the whole training set (all processes' samples)."""


def synthetic_data(target, cfg: SyntheticDataConfig, rank: int = 0, world: int = 1) -> SyntheticData:
    """This process's share (samples ``rank, rank + world, ...``) of ``cfg.num_samples`` random training sequences
    and ``cfg.eval_samples`` held-out ones, as batches; the sets depend only on ``cfg``, not on ``world``."""
    from eyas.train.vocab import count_loss_tokens

    v = target.vocab_size

    def split(n: int, salt: int, prefix: str):
        seqs, masks = random_sequences(n, cfg.seq_len, v, cfg.loss_fraction, cfg.seed * 7919 + salt)
        batches = batches_from_sequences(
            target,
            seqs[rank::world],
            masks[rank::world],
            batch_size=cfg.batch_size,
            teacher=cfg.teacher,
            topk=cfg.topk,
            ids=[f"{prefix}-{i}" for i in range(rank, n, world)],
        )
        return batches, seqs, masks

    train, seqs, masks = split(cfg.num_samples, 1, "train")
    ev, _, _ = split(cfg.eval_samples, 2, "eval")
    return SyntheticData(train=train, eval=ev, vocab_counts=count_loss_tokens(zip(seqs, masks), v))
