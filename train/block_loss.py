"""Distillation of the DFlash block drafter (``serving.models.dflash``): anchors, block targets, loss and τ_sim.

Conventions (``data.types.Batch``; ``serving.models.dflash``): a block anchored at ``a`` reads the context
``aux[0..a-1]`` of its own sample and the token ``x_a``; slot ``k`` (1..K) predicts ``x_{a+k}``, so its teacher is
the target's distribution stored at position ``a + k - 1``, and it trains when that position is supervised (token
``a + k`` is a loss token of the same sample; ``train.losses.supervised_positions``).

Design decisions:
- Anchors are the positions whose next token is supervised, past their sample's first token (a served block
  always has context). Training draws ``train.block_anchors`` of them per row without replacement from the global
  torch generator (which checkpoints save and resume restores); evaluation takes all of them, so its chains are
  the served walk over every position (:func:`train.losses.chain_counts`).
- The teacher is built only at the positions some block slot reads (``build_teacher(only=...)``), not at every
  supervised position.
- The objective is ``train.loss``'s per-row one (:func:`train.losses.objective_argmax`), weighted per slot by
  ``train.step_weights`` (``exp(-(k-1)/gamma)`` with ``train.decay_gamma``), normalised like EAGLE-3's loss by
  the step's supervised tokens. A hit is scored as serving scores it (the draft's target id is the target's
  full-vocabulary argmax); slot k of a chain counts only when slots 1..k-1 hit and the data followed the
  target's argmax there, which is when the block's context at serving would be this one.
- :class:`BlockDistillationModel` has :class:`train.losses.DistillationModel`'s forward signature plus the
  anchors, so the trainer drives both the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from eyas.data.types import Batch
from eyas.serving.models.dflash import DFlashDrafter
from eyas.train.losses import (
    LOSSES,
    OBJECTIVES,
    LossOutput,
    Teacher,
    chain_counts,
    objective_argmax,
    supervised_positions,
)

EVAL_ANCHOR_CHUNK = 256
"""Anchors per row run at once in evaluation (every position is an anchor there; bounds the score tensors)."""


@dataclass
class BlockPlan:
    """Where a batch's blocks sit: ``anchors`` [B, A] long (-1: none) and ``targets`` [B, T] bool, the positions
    whose teacher some slot reads."""

    anchors: torch.Tensor
    targets: torch.Tensor


def anchor_candidates(batch: Batch) -> torch.Tensor:
    """[B, T] bool: positions a block may be anchored at (next token supervised, not its sample's first token)."""
    return supervised_positions(batch) & (batch.position_ids > 0)


def plan_blocks(batch: Batch, slots: int, num_anchors: int | None = None) -> BlockPlan:
    """Anchors of ``batch`` (``num_anchors`` per row drawn at random, or all of them when None) and the teacher
    positions their ``slots`` slots read."""
    cand = anchor_candidates(batch)
    b, t = cand.shape
    dev = cand.device
    if num_anchors is None:
        n = int(cand.sum(-1).max()) if b else 0
        # a stable sort puts each row's candidates first, in position order
        order = torch.sort((~cand).to(torch.int8), dim=-1, stable=True).indices[:, :n]
    else:
        n = min(num_anchors, t)
        score = torch.rand(b, t, device=dev).masked_fill(~cand, 2.0)  # candidates first, in random order
        order = score.argsort(dim=-1)[:, :n]
    keep = torch.gather(cand, 1, order)
    anchors = torch.where(keep, order, torch.full_like(order, -1))
    targets = torch.zeros(b, t, dtype=torch.bool, device=dev)
    rows = torch.arange(b, device=dev)[:, None]
    for k in range(1, slots + 1):
        p = anchors + k - 1
        ok = (anchors >= 0) & (p < t)
        targets[rows.expand_as(p)[ok], p[ok]] = True
    return BlockPlan(anchors=anchors, targets=targets & supervised_positions(batch))


def block_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    teacher: Teacher,
    input_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    step_weights: list[float],
    normalizer: torch.Tensor | float,
    with_chain: bool = False,
    loss: str = "fkl",
    loss_weight: float | None = None,
    chain_steps: int | None = None,
) -> LossOutput:
    """The weighted objective of blocks ``hidden`` [B, A, S, H] at ``anchors`` [B, A] (see the module docstring);
    ``with_chain``: also the acceptance counts of chains of ``chain_steps`` drafts (default: every slot), with the
    anchors laid out by position (evaluation's :func:`plan_blocks` with every anchor)."""
    b, t = input_ids.shape
    k = hidden.shape[2] - 1
    if len(step_weights) != k:
        raise ValueError(f"{len(step_weights)} slot weights for blocks of {k} masks")
    dev = input_ids.device
    valid = anchors >= 0
    a_c = anchors.clamp(min=0)
    rows = torch.arange(b, device=dev)[:, None].expand_as(anchors)
    seg = segment_ids[rows, a_c]
    draft_to_target = drafter.draft_to_target.to(dev)
    total = torch.zeros((), dtype=torch.float32, device=dev)
    ce_sum, count, correct = [], [], []
    counted_rows, correct_rows, faithful_rows = [], [], []
    for j in range(1, k + 1):
        p = a_c + j - 1  # the teacher's position of slot j
        inside = valid & (p < t)
        p_c = p.clamp(max=t - 1)
        trow = teacher.index[rows, p_c]  # [B, A]
        scored = inside & (trow >= 0) & (segment_ids[rows, p_c] == seg)
        z = drafter.logits(hidden[:, :, j][scored])  # [M, Vd]
        tr = trow[scored]
        ok = teacher.in_vocab[tr]
        ce, top = objective_argmax(z, teacher.probs[tr], loss, loss_weight)
        s = (ce * ok).sum()
        total = total + step_weights[j - 1] * s
        ce_sum.append(s.detach())
        count.append(ok.sum())
        hit = (draft_to_target[top] == teacher.target_argmax[tr]) & ok & teacher.argmax_in_draft[tr]
        correct.append(hit.sum())
        if with_chain:
            # per anchor position: scored, hit, and whether the data's x_{a+j} is the target's argmax
            c_rows = torch.zeros(b, t, dtype=torch.bool, device=dev)
            h_rows = torch.zeros_like(c_rows)
            f_rows = torch.zeros_like(c_rows)
            ab, aa = rows[scored], a_c[scored]
            c_rows[ab, aa] = True
            h_rows[ab, aa] = hit
            nxt = input_ids[ab, (aa + j).clamp(max=t - 1)]
            f_rows[ab, aa] = nxt == teacher.target_argmax[tr]
            counted_rows.append(c_rows)
            correct_rows.append(h_rows)
            faithful_rows.append(f_rows)
    out = LossOutput(
        loss=total / normalizer,
        ce_sum=torch.stack(ce_sum).float(),
        count=torch.stack(count).float(),
        correct=torch.stack(correct).float(),
    )
    if with_chain:
        n = chain_steps or k
        if not 1 <= n <= k:
            raise ValueError(f"chains of {n} drafts from blocks of {k} masks")
        out.chain = chain_counts(counted_rows[:n], correct_rows[:n], faithful_rows[:n])
    return out


class BlockDistillationModel(nn.Module):
    """The DFlash drafter plus its loss as one module (what accelerate wraps), driven like
    :class:`train.losses.DistillationModel`; ``anchors`` come from :func:`plan_blocks`.

    Blocks hold ``len(step_weights)`` masks in training; evaluation's chains of ``chain_steps`` drafts run blocks
    of ``max(chain_steps, K)`` masks, the slots past the training's weighing 0 in the loss."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        step_weights: list[float],
        bf16_head: bool = False,
        loss: str = "fkl",
        loss_weight: float | None = None,
    ):
        super().__init__()
        if loss not in OBJECTIVES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {LOSSES}")
        self.drafter = drafter
        self.step_weights = list(step_weights)
        self.bf16_head = bf16_head
        self.loss = loss
        self.loss_weight = loss_weight

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        teacher: Teacher,
        normalizer: torch.Tensor | float,
        with_chain: bool = False,
        chain_steps: int | None = None,
        anchors: torch.Tensor | None = None,
    ) -> LossOutput:
        if anchors is None:
            raise ValueError(
                "a DFlash drafter trains on blocks: pass the anchors (train.block_loss.plan_blocks)"
            )
        weights = self.step_weights
        if with_chain and chain_steps is not None and chain_steps > len(weights):
            weights = weights + [0.0] * (chain_steps - len(weights))
        out = self.drafter.forward_blocks(
            input_ids,
            aux,
            anchors,
            len(weights),
            position_ids=position_ids,
            segment_ids=segment_ids,
            anchor_chunk=EVAL_ANCHOR_CHUNK if with_chain else None,
        )
        head_ctx = (
            torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if self.bf16_head else nullcontext()
        )
        with head_ctx:
            return block_loss(
                self.drafter,
                out.hidden,
                anchors,
                teacher,
                input_ids,
                segment_ids,
                weights,
                normalizer,
                with_chain=with_chain,
                loss=self.loss,
                loss_weight=self.loss_weight,
                chain_steps=chain_steps,
            )
