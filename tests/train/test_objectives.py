"""The distillation objectives (``train.loss``): each one's value against its textbook formula, its gradient against
the analytic gradient and finite differences, each on the hidden and the top-k teachers through the TTT loss, and
the choice reaching a training step."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.data.types import Batch
from eyas.train.config import TrainConfig
from eyas.train.losses import (
    LK_ETA,
    LOSSES,
    OBJECTIVES,
    P_FLOOR,
    DistillationModel,
    VocabMaps,
    build_teacher,
    objective_argmax,
)

from .test_losses import DRAFT, K, V, _drafter, _loss_rows, _packed_batch

CASES = [(name, None) for name in LOSSES] + [("lk_hybrid", 0.3)]


def _teacher_rows(seed: int = 0) -> torch.Tensor:
    """[6, 9] fp64 teacher rows: three full softmaxes and three top-k-like rows, zero outside 2-4 tokens."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(6, 9, generator=g, dtype=torch.float64) * 2, -1)
    for r, keep in ((3, [0, 4]), (4, [1, 2, 7]), (5, [3, 5, 6, 8])):
        mask = torch.zeros(9, dtype=torch.bool)
        mask[keep] = True
        p[r] = torch.where(mask, p[r], 0.0)
        p[r] /= p[r].sum()
    return p


def _reference(name: str, weight: float | None, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Each objective written from its definition, independently of train/losses.py (TV as half the L1 distance)."""
    q = torch.softmax(z, -1)
    lq = torch.log(q)
    tv = 0.5 * (p - q).abs().sum(-1)
    kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-300)) - lq), 0.0).sum(-1)
    if name == "fkl":
        return -(p * lq).sum(-1)
    if name == "rkl":
        return (q * (lq - torch.log(torch.maximum(p, torch.full_like(p, P_FLOOR))))).sum(-1)
    if name == "jsd":
        m = (p + q) / 2
        kl_pm = torch.where(p > 0, p * torch.log(p.clamp_min(1e-300) / m), 0.0).sum(-1)
        return 0.5 * kl_pm + 0.5 * (q * torch.log(q / m)).sum(-1)
    if name == "tv":
        return tv
    if name == "lk":
        return -torch.log(1.0 - tv)
    # the adaptive weight holds alpha fixed (sg[alpha])
    lam = torch.exp(-LK_ETA * (1.0 - tv).detach()) if weight is None else torch.full_like(tv, weight)
    return lam * kl + (1.0 - lam) * tv


def _analytic_grad(name: str, weight: float | None, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """d loss / d z by hand: for a loss f(q), dz = q * (g - <q, g>) with g = df/dq (softmax's Jacobian)."""
    q = torch.softmax(z, -1)
    alpha = torch.minimum(p, q).sum(-1, keepdim=True)

    def through_softmax(g):
        return q * (g - (q * g).sum(-1, keepdim=True))

    tv_grad = through_softmax(-(q < p).double())  # d(1 - sum min(p, q)) / dq = -[q < p]
    if name == "fkl":
        return q - p
    if name == "rkl":
        return through_softmax(torch.log(q) - torch.log(p.clamp_min(P_FLOOR)) + 1.0)
    if name == "jsd":
        return through_softmax(0.5 * torch.log(2 * q / (p + q)))
    if name == "tv":
        return tv_grad
    if name == "lk":
        return tv_grad / alpha
    lam = torch.exp(-LK_ETA * alpha) if weight is None else weight  # alpha is held constant in the weight
    return lam * (q - p) + (1.0 - lam) * tv_grad


@pytest.mark.parametrize(("name", "weight"), CASES)
def test_each_objective_is_its_formula_with_its_analytic_gradient(name, weight):
    p = _teacher_rows()
    z = (
        torch.randn(6, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5
    ).requires_grad_()
    w = torch.arange(1.0, 7.0, dtype=torch.float64)  # distinct row weights: a row mix-up shows
    loss = OBJECTIVES[name](z, p, weight)
    torch.testing.assert_close(loss, _reference(name, weight, z.detach(), p), rtol=1e-10, atol=1e-12)
    assert bool(torch.isfinite(loss).all()) and loss.shape == (6,)
    (loss * w).sum().backward()
    torch.testing.assert_close(
        z.grad, w[:, None] * _analytic_grad(name, weight, z.detach(), p), rtol=1e-9, atol=1e-12
    )


def _central_differences(fn, z: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """d fn(z) / d z, one entry at a time (fn: [M, V] -> scalar)."""
    grad = torch.zeros_like(z)
    for i in range(z.numel()):
        step = torch.zeros_like(z).view(-1)
        step[i] = eps
        step = step.view_as(z)
        grad.view(-1)[i] = (fn(z + step) - fn(z - step)) / (2 * eps)
    return grad


@pytest.mark.parametrize(("name", "weight"), CASES)
def test_each_objective_passes_finite_differences(name, weight):
    p = _teacher_rows(seed=2)
    z = torch.randn(6, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w = torch.arange(1.0, 7.0, dtype=torch.float64)
    # no ties between p and q here (TV's kink), so central differences stay on one branch
    assert float((torch.softmax(z, -1) - p).abs().min()) > 1e-4
    fixed = weight
    if name == "lk_hybrid" and weight is None:
        # the adaptive weight exp(-eta alpha) is detached, so its gradient is the one with each row's weight held
        # at its value; finite differences, which would move alpha inside it too, check that fixed-weight loss
        fixed = torch.exp(-LK_ETA * torch.minimum(p, torch.softmax(z, -1)).sum(-1))
    zg = z.clone().requires_grad_()
    (OBJECTIVES[name](zg, p, weight) * w).sum().backward()
    numeric = _central_differences(lambda x: (OBJECTIVES[name](x, p, fixed) * w).sum(), z)
    torch.testing.assert_close(zg.grad, numeric, rtol=1e-6, atol=1e-8)


def test_objective_argmax_keeps_the_soft_cross_entropy_path_and_refuses_unknown_names():
    z = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))
    p = _teacher_rows()[:4].float()
    for name in LOSSES:
        loss, top = objective_argmax(z, p, name)
        assert top.tolist() == z.argmax(-1).tolist() and loss.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        objective_argmax(z, p, "kl")
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        DistillationModel(_drafter(), [1.0], loss="kl")


def _topk_batch(batch: Batch, head, k: int = 6) -> Batch:
    """The same batch with the target's distribution stored as its top-k log-probabilities (no hidden states)."""
    lp = torch.log_softmax(head(batch.target_hidden.reshape(-1, batch.target_hidden.shape[-1])), -1)
    top_lp, top_ids = lp.topk(k, -1)
    shape = (*batch.input_ids.shape, k)
    return Batch(
        input_ids=batch.input_ids,
        loss_mask=batch.loss_mask,
        position_ids=batch.position_ids,
        segment_ids=batch.segment_ids,
        aux=batch.aux,
        topk_logprobs=top_lp.reshape(shape),
        topk_ids=top_ids.reshape(shape),
        sample_ids=batch.sample_ids,
    )


@pytest.mark.parametrize("form", ["hidden", "topk"])
@pytest.mark.parametrize(("name", "weight"), CASES)
def test_the_ttt_loss_applies_the_objective_on_both_teachers(form, name, weight):
    """DistillationModel(loss=name) equals the objective's formula summed row by row over the TTT rows (step j,
    row t against the teacher at t + j + 1), weights and gradients included, for hidden and top-k teachers."""
    batch, head = _packed_batch()
    if form == "topk":
        batch = _topk_batch(batch, head)
    weights = [0.8**j for j in range(K)]
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    kw = dict(form=form, oov_rule="teacher", head=head if form == "hidden" else None)
    teacher = build_teacher(batch, maps, keep_oov=False, **kw)
    full = build_teacher(batch, maps, **kw)  # every supervised position: normalizer and per-row lookup
    drafter = _drafter()
    model = DistillationModel(drafter, weights, loss=name, loss_weight=weight)
    args = (batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids)
    out = model(*args, teacher, float(full.num_positions))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    drafter.zero_grad()

    ttt = drafter.forward_ttt(*args[:1], batch.aux, K, batch.position_ids, batch.segment_ids)
    total, rows = torch.zeros((), dtype=torch.float64), 0
    for b, t, j, p, _q in _loss_rows(batch, K):
        n = int(full.index[b, p])
        if not full.in_vocab[n]:
            continue
        z = drafter.logits(ttt.hidden[j][b, t][None]).double()
        total = total + weights[j] * _reference(name, weight, z, full.probs[n][None].double())[0]
        rows += 1
    ref = total / full.num_positions
    assert rows > 10 and int(out.count.sum()) == rows
    if form == "topk":
        assert int((full.probs[full.in_vocab] == 0).sum()) > 0  # the top-k teacher's zeros are exercised
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    ref.backward()
    for n, p in drafter.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():  # evaluation reports the same objective
        ev = model(*args, full, float(full.num_positions), with_chain=True)
    torch.testing.assert_close(ev.ce_sum.sum(), out.ce_sum.sum(), rtol=1e-5, atol=1e-6)


def test_train_loss_is_validated_in_one_line_and_keeps_old_identities():
    with pytest.raises(ValueError) as e:
        TrainConfig(loss="kl")
    assert str(e.value) == f"train.loss must be one of {LOSSES}, not 'kl'"
    with pytest.raises(ValueError, match="train.loss_weight weighs lk_hybrid"):
        TrainConfig(loss="tv", loss_weight=0.5)
    with pytest.raises(ValueError, match=r"train.loss_weight must be in \[0, 1\]"):
        TrainConfig(loss="lk_hybrid", loss_weight=1.5)
    default = TrainConfig().identity()
    assert "loss" not in default and "loss_weight" not in default  # runs from before the option resume
    assert TrainConfig(loss="lk_hybrid", loss_weight=0.25).identity()["loss_weight"] == 0.25
    assert TrainConfig(loss="jsd").identity()["loss"] == "jsd"


def test_the_choice_reaches_a_training_step(tmp_path):
    """One optimizer step of the trainer from the same drafter and batch: each loss moves the weights its own way,
    and the same loss twice moves them identically (so the difference is the loss's)."""
    from eyas.train.checkpoint import load_weights

    from .test_trainer import fit_on_train, tiny_cfg, tiny_setup

    target, drafter0, data = tiny_setup(num_samples=2, seq_len=16, draft_vocab=64)
    state = {k: v.clone() for k, v in drafter0.state_dict().items()}
    after = {}
    for name in (*LOSSES, "fkl"):
        drafter0.load_state_dict(state)
        cfg = tiny_cfg(tmp_path / f"{name}{len(after)}", max_steps=1, save_every=0, loss=name, ttt_steps=2)
        res = fit_on_train(cfg, target, drafter0, data)
        w = load_weights(res.last_checkpoint)
        after[name if name not in after else "fkl again"] = torch.cat(
            [w[k].flatten().float() for k in sorted(w)]
        )
    assert torch.equal(after["fkl"], after["fkl again"])
    names = list(LOSSES)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.allclose(after[a], after[b], rtol=0, atol=1e-7), (a, b)
    assert math.isfinite(float(after["lk"].abs().sum()))
