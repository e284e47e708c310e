"""Training the DFlash block drafter: anchors where the next token is supervised, slot k trained against the
teacher at anchor + k - 1, the slot weights, and a real run through the trainer (checkpoint, resume-safe
metrics, frozen head, held-out τ_sim) whose checkpoint loads back as the same drafter."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.data.types import Batch
from eyas.serving.models.dflash import DFlashDrafter
from eyas.train.block_loss import anchor_candidates, block_loss, plan_blocks
from eyas.train.config import DraftModelConfig, TrainConfig
from eyas.train.losses import VocabMaps, build_teacher

V = 32


def _batch(t: int = 12, loss_from: int = 4, seed: int = 0) -> Batch:
    """One row of two packed samples (7 + 5 tokens) with a top-1 teacher: the distribution at p is a point mass
    on ``(3 * p) % V`` (every position its own token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, t), generator=g)
    seg = torch.tensor([[1] * 7 + [2] * (t - 7)])
    pos = torch.cat([torch.arange(7), torch.arange(t - 7)])[None]
    loss = (pos >= 2) & torch.ones(1, t, dtype=torch.bool)
    loss[0, :loss_from] = False
    top_ids = (3 * torch.arange(t) % V).view(1, t, 1)
    return Batch(
        input_ids=ids,
        loss_mask=loss,
        position_ids=pos,
        segment_ids=seg,
        aux=torch.zeros(1, t, 4),
        topk_logprobs=torch.zeros(1, t, 1),
        topk_ids=top_ids,
    )


def test_anchors_are_positions_whose_next_token_is_supervised_and_targets_follow_them():
    b = _batch()
    cand = anchor_candidates(b)[0].tolist()
    # loss tokens 4..6 and 9..11: an anchor's next token is one of them, in its own sample (6 -> 7 crosses into
    # the second sample), and the anchor is not its sample's first token (7)
    assert [i for i, c in enumerate(cand) if c] == [3, 4, 5, 8, 9, 10]
    every = plan_blocks(b, slots=3)
    assert every.anchors[0].tolist() == [3, 4, 5, 8, 9, 10]
    torch.manual_seed(0)
    some = plan_blocks(b, slots=2, num_anchors=2)
    a = sorted(some.anchors[0].tolist())
    assert len(a) == 2 and all(cand[i] for i in a)
    want = {
        p
        for x in a
        for p in (x, x + 1)
        if b.loss_mask[0, p + 1] and b.segment_ids[0, p + 1] == b.segment_ids[0, x]
    }
    assert set(some.targets[0].nonzero().flatten().tolist()) == want
    many = plan_blocks(b, slots=2, num_anchors=50)  # more than there are: every candidate once, the rest -1
    got = many.anchors[0]
    assert sorted(got[got >= 0].tolist()) == [3, 4, 5, 8, 9, 10] and (got < 0).sum() == 12 - 6


class _Stub:
    """A drafter whose slot logits are its hidden states (draft ids = target ids)."""

    draft_to_target = torch.arange(V)

    def logits(self, h):
        return h.float()


def test_slot_k_is_trained_against_the_teacher_at_anchor_plus_k_minus_one():
    b = _batch()
    maps = VocabMaps.from_draft_ids(torch.arange(V), V)
    teacher = build_teacher(b, maps)
    plan = plan_blocks(b, slots=3)
    anchors = plan.anchors
    k = 3

    def hidden_pointing_at(shift: int) -> torch.Tensor:
        h = torch.full((1, anchors.shape[1], k + 1, V), -20.0)
        for i, a in enumerate(anchors[0].tolist()):
            for j in range(1, k + 1):
                h[0, i, j, (3 * (a + j - 1 + shift)) % V] = 20.0
        return h

    right = block_loss(
        _Stub(), hidden_pointing_at(0), anchors, teacher, b.input_ids, b.segment_ids, [1.0] * k, 1.0
    )
    wrong = block_loss(
        _Stub(), hidden_pointing_at(1), anchors, teacher, b.input_ids, b.segment_ids, [1.0] * k, 1.0
    )
    assert torch.equal(right.correct, right.count) and right.count.sum() > 0
    assert wrong.correct.sum() == 0
    assert right.loss < 1e-6 < wrong.loss
    # slot j scored only while a + j - 1 is supervised in the anchor's sample: anchors 3,4,5 | 8,9,10 with loss
    # tokens 4..6 and 9..11 give slot 1: 6 rows, slot 2: 4 (5 + 1 = 6 and 10 + 1 = 11 are the samples' last
    # supervised targets), slot 3: 2
    assert right.count.tolist() == [6.0, 4.0, 2.0]
    # the slot weights multiply the per-slot sums
    w = block_loss(
        _Stub(), hidden_pointing_at(1), anchors, teacher, b.input_ids, b.segment_ids, [1.0, 0.0, 0.0], 1.0
    )
    assert w.loss == pytest.approx(float(wrong.ce_sum[0]), rel=1e-6)
    chained = block_loss(
        _Stub(),
        hidden_pointing_at(0),
        anchors,
        teacher,
        b.input_ids,
        b.segment_ids,
        [1.0] * k,
        1.0,
        with_chain=True,
    )
    assert chained.chain.hits[0] == chained.chain.reach[0] == 6


def test_decay_gamma_gives_dflash_slot_weights():
    cfg = TrainConfig(ttt_steps=4, decay_gamma=7.0, wandb={"mode": "disabled"})
    assert cfg.step_weights == pytest.approx([math.exp(-j / 7.0) for j in range(4)])
    assert "decay_gamma" not in TrainConfig().identity() and cfg.identity()["decay_gamma"] == 7.0


def test_the_trainer_trains_a_dflash_drafter_and_its_checkpoint_loads_back(tmp_path):
    from eyas.serving.models.drafter import load_trained_drafter
    from eyas.train.setup import build_drafter
    from eyas.train.vocab import build_draft_vocab

    from .test_trainer import fit_on_train, tiny_cfg, tiny_setup

    target, _, data = tiny_setup(num_samples=4, seq_len=24, draft_vocab=64)
    vocab = build_draft_vocab(data.vocab_counts, 64)
    cfg = DraftModelConfig(draft_vocab_size=64, init="target", family="dflash", num_layers=2)
    drafter = build_drafter(target, cfg, vocab, block_size=4)
    assert isinstance(drafter, DFlashDrafter) and drafter.config.block_size == 4
    assert drafter.config.mask_token_id == target.vocab_size - 1
    head = drafter.lm_head.weight.clone()
    torch.testing.assert_close(head, target.head.weight.float()[vocab.draft_to_target])
    res = fit_on_train(
        tiny_cfg(
            tmp_path, max_steps=3, save_every=0, ttt_steps=3, decay_gamma=4.0, block_anchors=8, eval_every=0
        ),
        target,
        drafter,
        data,
    )
    assert res.final_eval is not None and res.final_eval["chain_length"] == 6
    assert len(res.final_eval["acc"]) == 6 and 1.0 <= res.final_eval["tau_chain"] <= 7.0
    loaded = load_trained_drafter(res.last_checkpoint, target.model.get_input_embeddings().weight)
    assert isinstance(loaded, DFlashDrafter) and loaded.config.num_hidden_layers == 2
    torch.testing.assert_close(loaded.lm_head.weight, head, rtol=0, atol=0)  # the head stays the target's
    assert loaded.mask_embedding.abs().sum() > 0  # learned (it starts at zeros)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no EAGLE-3 options"):
        DraftModelConfig(family="dflash", fc_norm=True)
    # `eyas export` of the checkpoint: vLLM's DFlash format, loaded back with the same logits, described
    from eyas.serving.export import ExportJob, ExportStage
    from eyas.serving.export import run as run_export

    out = run_export(
        ExportJob(export=ExportStage(checkpoint=res.last_checkpoint, out_dir=str(tmp_path / "export"))),
        target,
    )
    assert out["format"] == "dflash" and out["round_trip_max_abs_logit_diff"] == 0.0
    assert out["aux_layers_sglang"] == list(target.aux_layers) and out["draft_vocab_size"] == 64
    assert '"method":"dflash"' in out["serve"]["commands"]["vllm"]


def test_a_dflash_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path):
    """The anchors are drawn from the torch generator that checkpoints save: SIGTERM after step 2, resume, and the
    weights at step 4 are those of a run never stopped."""
    import os
    import signal

    from eyas.train.guards import TrainingInterrupted
    from eyas.train.setup import build_drafter
    from eyas.train.sources import ListSource
    from eyas.train.trainer import fit
    from eyas.train.vocab import build_draft_vocab

    from .test_trainer import tiny_cfg, tiny_setup

    class StopAfter(ListSource):
        def __init__(self, batches, n: int | None):
            super().__init__(batches, shuffle=True)
            self.n, self.served = n, 0

        def __iter__(self):
            for b in super().__iter__():
                self.served += 1
                if self.served == self.n:
                    os.kill(os.getpid(), signal.SIGTERM)  # StopSignals: save this step, then stop
                yield b

    def run(out, stop):
        target, _, data = tiny_setup(num_samples=4, seq_len=24, draft_vocab=64)
        vocab = build_draft_vocab(data.vocab_counts, 64)
        drafter = build_drafter(
            target, DraftModelConfig(draft_vocab_size=64, family="dflash"), vocab, block_size=4
        )
        cfg = tiny_cfg(out, max_steps=4, save_every=0, ttt_steps=3, block_anchors=3)
        fit(cfg, drafter, StopAfter(data.train, stop), None, head=target.head, target_info=target.info)
        return drafter

    whole = run(tmp_path / "whole", None)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path / "stopped", 2)
    resumed = run(tmp_path / "stopped", None)
    for name, p in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], p, rtol=0, atol=0, msg=name)
