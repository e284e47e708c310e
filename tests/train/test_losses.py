"""Distillation loss: soft CE, teachers from hidden states and top-k, the TTT loss and acceptance counts against
direct per-row computations of the spec, and the simulated-acceptance formulas."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.data.types import Batch
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.target import TargetHead
from eyas.train.config import TrainConfig
from eyas.train.losses import (
    ChainCounts,
    DistillationModel,
    VocabMaps,
    build_teacher,
    draft_head,
    served_chains,
    soft_cross_entropy,
)
from eyas.train.metrics import simulated_acceptance

V, H, K = 40, 16, 3
DRAFT = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 23, 29, 31, 37])  # 14 of 40 target ids


def test_soft_cross_entropy_equals_direct_computation_and_gradient():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 7, generator=g, dtype=torch.float64).float().requires_grad_()
    p = torch.softmax(torch.randn(5, 7, generator=g) * 3, -1)
    p[0] = torch.tensor([0, 0, 1.0, 0, 0, 0, 0])  # a one-hot teacher: CE = -log q_2
    ce = soft_cross_entropy(z, p)
    z2 = z.detach().clone().requires_grad_()
    ref = -(p * torch.log_softmax(z2, -1)).sum(-1)
    torch.testing.assert_close(ce, ref, rtol=1e-6, atol=1e-6)
    assert ce[0].item() == pytest.approx(-torch.log_softmax(z.detach()[0], -1)[2].item(), rel=1e-6)
    w = torch.arange(1.0, 6.0)
    (ce * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad, rtol=1e-5, atol=1e-6)


def _packed_batch(seed: int = 0) -> tuple[Batch, TargetHead]:
    """Two rows: row 0 packs samples of 7 and 5 tokens then 2 pads; row 1 one sample of 11 tokens, 3 pads."""
    g = torch.Generator().manual_seed(seed)
    t = 14
    seg = torch.zeros(2, t, dtype=torch.long)
    seg[0, :7], seg[0, 7:12], seg[1, :11] = 1, 2, 1
    pos = torch.zeros(2, t, dtype=torch.long)
    pos[0, :7], pos[0, 7:12], pos[1, :11] = torch.arange(7), torch.arange(5), torch.arange(11)
    loss = (torch.rand(2, t, generator=g) < 0.75) & (seg > 0)
    ids = torch.randint(0, V, (2, t), generator=g) * (seg > 0)
    head = TargetHead(torch.randn(V, H, generator=g) * 2.0)
    batch = Batch(
        input_ids=ids,
        loss_mask=loss,
        position_ids=pos,
        segment_ids=seg,
        aux=torch.randn(2, t, 3 * H, generator=g),
        target_hidden=torch.randn(2, t, H, generator=g),
        sample_ids=[["a", "b"], ["c"]],
    )
    return batch, head


def _drafter(seed: int = 0) -> Eagle3Drafter:
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=V,
        draft_vocab_size=len(DRAFT),
        aux_layer_ids=[0, 1, 2],
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    d.set_embedding(torch.randn(V, H))
    d.set_vocab_map(DRAFT)
    return d


def _loss_rows(batch, k):
    """(b, t, j, p, q) of every TTT row that carries loss: step j, row t predicts x_q (q = t + j + 2) from the
    teacher at p = t + j + 1, inside row t's sample, where x_q is a loss token."""
    b_, t_ = batch.input_ids.shape
    seg, lm = batch.segment_ids, batch.loss_mask
    for b in range(b_):
        for t in range(t_):
            for j in range(k):
                p, q = t + j + 1, t + j + 2
                if q < t_ and seg[b, t] != 0 and seg[b, q] == seg[b, t] and lm[b, q]:
                    yield b, t, j, p, q


def _direct_loss(drafter, out, batch, head, weights, oov_rule="teacher"):
    """The spec, one row at a time: TTT step j, row t predicts x_{t+j+2} from the teacher at t+j+1."""
    b_, t_ = batch.input_ids.shape
    seg, lm = batch.segment_ids, batch.loss_mask
    in_draft = set(DRAFT.tolist())
    total = torch.zeros(())
    rows = dropped = 0
    per_row: dict[tuple[int, int, int], tuple[bool, bool]] = {}  # (b, t, j) -> (correct, data follows argmax)
    for b, t, j, p, q in _loss_rows(batch, len(weights)):
        full = head(batch.target_hidden[b, p][None])[0]  # [V]
        top = int(full.argmax())
        oov = (top not in in_draft) if oov_rule == "teacher" else (int(batch.input_ids[b, q]) not in in_draft)
        z = drafter.logits(out.hidden[j][b, t][None])[0]
        probs = torch.softmax(full[DRAFT], -1)
        correct = (not oov) and int(z.argmax()) == int(probs.argmax())
        per_row[(b, t, j)] = (correct, int(batch.input_ids[b, q]) == top)
        if oov:
            dropped += 1
            continue
        total = total + weights[j] * -(probs * torch.log_softmax(z, -1)).sum()
        rows += 1
    n_sup = sum(
        1
        for b in range(b_)
        for p in range(t_ - 1)
        if lm[b, p + 1] and seg[b, p] > 0 and seg[b, p + 1] == seg[b, p]
    )
    return total / n_sup, rows, dropped, per_row


@pytest.mark.parametrize(
    ("oov_rule", "keep_oov", "with_chain"),
    [("teacher", False, False), ("teacher", True, False), ("label", False, False), ("teacher", True, True)],
)
def test_ttt_loss_equals_direct_per_row_computation(oov_rule, keep_oov, with_chain):
    """Training (teacher order, OOV rows dropped from the table or weighted 0) and evaluation (per-row) paths."""
    batch, head = _packed_batch()
    weights = [0.8**j for j in range(K)]
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(
        batch,
        maps,
        form="hidden",
        oov_rule=oov_rule,
        head=head,
        draft_rows_head=TargetHead(head.weight[DRAFT]),
        keep_oov=keep_oov,
    )
    drafter = _drafter()
    model = DistillationModel(drafter, weights)
    normalizer = float(build_teacher(batch, maps, head=head).num_positions)  # all supervised positions
    out = model(
        batch.input_ids,
        batch.aux,
        batch.position_ids,
        batch.segment_ids,
        teacher,
        normalizer,
        with_chain=with_chain,
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    drafter.zero_grad()
    ttt = drafter.forward_ttt(batch.input_ids, batch.aux, K, batch.position_ids, batch.segment_ids)
    ref, rows, dropped, _ = _direct_loss(drafter, ttt, batch, head, weights, oov_rule)
    assert rows > 10 and dropped > 0  # both kinds of rows occur
    assert int(out.count.sum()) == rows
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    ref.backward()
    for n, p in drafter.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_chain_counts_equal_direct_per_row_computation():
    batch, head = _packed_batch(seed=3)
    # a teacher whose argmax is target id 0 (= draft id 0) at most positions, a drafter that always says draft
    # id 0 (zero lm_head: argmax of equal logits is the first), and data that follows the teacher's argmax half
    # of the time: chains survive past step 0 and every case of the counting occurs
    bias = torch.zeros(V)
    bias[0] = 12.0
    head = TargetHead(head.weight, bias)
    full = head(batch.target_hidden)  # [B, T, V]
    follow = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    nxt = full.argmax(-1)
    ids = batch.input_ids.clone()
    ids[:, 1:] = torch.where(follow[:, 1:], nxt[:, :-1], ids[:, 1:])
    batch.input_ids = ids * (batch.segment_ids > 0)
    weights = [1.0] * K
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(batch, maps, form="hidden", oov_rule="teacher", head=head)
    drafter = _drafter(seed=1)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    model = DistillationModel(drafter, weights)
    with torch.no_grad():
        out = model(
            batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, 1.0, with_chain=True
        )
        ttt = drafter.forward_ttt(batch.input_ids, batch.aux, K, batch.position_ids, batch.segment_ids)
        _, _, _, per_row = _direct_loss(drafter, ttt, batch, head, weights)
    counted, correct, reach, hits = ([0] * K for _ in range(4))
    for b in range(2):
        for t in range(batch.input_ids.shape[1]):
            alive = True
            for j in range(K):
                if (b, t, j) not in per_row:
                    alive = False
                    continue
                ok, follows = per_row[(b, t, j)]
                counted[j] += 1
                correct[j] += ok
                if alive:
                    reach[j] += 1
                    hits[j] += ok
                alive = alive and ok and follows
    got = out.chain
    assert got.counted.tolist() == counted and got.correct.tolist() == correct
    assert got.reach.tolist() == reach and got.hits.tolist() == hits
    assert hits[1] > 0 and reach[1] < counted[1] and hits[0] < reach[0]  # every case of the chain occurs
    # served chains: walk each row as greedy chain decoding does (a chain of a hits is followed by one at t + a + 1)
    s_reach, s_hits = [0] * K, [0] * K
    for b in range(2):
        scored = sorted(t for (bb, t, j) in per_row if bb == b and j == 0)
        t = scored[0]
        while t <= scored[-1]:
            t = min(r for r in scored if r >= t)
            a = 0
            while a < K and (b, t, a) in per_row:
                ok, follows = per_row[(b, t, a)]
                s_reach[a] += 1
                if not ok:
                    break
                s_hits[a] += 1
                a += 1
                if not follows:
                    break
            t += a + 1
    assert got.served_reach.tolist() == s_reach and got.served_hits.tolist() == s_hits
    assert s_hits[1] > 0 and s_reach[0] < reach[0]  # chains go past step 0, and fewer start than rows


def _rows(*bits: str) -> list[torch.Tensor]:
    return [torch.tensor([[c == "1" for c in b]]) for b in bits]


def test_served_chains_follow_the_decoding_schedule():
    """K = 2 by hand: scored rows 0, 1, 4, 5 (2-3 an unscored gap, e.g. a user turn)."""
    counted = _rows("1100110", "1100100")
    hits = _rows("0100110", "0100000")
    # row 0 misses: the next chain starts at row 1, hits twice, then row 3 is unscored so row 4 starts one that
    # hits once; the next would start at row 6, past the scored span
    reach, hit = served_chains(counted, hits, _rows("1111111", "1111111"))
    assert reach.tolist() == [3, 2] and hit.tolist() == [2, 1]
    # the data leaves the argmax path after row 1's first hit: that chain stops there
    reach, hit = served_chains(counted, hits, _rows("1011111", "1111111"))
    assert reach.tolist() == [3, 1] and hit.tolist() == [2, 0]


def test_topk_teacher_renormalises_inside_the_draft_vocabulary():
    v, draft = 10, torch.tensor([1, 3, 5, 7])
    maps = VocabMaps.from_draft_ids(draft, v)
    # three positions whose next token is a loss token: p = 0, 1, 2 (token 3 is not a loss token)
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.3, 0.05], [0.7, 0.2, 0.1]]))
    tk = torch.tensor([[3, 2, 7], [2, 5, 1], [4, 6, 8]])
    batch = Batch(
        input_ids=torch.tensor([[0, 5, 2, 9]]),
        loss_mask=torch.tensor([[False, True, True, True]]),
        position_ids=torch.arange(4)[None],
        segment_ids=torch.ones(1, 4, dtype=torch.long),
        aux=torch.zeros(1, 4, 6),
        topk_logprobs=torch.cat([lp, torch.zeros(1, 3)])[None],
        topk_ids=torch.cat([tk, torch.zeros(1, 3, dtype=torch.long)])[None],
    )
    t = build_teacher(batch, maps, form="topk", oov_rule="teacher")
    assert t.index.tolist() == [[0, 1, 2, -1]]
    expected = torch.zeros(3, 4)
    expected[0, 1], expected[0, 3] = 0.5 / 0.6, 0.1 / 0.6  # ids 3 and 7 are draft tokens 1 and 3
    expected[1, 2], expected[1, 0] = 0.3 / 0.35, 0.05 / 0.35  # ids 5 and 1
    torch.testing.assert_close(t.probs[:2], expected[:2])
    assert t.target_argmax.tolist() == [3, 2, 4]
    assert t.in_vocab.tolist() == [True, False, False]  # argmax 2 and 4 are outside; row 2 has no mass at all
    lab = build_teacher(batch, maps, form="topk", oov_rule="label")  # labels 5, 2, 9
    assert lab.in_vocab.tolist() == [True, False, False]
    sharp = build_teacher(
        batch, maps, form="topk", oov_rule="teacher", temperature=0.5
    )  # p ** 2, renormalised
    expected[0, 1], expected[0, 3] = 0.25 / 0.26, 0.01 / 0.26
    torch.testing.assert_close(sharp.probs[0], expected[0])
    assert sharp.target_argmax.tolist() == t.target_argmax.tolist()
    assert sharp.in_vocab.tolist() == t.in_vocab.tolist()


def test_simulated_acceptance_formulas():
    chain = ChainCounts(
        counted=torch.tensor([10.0, 10.0]),
        correct=torch.tensor([5.0, 5.0]),
        reach=torch.tensor([10.0, 5.0]),
        hits=torch.tensor([5.0, 4.0]),
    )
    est = simulated_acceptance(chain)
    assert est.served_cond_acc == [] and est.tau_served == 1.0  # no served counts given
    chain.served_reach, chain.served_hits = torch.tensor([8.0, 4.0]), torch.tensor([4.0, 1.0])
    est = simulated_acceptance(chain)
    assert est.served_cond_acc == [0.5, 0.25] and est.tau_served == pytest.approx(1 + 0.5 + 0.5 * 0.25)
    assert est.acc == [0.5, 0.5] and est.cond_acc == [0.5, 0.8]
    assert est.tau_indep == pytest.approx(1 + 0.5 + 0.5 * 0.5)
    assert est.tau_chain == pytest.approx(1 + 0.5 + 0.5 * 0.8)
    empty = simulated_acceptance(ChainCounts(*(torch.zeros(2) for _ in range(4))))
    assert empty.tau_chain == 1.0 and not math.isnan(empty.tau_indep)


def test_bf16_head_keeps_the_loss_close_to_fp32():
    """Only lm_head runs in bf16: same loss to bf16 rounding, finite gradients everywhere."""
    batch, head = _packed_batch(seed=5)
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(batch, maps, head=head, keep_oov=False)
    losses = []
    for bf16 in (False, True):
        drafter = _drafter()
        out = DistillationModel(drafter, [1.0] * K, bf16_head=bf16)(
            batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, 10.0
        )
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.requires_grad)
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2) and losses[1] != losses[0]


@pytest.mark.parametrize(
    ("ambient", "bf16_head", "want"),
    [(False, False, torch.float32), (False, True, torch.bfloat16), (True, False, torch.bfloat16)],
)
def test_lm_head_runs_in_the_ambient_autocast_unless_bf16_head_opens_its_own(ambient, bf16_head, want):
    """Under train.precision=bf16 (accelerate's autocast around the model) the drafter's lm_head matmul runs in
    bf16 like the layer's; the loss once closed the autocast around it and left it in fp32."""
    batch, head = _packed_batch(seed=2)
    teacher = build_teacher(batch, VocabMaps.from_draft_ids(DRAFT, V), head=head, keep_oov=False)
    drafter = _drafter()
    seen: list[torch.dtype] = []
    drafter.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    model = DistillationModel(drafter, [1.0] * K, bf16_head=bf16_head)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
        out = model(batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, 10.0)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(drafter.lm_head.weight.grad).all()
    assert seen and set(seen) == {want}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "scale"), [(None, None), (None, 0.25), (30.0, None), (None, -1.0)])
def test_head_argmax_and_logits_match_the_full_fp32_logits(dtype, softcap, scale):
    """The teacher's shortcut (argmax in the head's dtype, fp32 only for the draft rows) gives exactly what the
    full fp32 logits give, ties included (a bf16 head has many)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(V, H, generator=g) * 4.0).to(dtype)
    head = TargetHead(w, softcap=softcap, scale=scale)
    hidden = torch.randn(40, H, generator=g).to(dtype)
    hidden[1] = 0.0  # every logit equal: the first index must win in both
    rows = DRAFT
    top, sub = head.argmax_and_logits(hidden, rows)
    full = head(hidden)
    assert torch.equal(top, full.argmax(-1)) and top[1] == 0
    assert sub.dtype == torch.float32 and torch.equal(sub, full[:, rows])


def test_bf16_runs_key_the_lm_head_precision():
    """The key keeps a bf16 checkpoint of the fp32-head numerics from resuming into the bf16-head ones."""
    assert TrainConfig(precision="bf16").identity()["lm_head_bf16"] is True
    assert "lm_head_bf16" not in TrainConfig(precision="fp32").identity()
    assert "lm_head_bf16" not in TrainConfig(precision="bf16", bf16_lm_head=True).identity()  # as before


@pytest.mark.parametrize("form", ["hidden", "topk"])
def test_label_rule_counts_an_out_of_vocabulary_target_argmax_as_a_miss(form):
    """oov_rule=label keeps rows whose data token is a draft token; when the target's own argmax is not a draft
    token, a served draft is always rejected, so the acceptance metrics must count the row as a miss even if the
    drafter picks the best in-draft token."""
    batch, head = _packed_batch(seed=4)
    bias = torch.zeros(V)
    bias[1], bias[0] = 12.0, 11.0  # argmax target id 1 (not a draft token), best draft token id 0
    head = TargetHead(head.weight * 0.01, bias)
    ids = batch.input_ids.clone()
    ids[batch.segment_ids > 0] = 0  # every data token is draft token 0: the label rule keeps every row
    batch.input_ids = ids
    if form == "topk":
        lp = torch.log_softmax(head(batch.target_hidden), -1)
        top = lp.topk(4, -1)
        batch.topk_logprobs, batch.topk_ids = top.values, top.indices
        batch.target_hidden = None
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(
        batch, maps, form=form, oov_rule="label", head=head, draft_rows_head=draft_head(head, maps)
    )
    assert bool(teacher.in_vocab.all()) and bool((teacher.target_argmax == 1).all())
    drafter = _drafter(seed=1)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()  # always draft id 0: the best in-draft token
    with torch.no_grad():
        out = DistillationModel(drafter, [1.0] * K)(
            batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, 1.0, with_chain=True
        )
    assert out.chain.counted.sum() > 0 and out.count.sum() > 0  # rows are counted and carry loss
    assert out.chain.hits.sum() == 0 and out.chain.correct.sum() == 0 and out.correct.sum() == 0
    assert simulated_acceptance(out.chain).tau_chain == 1.0


def test_teacher_temperature_sharpens_the_hidden_teacher_and_keeps_its_argmax():
    batch, head = _packed_batch()
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    plain = build_teacher(batch, maps, form="hidden", head=head)
    sharp = build_teacher(batch, maps, form="hidden", head=head, temperature=0.5)
    logits = head(batch.target_hidden[plain.row_b, plain.row_p])[:, DRAFT]
    torch.testing.assert_close(sharp.probs, torch.softmax(logits / 0.5, dim=-1))
    assert torch.equal(sharp.draft_argmax, plain.draft_argmax) and torch.equal(sharp.in_vocab, plain.in_vocab)
    assert (sharp.probs.max(-1).values >= plain.probs.max(-1).values - 1e-6).all()


def _direct_feature_term(drafter, out, batch, head, weights):
    """The feature term, one row at a time: step j's output at row t against fc(aux) of position t + j + 1,
    both RMS-normalised (target side detached), smooth-L1 averaged over the width, on the rows ttt_loss trains."""
    in_draft = set(DRAFT.tolist())
    fused = drafter.fuse(batch.aux).detach()
    eps = torch.finfo(torch.float32).eps
    total = torch.zeros(())
    for b, t, j, p, _ in _loss_rows(batch, len(weights)):
        if int(head(batch.target_hidden[b, p][None])[0].argmax()) not in in_draft:
            continue  # dropped from the distribution loss, so from this term too
        pred = out.hidden[j][b, t]
        pred = pred / pred.pow(2).mean().add(eps).sqrt()
        tgt = fused[b, p] / fused[b, p].pow(2).mean().add(eps).sqrt()
        d = (pred - tgt).abs()
        total = total + weights[j] * torch.where(d < 1, 0.5 * d * d, d - 0.5).mean()
    return total


def test_feature_term_equals_direct_computation_and_stays_out_of_evaluation():
    batch, head = _packed_batch(seed=5)
    weights = [0.8**j for j in range(K)]
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(batch, maps, form="hidden", oov_rule="teacher", head=head, keep_oov=False)
    normalizer = float(build_teacher(batch, maps, head=head).num_positions)
    args = (batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, normalizer)
    drafter = _drafter(seed=2)
    plain = DistillationModel(drafter, weights)(*args)
    model = DistillationModel(drafter, weights, feature_weight=0.7)
    out = model(*args)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    drafter.zero_grad()
    ttt = drafter.forward_ttt(batch.input_ids, batch.aux, K, batch.position_ids, batch.segment_ids)
    ce, _, _, _ = _direct_loss(drafter, ttt, batch, head, weights)
    feat = _direct_feature_term(drafter, ttt, batch, head, weights)
    assert float(feat.detach()) > 0
    torch.testing.assert_close(out.feature_sum, feat.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, plain.loss + 0.7 * feat / normalizer, rtol=1e-5, atol=1e-6)
    (ce + 0.7 * feat / normalizer).backward()
    for n, p in drafter.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():  # evaluation scores the distribution only
        ev = model(*args[:-2], build_teacher(batch, maps, head=head), normalizer, with_chain=True)
        ev_plain = DistillationModel(drafter, weights)(
            *args[:-2], build_teacher(batch, maps, head=head), normalizer, with_chain=True
        )
    assert ev.feature_sum is None
    torch.testing.assert_close(ev.loss, ev_plain.loss)


def test_miss_weight_weighs_the_rows_after_a_step0_miss_and_stays_out_of_evaluation():
    """Row t of every step weighs 1 + w when step 0 of row t - 1 (same sample) carried loss and missed x_{t+1}."""
    batch, head = _packed_batch(seed=7)
    w = head.weight.clone()
    w[[i for i in range(V) if i not in set(DRAFT.tolist())]] *= (
        0.2  # most teacher argmaxes in the draft vocabulary
    )
    head = TargetHead(w)
    weights = [0.8**j for j in range(K)]
    maps = VocabMaps.from_draft_ids(DRAFT, V)
    teacher = build_teacher(batch, maps, form="hidden", oov_rule="teacher", head=head, keep_oov=False)
    normalizer = float(build_teacher(batch, maps, head=head).num_positions)
    args = (batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, normalizer)
    drafter = _drafter(seed=4)
    out = DistillationModel(drafter, weights, miss_weight=1.5)(*args)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    drafter.zero_grad()
    ttt = drafter.forward_ttt(batch.input_ids, batch.aux, K, batch.position_ids, batch.segment_ids)
    in_draft = set(DRAFT.tolist())
    step0_miss: dict[tuple[int, int], bool] = {}
    total, boosted = torch.zeros(()), 0
    for b, t, j, p, _ in _loss_rows(batch, K):
        full = head(batch.target_hidden[b, p][None])[0]
        if int(full.argmax()) not in in_draft:
            continue  # dropped from the loss, and not counted as a miss
        z = drafter.logits(ttt.hidden[j][b, t][None])[0]
        probs = torch.softmax(full[DRAFT], -1)
        if j == 0:
            step0_miss[(b, t)] = int(z.argmax()) != int(probs.argmax())
        mult = 2.5 if step0_miss.get((b, t - 1), False) else 1.0
        boosted += mult > 1
        total = total + mult * weights[j] * -(probs * torch.log_softmax(z, -1)).sum()
    assert boosted > 3 and any(not m for m in step0_miss.values())  # both kinds of rows occur
    ref = total / normalizer
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    ref.backward()
    for n, p in drafter.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():  # evaluation's loss is the unweighted one
        ev_args = (*args[:-2], build_teacher(batch, maps, head=head), normalizer)
        ev = DistillationModel(drafter, weights, miss_weight=1.5)(*ev_args, with_chain=True)
        ev_plain = DistillationModel(drafter, weights)(*ev_args, with_chain=True)
    torch.testing.assert_close(ev.loss, ev_plain.loss)
    assert "miss_weight" not in TrainConfig().identity()
    assert TrainConfig(miss_weight=1.0).identity()["miss_weight"] == 1.0
    with pytest.raises(ValueError, match="miss_weight"):
        TrainConfig(miss_weight=-0.5)


def test_feature_weight_is_validated_and_off_by_default_in_the_identity():
    assert TrainConfig().feature_weight == 0.0
    assert "feature_weight" not in TrainConfig().identity()
    assert TrainConfig(feature_weight=0.5).identity()["feature_weight"] == 0.5
    with pytest.raises(ValueError, match="feature_weight"):
        TrainConfig(feature_weight=-1.0)


def test_served_chain_counts_reproduce_the_decoding_loop_on_its_own_output():
    """The trainer's served-chain walk over one teacher-forced unroll of what greedy chain decoding emitted gives
    that decoding's own accepted drafts per depth (tiny fp32 target, a drafter that gets some accepted)."""
    from eyas.lab.bench_served import decoded_chain_counts
    from eyas.serving.loop import generate
    from eyas.serving.proposers import Eagle3Proposer
    from tests.conftest import make_tiny_target
    from tests.serving.test_speculative_loop import make_drafter

    torch.set_num_threads(1)
    target = make_tiny_target("llama")
    drafter = make_drafter(target, seed=4, draft_vocab=200, copy=True)
    k = 4
    prompt = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(6))
    res = generate(target, Eagle3Proposer(drafter, chain_length=k), prompt, 48, stop_on_eos=False)
    # the sequence stops short of the last steps, whose drafts the token limit cut short
    tokens = res.tokens[:40]
    got = decoded_chain_counts(target, drafter, prompt.tolist(), tokens, k)
    p_len, t_len = prompt.numel(), prompt.numel() + len(tokens)
    # the loop's chains, each scored only as deep as the sequence reaches (step j of row t predicts x_{t+j+2})
    reach, hits, t = [0] * k, [0] * k, p_len - 1
    for s in res.steps:
        for j in range(k):
            if t + j + 2 < t_len:
                reach[j] += s.num_accepted >= j
                hits[j] += s.num_accepted >= j + 1
        t += s.num_accepted + 1
    assert sum(hits) >= 5 and hits[1] > 0  # multi-token chains occur
    assert got.served_reach.tolist() == reach and got.served_hits.tolist() == hits
    assert got.reach[0] > got.served_reach[0]  # fewer chains than scored rows
