"""Distillation loss of the EAGLE-3 drafter under training-time test (TTT).

Conventions (``data.types.Batch``; ``serving.drafter``): the target distribution stored at position ``p`` is
the distribution of token ``p + 1``. TTT step ``j``, row ``t`` predicts ``x_{t+j+2}``, so its teacher is the
target's distribution at ``p = t + j + 1``, restricted to the draft vocabulary and renormalised, and the row
is weighted by ``loss_mask[t + j + 2]`` and by the drafter's ``valid[j][t]``.

Design decisions:
- The teacher is computed once per *position*, not per step: each position is the teacher of up to K rows
  (one per step). It is computed only where some row carries loss (``loss_mask[p + 1]``, same sample).
- ``hidden`` teachers go through the frozen target head restricted to the draft rows (a
  ``TargetHead(weight[draft_ids])`` built once). The out-of-vocabulary rule ``teacher`` needs the argmax over
  the *full* vocabulary: one full-head pass per supervised position, in row chunks, from which the draft
  columns are then gathered (no second pass). Rule ``label`` (drop rows whose data token is not a draft token)
  needs only the draft rows in training; evaluation takes the full pass too (see simulated acceptance). ``topk`` teachers scatter the top-k probabilities that fall inside the draft
  vocabulary and renormalise them. The tail (mass outside the top-k) is not used, and the store does not keep
  it: which part of it lies inside the draft vocabulary is unknown, so it can neither be placed on tokens nor
  enter the renormalisation, and a "rest of the vocabulary" bucket would train the drafter towards a set it
  cannot name. With k = 32 it is typically a few percent of the mass; ``1 - sum(exp(topk_logprobs))`` gives it.
- Rows whose teacher argmax is outside the draft vocabulary are dropped from the loss: the drafter cannot
  propose that token, so any target it is given would be wrong. The acceptance metrics count them as misses.
- The drafter's ``lm_head`` runs only on rows that carry loss (typically 40-70 % of a chat sequence), taken in
  *teacher order*: at step j the teacher row of position p is matched with drafter row p - j - 1, so the
  [N, V_draft] teacher table is built once per batch (out-of-vocabulary rows removed) and never gathered per
  step; rows that fall outside their sample at step j get weight 0. Soft cross-entropy is one fused autograd
  function (max/argmax, exp, one dot product) that keeps only ``softmax - p`` for the backward.
- The per-row objective is a choice (``train.loss``, :data:`OBJECTIVES`, all in one place): soft cross-entropy
  (``fkl``, the default: forward KL's gradient), reverse KL, Jensen-Shannon, total variation (1 - acceptance
  rate), the LK acceptance loss ``-log alpha`` and LK's hybrid of KL and TV (arXiv 2602.23881). Each reads the
  same [N, V_draft] teacher table, so each works on the hidden and the top-k teachers alike, restricted to the
  draft vocabulary; training and evaluation use the same one (evaluation's ``loss`` is the objective's).
- Loss = sum_j decay^j * sum_rows CE_j / ``normalizer`` (CE_j: the objective's per-row values). The normalizer
  is the number of supervised tokens of the *whole* optimizer step (all micro-batches, all processes), so
  data-parallel and accumulated runs give the gradient of one big batch, whatever the token counts per process.
- Simulated acceptance (see :class:`ChainCounts`): per-step teacher-forced accuracy gives
  ``tau_indep = 1 + sum_{k=1..K} prod_{j<k} acc_j``, which assumes acceptance at different depths is
  independent. ``tau_chain`` instead measures on each row the conditional acceptance at depth j given that
  depths 0..j-1 were accepted *and* the data continued with the target's argmax (then the TTT inputs are exactly
  what speculative greedy decoding would have fed the drafter), so ``prod_j`` is a chain rule, not an
  independence assumption. Both count out-of-vocabulary teacher tokens as rejections, whatever the OOV rule:
  with ``oov_rule=label`` a row whose data token is a draft token still trains on the in-draft distribution,
  but when the target's full-vocabulary argmax is not a draft token it counts as a miss (served, that draft is
  always rejected), so evaluation always needs the full argmax (the full head for ``hidden`` teachers). A hit is
  the drafter's draft token mapped to its target id equal to that argmax (ties to the lowest id), as serving
  scores it. The chains are ``chain_steps`` drafts long (``train.eval_chain_length``), whatever the training
  unroll's length: evaluation unrolls the longer of the two and weighs only the training steps in its loss.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.data.types import Batch
from eyas.serving.models.drafter import Eagle3Drafter, TTTOutput
from eyas.serving.models.target import TargetHead

_CHUNK_ELEMENTS = 1 << 26  # logits per chunk of the full-vocabulary teacher head (256 MiB in fp32)


# -- the draft vocabulary on the device -------------------------------------------------------------------------
@dataclass
class VocabMaps:
    """Both directions of the draft vocabulary, as device tensors."""

    draft_to_target: torch.Tensor  # [Vd] long
    target_to_draft: torch.Tensor  # [V] long, -1 outside the draft vocabulary

    @classmethod
    def from_draft_ids(cls, draft_to_target: torch.Tensor, vocab_size: int) -> VocabMaps:
        d2t = draft_to_target.long()
        t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
        t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
        return cls(d2t, t2d)

    def to(self, device: torch.device | str) -> VocabMaps:
        return VocabMaps(self.draft_to_target.to(device), self.target_to_draft.to(device))

    @property
    def draft_size(self) -> int:
        return int(self.draft_to_target.numel())


def draft_head(head: TargetHead, maps: VocabMaps) -> TargetHead:
    """The frozen target head restricted to the draft rows, built once (no per-batch index_select)."""
    rows = maps.draft_to_target.to(head.weight.device)
    bias = None if head.bias is None else head.bias.detach().index_select(0, rows)
    return TargetHead(
        head.weight.detach().index_select(0, rows), bias, softcap=head.softcap, scale=head.scale
    )


# -- the teacher ------------------------------------------------------------------------------------------------
@dataclass
class Teacher:
    """The target's distribution at every supervised position of a batch, in the draft vocabulary."""

    probs: torch.Tensor  # [N, Vd] fp32, rows sum to 1 (rows with in_vocab False may be all zero)
    draft_argmax: torch.Tensor  # [N] long, argmax of probs
    target_argmax: torch.Tensor  # [N] long, target id of the teacher's top token over the full vocabulary
    # (with oov_rule=label and keep_oov=False the best draft token stands in: nothing then reads it)
    argmax_in_draft: (
        torch.Tensor
    )  # [N] bool, the target's argmax is a draft token (else a served draft misses)
    in_vocab: torch.Tensor  # [N] bool, False: the row is dropped from the loss (see oov_rule)
    index: torch.Tensor  # [B, T] long, teacher row of position p, -1 where p supervises nothing
    row_b: torch.Tensor  # [N] long, batch row of each teacher row
    row_p: torch.Tensor  # [N] long, position of each teacher row

    @property
    def num_positions(self) -> int:
        return int(self.probs.shape[0])


def supervised_positions(batch: Batch) -> torch.Tensor:
    """[B, T] bool: positions p whose distribution is a training target (token p + 1 is a loss token of the
    same sample)."""
    seg = batch.segment_ids
    nxt = torch.zeros_like(batch.loss_mask)
    nxt[:, :-1] = batch.loss_mask[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    return nxt & (seg > 0)


def teacher_form(batch: Batch, wanted: str) -> str:
    """Which stored distribution to use: ``wanted`` (hidden | topk) or the batch's own for ``auto``."""
    if wanted == "auto":
        return "hidden" if batch.target_hidden is not None else "topk"
    have = batch.target_hidden if wanted == "hidden" else batch.topk_logprobs
    if have is None:
        other = "topk" if wanted == "hidden" else "hidden"
        raise ValueError(
            f"train.teacher={wanted} but the batches carry only the {other} form of the target distribution; "
            f"set train.teacher={other} or auto, or extract a store with distribution={wanted}"
        )
    return wanted


@torch.no_grad()
def build_teacher(
    batch: Batch,
    maps: VocabMaps,
    *,
    form: str = "auto",
    oov_rule: str = "teacher",
    head: TargetHead | None = None,
    draft_rows_head: TargetHead | None = None,
    keep_oov: bool = True,
    temperature: float = 1.0,
    only: torch.Tensor | None = None,
) -> Teacher:
    """The teacher table of ``batch`` (see the module docstring).

    head: the full target head (``hidden`` form with ``oov_rule=teacher``); draft_rows_head: the head restricted
    to the draft rows (:func:`draft_head`; ``hidden`` form with ``oov_rule=label``). keep_oov: keep the rows whose
    teacher token is outside the draft vocabulary (the acceptance metrics count them; training does not need them).
    only: [B, T] bool, build rows at these supervised positions only (a DFlash step's block targets).
    """
    form = teacher_form(batch, form)
    pos = supervised_positions(batch)
    if only is not None:
        pos = pos & only
    row_b, row_p = pos.nonzero(as_tuple=True)  # [N] each, row-major
    # the data token that follows each supervised position (for the label rule and the chain metric)
    label = batch.input_ids[row_b, row_p + 1]  # [N]
    vd = maps.draft_size
    if form == "hidden":
        hidden = batch.target_hidden[row_b, row_p]  # [N, H]
        if oov_rule == "teacher" or keep_oov:
            # the full-vocabulary argmax: the teacher rule needs it, and so do the acceptance metrics of either
            # rule (a row whose target argmax is not a draft token is always rejected when served)
            if head is None:
                raise ValueError(
                    "the hidden-state teacher needs the full target head for oov_rule=teacher and for the "
                    "acceptance metrics (keep_oov=True)"
                )
            target_argmax = torch.empty(row_b.numel(), dtype=torch.long, device=hidden.device)
            chunk = max(1, _CHUNK_ELEMENTS // int(head.weight.shape[0]))
            parts = []
            for s in range(0, row_b.numel(), chunk):
                top, logits = head.argmax_and_logits(hidden[s : s + chunk], maps.draft_to_target)
                target_argmax[s : s + chunk] = top
                parts.append(logits)  # [c, Vd] fp32
            draft_logits = torch.cat(parts) if parts else hidden.new_zeros(0, vd, dtype=torch.float32)
        else:
            if draft_rows_head is None:
                raise ValueError(
                    "the hidden-state teacher needs the draft-rows target head (losses.draft_head)"
                )
            draft_logits = draft_rows_head(hidden)  # [N, Vd]
            # training only (keep_oov=False): the best draft token stands in for the argmax, which no loss term
            # reads (the rows kept are those of in-vocabulary labels)
            target_argmax = maps.draft_to_target[draft_logits.argmax(-1)]
        in_vocab = maps.target_to_draft[target_argmax if oov_rule == "teacher" else label] >= 0
        if not keep_oov:
            keep = in_vocab.nonzero(as_tuple=True)[0]
            row_b, row_p, label, target_argmax, draft_logits = (
                x[keep] for x in (row_b, row_p, label, target_argmax, draft_logits)
            )
            in_vocab = in_vocab[keep]
        probs = torch.softmax(draft_logits / temperature if temperature != 1.0 else draft_logits, dim=-1)
    else:
        lp = batch.topk_logprobs[row_b, row_p].float()  # [N, k] log-probs over the full vocabulary
        ids = batch.topk_ids[row_b, row_p].long()  # [N, k]
        # the target's greedy token, ties broken as the target's own argmax over its logits breaks them (lowest
        # id first), not by the order the engine listed its top-k in
        top_lp = lp == lp.amax(-1, keepdim=True)
        target_argmax = torch.where(top_lp, ids, torch.iinfo(ids.dtype).max).amin(-1)
        draft_ids = maps.target_to_draft[ids]  # [N, k], -1 outside
        if temperature != 1.0:  # p ** (1/T), scaled so the largest is 1 (renormalised below)
            lp = (lp - lp.amax(-1, keepdim=True)) / temperature
        p = lp.exp() * (draft_ids >= 0)
        mass = p.sum(-1)
        rule = maps.target_to_draft[target_argmax if oov_rule == "teacher" else label] >= 0
        in_vocab = rule & (mass > 0)
        if not keep_oov:
            keep = in_vocab.nonzero(as_tuple=True)[0]
            row_b, row_p, label, target_argmax, draft_ids, p, mass, in_vocab = (
                x[keep] for x in (row_b, row_p, label, target_argmax, draft_ids, p, mass, in_vocab)
            )
        probs = torch.zeros(row_b.numel(), vd, dtype=torch.float32, device=lp.device)
        probs.scatter_add_(1, draft_ids.clamp(min=0), p / mass.clamp(min=1e-30)[:, None])
    index = torch.full(pos.shape, -1, dtype=torch.long, device=pos.device)
    index[row_b, row_p] = torch.arange(row_b.numel(), device=pos.device)
    return Teacher(
        probs=probs,
        draft_argmax=probs.argmax(-1),
        target_argmax=target_argmax,
        argmax_in_draft=maps.target_to_draft[target_argmax] >= 0,
        in_vocab=in_vocab,
        index=index,
        row_b=row_b,
        row_p=row_p,
    )


# -- soft cross-entropy -----------------------------------------------------------------------------------------
class _SoftCrossEntropy(torch.autograd.Function):
    """CE(p, softmax(z)) and argmax(z) per row, keeping only ``softmax(z) - p`` for the backward (one [M, V]
    buffer; the backward scales it in place, so the graph cannot be run backward twice)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, top = logits.max(-1)  # [M], [M]
        e = (logits - m[:, None]).exp_()  # [M, V]
        s = e.sum(-1)
        ce = m + s.log() - torch.linalg.vecdot(probs, logits)  # sum(p) = 1
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(e.div_(s[:, None]).sub_(probs))
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_top: torch.Tensor | None):
        (g,) = ctx.saved_tensors
        return g.mul_(grad_ce[:, None]), None


def soft_cross_entropy_argmax(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``-sum_i p_i log softmax(z)_i`` and ``argmax_i z_i`` for logits [M, V] and probabilities [M, V]."""
    if logits.shape != probs.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and teacher probabilities {tuple(probs.shape)} differ"
        )
    return _SoftCrossEntropy.apply(logits.float(), probs.float())


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-row ``-sum_i p_i log softmax(z)_i`` for logits [M, V] and target probabilities [M, V]."""
    return soft_cross_entropy_argmax(logits, probs)[0]


# -- the objectives ---------------------------------------------------------------------------------------------
# Each is a per-row loss of the drafter's logits z [M, V] against the teacher's probabilities p [M, V] over the
# draft vocabulary (rows sum to 1; a top-k teacher is zero outside its k tokens, a hidden one only where the
# softmax underflows). q = softmax(z); alpha = sum_v min(p_v, q_v) is the acceptance rate of a draft sampled from
# q against a target sampled from p, i.e. 1 - TV(p, q) (what served chains accept, arXiv 2602.23881).
_TINY = 1e-30  # floor under alpha and under the mixture of jsd: both are positive but may underflow
P_FLOOR = 1e-8
"""``rkl`` takes ``log p`` at ``log(max(p, P_FLOOR))``: a top-k teacher is zero outside its k tokens, where reverse
KL would be infinite for any drafter (whose softmax is never zero); with the floor, mass there costs
``q_v * (log q_v - log P_FLOOR)``, a finite and steep pull off the tokens the teacher does not name."""
LK_ETA = 3.0
"""``lk_hybrid`` with ``train.loss_weight`` unset: the KL weight per row is ``exp(-LK_ETA * alpha)`` (alpha
detached), the paper's adaptive weight at its eta: KL's strong gradient while the drafter is far from the
teacher, TV's acceptance-aligned one as alpha grows."""


def _wide(z: torch.Tensor) -> torch.Tensor:
    """fp32 at least (fp64 stays fp64, for the gradient tests)."""
    return z if z.dtype == torch.float64 else z.float()


def _fkl(z, p, weight):
    # soft cross-entropy -sum p log q = KL(p || q) + H(p): H(p) is constant in the drafter, so its gradient is
    # KL's (q - p); the fused function keeps one [M, V] buffer for the backward
    return _SoftCrossEntropy.apply(_wide(z), p.to(_wide(z).dtype))[0]


def _rkl(z, p, weight):
    lq = torch.log_softmax(_wide(z), -1)  # KL(q || p) = sum q (log q - log p)
    return (lq.exp() * (lq - p.clamp_min(P_FLOOR).log())).sum(-1)


def _jsd(z, p, weight):
    lq = torch.log_softmax(_wide(z), -1)  # (KL(p || m) + KL(q || m)) / 2, m = (p + q) / 2
    q = lq.exp()
    lm = ((p + q) * 0.5).clamp_min(_TINY).log()
    return 0.5 * ((torch.xlogy(p, p) - p * lm).sum(-1) + (q * (lq - lm)).sum(-1))


def _alpha(z, p):
    return torch.minimum(p, torch.softmax(_wide(z), -1)).sum(-1)


def _tv(z, p, weight):
    return 1.0 - _alpha(z, p)  # TV(p, q) = sum |p - q| / 2 = 1 - alpha


def _lk(z, p, weight):
    return -_alpha(z, p).clamp_min(_TINY).log()  # gradient (1 / alpha) * TV's: TV's direction, KL-like size


def _lk_hybrid(z, p, weight):
    lq = torch.log_softmax(_wide(z), -1)  # lam KL(p || q) + (1 - lam) TV(p, q)
    alpha = torch.minimum(p, lq.exp()).sum(-1)
    kl = (torch.xlogy(p, p) - p * lq).sum(-1)
    lam = torch.exp(-LK_ETA * alpha.detach()) if weight is None else weight
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


OBJECTIVES = {
    "fkl": _fkl,
    "rkl": _rkl,
    "jsd": _jsd,
    "tv": _tv,
    "lk": _lk,
    "lk_hybrid": _lk_hybrid,
}
"""``train.loss`` name -> per-row loss ``f(logits [M, V], probs [M, V], weight) -> [M]`` (``weight``:
``train.loss_weight``, read by ``lk_hybrid`` only). ``fkl`` is today's soft cross-entropy (forward KL's gradient)."""
LOSSES = tuple(OBJECTIVES)


def objective_argmax(
    logits: torch.Tensor, probs: torch.Tensor, loss: str = "fkl", weight: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss ``loss`` (:data:`OBJECTIVES`) and ``argmax_i z_i`` for logits [M, V] and probabilities [M, V]."""
    if loss == "fkl":
        return soft_cross_entropy_argmax(logits, probs)
    if logits.shape != probs.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and teacher probabilities {tuple(probs.shape)} differ"
        )
    if loss not in OBJECTIVES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {LOSSES}")
    return OBJECTIVES[loss](logits, probs.to(_wide(logits).dtype), weight), logits.detach().argmax(-1)


# -- the TTT loss -----------------------------------------------------------------------------------------------
@dataclass
class ChainCounts:
    """Acceptance statistics of one batch, summed over rows; add them up across batches and processes.

    Per step j: ``counted`` rows (supervised, in-vocabulary or not), ``correct`` (the drafter's draft token is the
    target's greedy token, as serving scores it; an out-of-vocabulary teacher token is never correct), ``reach`` (rows whose steps 0..j-1 were all correct
    with the data continuing along the teacher's argmax, and step j is counted) and ``hits`` (reach and correct).
    """

    counted: torch.Tensor  # [K]
    correct: torch.Tensor  # [K]
    reach: torch.Tensor  # [K]
    hits: torch.Tensor  # [K]
    # the same two counts over the rows a served greedy chain of length K starts from (see served_chains)
    served_reach: torch.Tensor | None = None  # [K]
    served_hits: torch.Tensor | None = None  # [K]

    def tensors(self) -> list[torch.Tensor]:
        """All six counts in a fixed order (missing served counts as zeros), for summing across processes."""
        zeros = torch.zeros_like(self.counted)
        served = [x if x is not None else zeros for x in (self.served_reach, self.served_hits)]
        return [self.counted, self.correct, self.reach, self.hits, *served]


def served_chains(
    counted: list[torch.Tensor], hits: list[torch.Tensor], faithful: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk each row the way greedy chain decoding with K = ``len(counted)`` drafts does, and count per depth.

    A chain starts at the first scored row; when steps ``0..a-1`` hit (and the data continued along the target's
    argmax, so the next step's inputs are what serving feeds), the target emits ``a`` drafts and one token of its
    own, and the next chain starts ``a + 1`` rows later (at the next scored row, past an unscored gap such as a
    user turn). Served chains start right after a miss far more often than a random row does, and a token the
    drafter missed is followed by harder ones, so these counts track served acceptance where the per-row
    :class:`ChainCounts` overstate it (BENCH.md, "Where served chains start").

    counted, hits, faithful: K tensors [B, T] bool (row scored at step j; scored and correct; data token of step
    j is the target's argmax). Returns ``(reach, hits)`` [K]: chains that tried depth j, and that hit it.
    """
    k = len(counted)
    reach_n, hit_n = [0] * k, [0] * k
    cnt = torch.stack(counted).cpu()  # [K, B, T]
    hit = torch.stack(hits).cpu()
    good = hit & torch.stack(faithful).cpu()  # a hit the next step may build on
    for b in range(cnt.shape[1]):
        rows = cnt[0, b].nonzero().flatten().tolist()
        if not rows:
            continue
        c, g, h = cnt[:, b].tolist(), good[:, b].tolist(), hit[:, b].tolist()
        i, t = 0, rows[0]
        last = rows[-1]
        while t <= last:
            if not c[0][t]:  # past the end of the scored span: the next one (a new turn or sample)
                while i < len(rows) and rows[i] < t:
                    i += 1
                if i == len(rows):
                    break
                t = rows[i]
            a = 0
            while a < k and c[a][t]:
                reach_n[a] += 1
                if not h[a][t]:
                    break
                hit_n[a] += 1
                a += 1
                if a < k and not g[a - 1][t]:
                    break  # the data left the argmax path: what serving would draft next is unknown
            t += a + 1
    return torch.tensor(reach_n, dtype=torch.float32), torch.tensor(hit_n, dtype=torch.float32)


@dataclass
class LossOutput:
    """One micro-batch's loss and statistics (sums, so they add across micro-batches and processes)."""

    loss: torch.Tensor  # scalar: sum_j w_j CE_sum_j / normalizer (what backward runs on)
    ce_sum: torch.Tensor  # [K] detached, over in-vocabulary loss rows: the objective's sum (soft CE for fkl)
    count: torch.Tensor  # [K] loss rows per step
    correct: torch.Tensor  # [K] loss rows whose draft argmax == teacher draft argmax
    chain: ChainCounts | None = None
    # scalar, detached: sum_j w_j sum_rows of the feature term (training with feature_weight > 0 only)
    feature_sum: torch.Tensor | None = None


def _step_rows(out: TTTOutput, teacher: Teacher, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``j``'s drafter row of each teacher row (``p - j - 1``, clamped to 0) and whether it trains ([N] each):
    inside the sequence, inputs inside its sample, teacher token in the draft vocabulary."""
    t_n = teacher.row_p - (j + 1)
    t_c = t_n.clamp(min=0)
    return t_c, (t_n >= 0) & out.valid[j][teacher.row_b, t_c] & teacher.in_vocab


def ttt_loss(
    drafter: Eagle3Drafter,
    out: TTTOutput,
    teacher: Teacher,
    input_ids: torch.Tensor,
    step_weights: list[float],
    normalizer: torch.Tensor | float,
    with_chain: bool = False,
    miss_weight: float = 0.0,
    loss: str = "fkl",
    loss_weight: float | None = None,
    chain_steps: int | None = None,
) -> LossOutput:
    """The weighted per-row objective ``loss`` (:data:`OBJECTIVES`; soft cross-entropy by default) of a TTT
    unroll (see the module docstring); ``with_chain`` also scores the out-of-vocabulary rows and returns the
    acceptance counts (evaluation) of chains of ``chain_steps`` drafts (default: every unrolled step; at most the
    unroll's length).

    ``miss_weight`` > 0 (training only) weighs the rows a served chain starts from more: drafter row ``t`` gets
    ``1 + miss_weight`` at every step when step 0 of row ``t - 1`` missed ``x_{t+1}``, since a greedy chain is
    rejected there and the next chain starts at row ``t`` with the target's own token. Held-out chains start
    after such misses far more often than at a random row (BENCH.md, "Where served chains start")."""
    k = len(out.hidden)
    if len(step_weights) != k:
        raise ValueError(f"{len(step_weights)} step weights for {k} TTT steps")
    if with_chain:
        return _loss_with_chain(
            drafter, out, teacher, input_ids, step_weights, normalizer, chain_steps or k, loss, loss_weight
        )
    dev = input_ids.device
    # Rows are taken in teacher order: at step j, teacher row n (position p_n) is predicted by drafter row
    # t_n = p_n - j - 1, so the teacher table is never gathered per step (it is the big [N, V_draft] tensor).
    total = torch.zeros((), dtype=torch.float32, device=dev)
    ce_sum, count, correct = [], [], []
    after_miss: torch.Tensor | None = None  # [B, T] drafter row t follows a step-0 miss of x_{t+1}
    for j in range(k):
        t_c, w = _step_rows(out, teacher, j)
        z = drafter.logits(out.hidden[j][teacher.row_b, t_c])  # [N, Vd] fp32 (rows with w = 0 cost little)
        ce, top = objective_argmax(z, teacher.probs, loss, loss_weight)
        if miss_weight > 0:
            if after_miss is None:  # step 0: teacher row at position p is drafter row p - 1's target
                miss = w & ~((top == teacher.draft_argmax) & teacher.argmax_in_draft)
                after_miss = torch.zeros(out.valid[0].shape, dtype=torch.bool, device=dev)
                after_miss[teacher.row_b, teacher.row_p] = miss
            ce = ce * (1.0 + miss_weight * after_miss[teacher.row_b, t_c].float())
        s = (ce * w).sum()
        total = total + step_weights[j] * s
        ce_sum.append(s.detach())
        count.append(w.sum())
        correct.append(((top == teacher.draft_argmax) & w & teacher.argmax_in_draft).sum())
    return LossOutput(
        loss=total / normalizer,
        ce_sum=torch.stack(ce_sum).float(),
        count=torch.stack(count).float(),
        correct=torch.stack(correct).float(),
    )


def _loss_with_chain(
    drafter, out, teacher, input_ids, step_weights, normalizer, chain_steps, loss="fkl", loss_weight=None
) -> LossOutput:
    """Evaluation: every supervised row is scored (out-of-vocabulary teacher tokens as misses), per row; the
    acceptance counts cover the first ``chain_steps`` steps (the chain length simulated).

    A hit is scored as serving scores it: the drafter's draft token (the argmax of its draft logits, as the
    proposer takes it) mapped to its target id equals the target's greedy token (its full-vocabulary argmax,
    ties to the lowest id). Comparing the draft index with the argmax of the teacher's draft-vocabulary
    probabilities instead broke ties in draft-index order, which differs from target-id order under a draft
    vocabulary not sorted by id (an imported one) and where rounding ties two probabilities."""
    b, t = input_ids.shape
    k = len(out.hidden)
    if not 1 <= chain_steps <= k:
        raise ValueError(f"chains of {chain_steps} drafts from an unroll of {k} steps")
    dev = input_ids.device
    draft_to_target = drafter.draft_to_target.to(dev)  # [Vd]
    # teacher row of position t + j + 1, for every j at once: index padded on the right
    index = torch.cat([teacher.index, teacher.index.new_full((b, k + 1), -1)], dim=1)  # [B, T + K + 1]
    ids_ext = torch.cat([input_ids, input_ids.new_zeros(b, k + 2)], dim=1)  # [B, T + K + 2]
    total = torch.zeros((), dtype=torch.float32, device=dev)
    ce_sum, count, correct = [], [], []
    counted_rows, correct_rows, faithful_rows = [], [], []
    for j in range(k):
        tix = index[:, j + 1 : j + 1 + t]  # [B, T]
        rows = out.valid[j] & (tix >= 0)
        h = out.hidden[j][rows]  # [M, H]
        z = drafter.logits(h)  # [M, Vd] fp32
        trow = tix[rows]  # [M]
        ok = teacher.in_vocab[trow]
        ce, top = objective_argmax(z, teacher.probs[trow], loss, loss_weight)
        # a hit needs the target's own argmax to be a draft token: with oov_rule=label a row can carry loss
        # (its data token is a draft token) while the argmax is not, and the served draft is then always rejected
        hit = (draft_to_target[top] == teacher.target_argmax[trow]) & ok & teacher.argmax_in_draft[trow]
        s = (ce * ok).sum()
        total = total + step_weights[j] * s
        ce_sum.append(s.detach())
        count.append(ok.sum())
        correct.append(hit.sum())
        hit_rows = torch.zeros(b, t, dtype=torch.bool, device=dev)
        hit_rows[rows] = hit
        follows = torch.zeros(b, t, dtype=torch.bool, device=dev)
        follows[rows] = ids_ext[:, j + 2 : j + 2 + t][rows] == teacher.target_argmax[trow]
        counted_rows.append(rows)
        correct_rows.append(hit_rows)
        faithful_rows.append(follows)
    return LossOutput(
        loss=total / normalizer,
        ce_sum=torch.stack(ce_sum).float(),
        count=torch.stack(count).float(),
        correct=torch.stack(correct).float(),
        chain=chain_counts(
            counted_rows[:chain_steps], correct_rows[:chain_steps], faithful_rows[:chain_steps]
        ),
    )


def chain_counts(
    counted_rows: list[torch.Tensor], correct_rows: list[torch.Tensor], faithful_rows: list[torch.Tensor]
) -> ChainCounts:
    """:class:`ChainCounts` of chains of ``len(counted_rows)`` drafts from per-row, per-depth booleans ([B, T]
    each: row scored at depth j; scored and a hit; the data's token at depth j is the target's argmax), rows
    ordered so that a chain accepting ``a`` drafts at row t is followed by one at row ``t + a + 1``."""
    alive = torch.ones_like(counted_rows[0])
    reach, hits, counted, correct_all = [], [], [], []
    for c, h, f in zip(counted_rows, correct_rows, faithful_rows):
        r = alive & c
        reach.append(r.sum())
        hits.append((r & h).sum())
        counted.append(c.sum())
        correct_all.append(h.sum())
        alive = r & h & f
    served_reach, served_hits = served_chains(counted_rows, correct_rows, faithful_rows)
    dev = counted_rows[0].device
    return ChainCounts(
        *(torch.stack(x).float() for x in (counted, correct_all, reach, hits)),
        served_reach=served_reach.to(dev),
        served_hits=served_hits.to(dev),
    )


def feature_loss(out: TTTOutput, teacher: Teacher, step_weights: list[float]) -> torch.Tensor:
    """``sum_j w_j sum_rows`` of the feature term (see :class:`DistillationModel`), over the loss rows of
    :func:`ttt_loss`: step ``j``'s output at row ``t``, RMS-normalised, against the fused features of position
    ``p = t + j + 1`` (``out.fused``, detached), RMS-normalised; smooth-L1 averaged over the width."""
    if out.fused is None:
        raise ValueError("the feature term needs the unroll's fused inputs (TTTOutput.fused)")
    width = (out.fused.shape[-1],)
    target = F.rms_norm(out.fused.detach()[teacher.row_b, teacher.row_p].float(), width)  # [N, H]
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    for j, weight in enumerate(step_weights):
        t_c, w = _step_rows(out, teacher, j)  # the rows ttt_loss trains
        pred = F.rms_norm(out.hidden[j][teacher.row_b, t_c].float(), width)
        per_row = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)
        total = total + weight * (per_row * w).sum()
    return total


class DistillationModel(nn.Module):
    """The drafter plus its loss, as one module: what accelerate / DeepSpeed wrap (ZeRO-3 gathers parameters
    in module hooks, so every parameter use happens inside this forward).

    ``bf16_head`` runs only the drafter's ``lm_head`` under bf16 autocast (the TTT layer stays in the ambient
    precision): on CPUs with bf16 units that matmul dominates the step and runs ~4x faster in bf16. Without it the
    head runs in the ambient precision, bf16 under ``train.precision=bf16``.

    ``feature_weight`` > 0 adds a feature term to the training loss (not to evaluation's): each step's output at
    row ``t`` is fed to the next step as the hidden of position ``t + j + 1``, where a context row carries
    ``fc(aux)``; the term pulls the one towards the other (both RMS-normalised, the target side detached), a
    dense signal per token beside the distribution's, in the spirit of EAGLE-1's feature regression.

    ``loss`` picks the per-row objective of training and evaluation (:data:`OBJECTIVES`, ``train.loss``);
    ``loss_weight`` is ``lk_hybrid``'s KL weight (``train.loss_weight``).
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        step_weights: list[float],
        bf16_head: bool = False,
        feature_weight: float = 0.0,
        miss_weight: float = 0.0,
        loss: str = "fkl",
        loss_weight: float | None = None,
    ):
        super().__init__()
        if loss not in OBJECTIVES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {LOSSES}")
        self.drafter = drafter
        self.step_weights = list(step_weights)
        self.bf16_head = bf16_head
        self.feature_weight = float(feature_weight)
        self.miss_weight = float(miss_weight)
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
    ) -> LossOutput:
        """``with_chain`` (evaluation): also the acceptance counts of chains of ``chain_steps`` drafts (default:
        the training unroll's length). The unroll then runs ``max(chain_steps, TTT steps)`` steps; the steps past
        the training unroll weigh 0 in the loss, so the loss stays the training objective."""
        weights = self.step_weights
        if with_chain and chain_steps is not None and chain_steps > len(weights):
            weights = weights + [0.0] * (chain_steps - len(weights))
        out = self.drafter.forward_ttt(
            input_ids, aux, steps=len(weights), position_ids=position_ids, segment_ids=segment_ids
        )
        # bf16_head opens an autocast of its own; otherwise the head runs in the ambient precision (under
        # train.precision=bf16, accelerate's autocast: an enabled=False context here would turn it off)
        head_ctx = (
            torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if self.bf16_head else nullcontext()
        )
        with head_ctx:
            res = ttt_loss(
                self.drafter,
                out,
                teacher,
                input_ids,
                weights,
                normalizer,
                with_chain,
                miss_weight=0.0 if with_chain else self.miss_weight,
                loss=self.loss,
                loss_weight=self.loss_weight,
                chain_steps=chain_steps,
            )
        if self.feature_weight > 0 and not with_chain:
            feat = feature_loss(out, teacher, self.step_weights)
            res.loss = res.loss + self.feature_weight * feat / normalizer
            res.feature_sum = feat.detach()
        return res
