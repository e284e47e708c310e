"""Held-out evaluation: τ_sim at ``train.eval_chain_length`` drafts whatever ``ttt_steps`` is, a simulated hit
scored as serving scores it (ties to the lowest target id), only the evaluated batches decoded, and ``best/``
measured at another chain length not compared with this run's values."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from eyas.data.types import Batch
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.target import TargetHead
from eyas.train.checkpoint import TrainerState
from eyas.train.losses import DistillationModel, VocabMaps, build_teacher
from eyas.train.sources import ListSource
from eyas.train.trainer import evaluate, fit
from tests.conftest import make_tiny_target
from tests.train.test_trainer import tiny_cfg, tiny_setup

CPU = SimpleNamespace(device=torch.device("cpu"), num_processes=1)


def _teacher_kw(drafter, head) -> dict:
    maps = VocabMaps.from_draft_ids(drafter.draft_to_target, drafter.config.vocab_size)
    return dict(maps=maps, form="auto", oov_rule="teacher", head=head)


def test_tau_is_simulated_at_the_eval_chain_length_whatever_the_ttt_steps():
    target, drafter, data = tiny_setup()
    kw = _teacher_kw(drafter, target.head)
    two, six = [0.8**j for j in range(2)], [0.8**j for j in range(6)]
    at_six = evaluate(CPU, DistillationModel(drafter, two), data.eval, kw, two, chain_length=6)
    trained_six = evaluate(CPU, DistillationModel(drafter, six), data.eval, kw, six, chain_length=6)
    at_two = evaluate(CPU, DistillationModel(drafter, two), data.eval, kw, two)
    assert at_six.chain_length == 6 and len(at_six.acceptance.served_cond_acc) == 6
    # the same chains whether the drafter trains 2 steps or 6: the estimate depends on K only
    assert at_six.acceptance == trained_six.acceptance
    # the loss stays the 2-step training objective; the steps past it are reported, not weighed
    assert at_six.loss == pytest.approx(at_two.loss, rel=1e-6) and len(at_six.step_acc) == 6
    assert at_two.chain_length == 2 and at_six.acceptance.rows == at_two.acceptance.rows


def test_training_reports_tau_at_eval_chain_length(tmp_path):
    target, drafter, data = tiny_setup()
    cfg = tiny_cfg(tmp_path, max_steps=2, ttt_steps=2, eval_chain_length=6, save_every=0)
    res = fit(cfg, drafter, ListSource(data.train), data.eval, head=target.head, target_info=target.info)
    assert res.final_eval["chain_length"] == 6 and len(res.final_eval["served_cond_acc"]) == 6
    assert json.loads((tmp_path / "best" / "metrics.json").read_text())["chain_length"] == 6


def _tied_setup(draft_ids: list[int]):
    """A batch whose target ties target ids 3 and 5 for the top logit at every position, and a drafter whose draft
    logits are all equal (zero lm_head), so it proposes draft token 0 (the proposer's argmax: first index)."""
    v, h, t = 16, 8, 10
    weight = torch.zeros(v, h)
    weight[3, 0] = weight[5, 0] = 1.0  # rows 3 and 5: logit = hidden[0]; every other row: 0
    hidden = torch.zeros(1, t, h)
    hidden[..., 0] = 4.0
    g = torch.Generator().manual_seed(0)
    batch = Batch(
        input_ids=torch.randint(0, v, (1, t), generator=g),
        loss_mask=torch.ones(1, t, dtype=torch.bool),
        position_ids=torch.arange(t)[None],
        segment_ids=torch.ones(1, t, dtype=torch.long),
        aux=torch.randn(1, t, 3 * h, generator=g),
        target_hidden=hidden,
    )
    cfg = DrafterConfig(
        hidden_size=h,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        vocab_size=v,
        draft_vocab_size=len(draft_ids),
        aux_layer_ids=[0, 1, 2],
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.set_embedding(torch.randn(v, h))
    drafter.set_vocab_map(torch.tensor(draft_ids))
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    return batch, TargetHead(weight), drafter


@pytest.mark.parametrize(("draft_ids", "served_accepts"), [([5, 3, 7, 9], False), ([3, 5, 7, 9], True)])
def test_a_simulated_hit_breaks_argmax_ties_as_serving_does(draft_ids, served_accepts):
    """Serving: the target's greedy token is its argmax (3 of the tied 3 and 5: the lowest id); the drafter proposes
    the target id of its first draft token. Under a draft vocabulary not sorted by id ([5, 3, ...]) that is 5, a
    rejection, which a hit rule comparing draft indices counted as accepted."""
    batch, head, drafter = _tied_setup(draft_ids)
    teacher = build_teacher(batch, VocabMaps.from_draft_ids(drafter.draft_to_target, 16), head=head)
    assert teacher.target_argmax.unique().tolist() == [3]
    with torch.no_grad():
        out = DistillationModel(drafter, [1.0])(
            batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, teacher, 1.0, with_chain=True
        )
    counted, hits = int(out.chain.counted[0]), int(out.chain.correct[0])
    assert counted > 0
    assert hits == (counted if served_accepts else 0)


def test_a_topk_teacher_breaks_ties_to_the_lowest_target_id():
    """The engine may list two tied tokens in any order; the target's greedy token is the lowest id of the two."""
    maps = VocabMaps.from_draft_ids(torch.tensor([1, 3, 5]), 8)
    lp = torch.log(torch.tensor([[0.4, 0.4, 0.2], [0.5, 0.3, 0.2]]))
    batch = Batch(
        input_ids=torch.tensor([[0, 1, 2]]),
        loss_mask=torch.tensor([[False, True, True]]),
        position_ids=torch.arange(3)[None],
        segment_ids=torch.ones(1, 3, dtype=torch.long),
        aux=torch.zeros(1, 3, 6),
        topk_logprobs=torch.cat([lp, torch.zeros(1, 3)])[None],
        topk_ids=torch.tensor([[[5, 3, 1], [5, 3, 1], [0, 0, 0]]]),
    )
    teacher = build_teacher(batch, maps, form="topk")
    assert teacher.target_argmax.tolist() == [3, 5]


def test_only_the_evaluated_held_out_batches_are_decoded(tmp_path, monkeypatch):
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.loader import FeatureLoader
    from eyas.train.setup import run_data
    from tests.data.test_store import random_samples

    target = make_tiny_target(seed=1)
    extract(random_samples(24, seed=4, max_len=30), target, tmp_path / "store", ExtractConfig(progress=False))
    decoded: list[str] = []
    make_batch = FeatureLoader.make_batch

    def counting(self, rows):
        decoded.append(self.cfg.split)
        return make_batch(self, rows)

    monkeypatch.setattr(FeatureLoader, "make_batch", counting)
    data = {
        "source": "store",
        "store_dir": str(tmp_path / "store"),
        "eval_fraction": 0.5,
        "loader": {"batch_rows": 1, "max_tokens": 32},
    }
    every = run_data(target, tiny_cfg(tmp_path, data=data), rank=0, world=1)
    assert len(every.eval) >= 4 and decoded.count("eval") == len(every.eval)
    decoded.clear()
    two = run_data(target, tiny_cfg(tmp_path, data=data, eval_batches=2), rank=0, world=1)
    assert len(two.eval) == 2 and decoded.count("eval") == 2
    for a, b in zip(two.eval, every.eval):
        assert a.sample_ids == b.sample_ids  # the first two, as the trainer takes them


@pytest.mark.parametrize("chain_length", [3, 2])
def test_a_best_measured_at_another_chain_length_is_not_compared(tmp_path, chain_length):
    """A best τ at K = 2 drafts says nothing about τ at 3 (τ at 7 drafts beats any τ at 6): the resumed run at
    another K starts a new best; at the same K it keeps comparing."""
    target, drafter, data = tiny_setup(num_samples=4)
    kw = dict(max_steps=4, save_every=2, eval_every=2, best_metric="tau_chain", eval_chain_length=2)
    fit(tiny_cfg(tmp_path, **kw), drafter, ListSource(data.train), data.train, head=target.head)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    step2 = tmp_path / "checkpoints" / "step_00000002" / "trainer_state.json"
    state = json.loads(step2.read_text())
    assert state["best_step"] == 2
    state["best_value"] = 100.0  # a τ no chain of 2 drafts reaches: only a new best can replace it
    step2.write_text(json.dumps(state))
    target, drafter, data = tiny_setup(num_samples=4)
    kw["eval_chain_length"] = chain_length
    again = fit(tiny_cfg(tmp_path, **kw), drafter, ListSource(data.train), data.train, head=target.head)
    assert again.resumed_from is not None
    if chain_length == 2:
        assert again.best_step == 2 and again.best_value == 100.0
    else:
        assert again.best_step == 4 and math.isfinite(again.best_value) and again.best_value < 100.0
        assert TrainerState.read(tmp_path / "checkpoints" / "step_00000004").best_step == 4
        assert json.loads((tmp_path / "best" / "metrics.json").read_text())["chain_length"] == 3


def test_the_spread_study_measures_the_spread_of_one_estimate_and_of_a_choice():
    """eyas.lab.held_out_spread on made-up counts: batches that all agree have no spread; a checkpoint better on
    every batch is chosen from any set of them; two checkpoints that differ by noise are chosen either way."""
    from eyas.lab.held_out_spread import spread

    def counts(hits: list[float]) -> torch.Tensor:  # [n_batches, 6, K = 1]: 10 chains per batch
        c = torch.zeros(len(hits), 6, 1)
        c[:, 0] = c[:, 2] = c[:, 4] = 10.0
        c[:, 1, 0] = c[:, 3, 0] = c[:, 5, 0] = torch.tensor(hits)
        return c

    same = spread({"step_1": counts([5.0] * 8), "step_2": counts([6.0] * 8)}, draws=50)
    assert [r["n"] for r in same] == [1, 2, 4]
    assert all(r["std_tau_served"] < 1e-12 and r["wrong_sign"] == 0 for r in same)
    g = torch.Generator().manual_seed(0)
    noisy = [float(x) for x in torch.randint(0, 11, (64,), generator=g)]
    rows = spread({"step_1": counts(noisy), "step_2": counts(noisy[::-1])}, draws=200)
    assert rows[0]["std_tau_served"] > rows[-1]["std_tau_served"] > 0  # more batches, less spread
    assert rows[0]["std_from_halves"] == pytest.approx(rows[0]["std_tau_served"], rel=0.3)
    assert 0.2 < rows[0]["wrong_sign"] < 0.8  # same batches in another order: a coin flip at one batch
