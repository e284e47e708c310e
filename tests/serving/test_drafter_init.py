"""Starting the drafter from the target (``drafter.init=target``), pinned for what it is.

Row t of draft step 0 carries the target's features after x_0..x_t (``fc(aux_t)``) and the embedding of x_{t+1},
and is trained to predict x_{t+2}. The init computes the target's layer after the top aux layer on those features
and reads it out through the target's norm and head: it reproduces the target's prediction of x_{t+1}, the row's
own input token, and ignores that token. It starts the drafter from good features, not from its objective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eyas.train.config import DraftModelConfig
from eyas.train.setup import build_drafter
from eyas.train.vocab import build_draft_vocab


def _step0(target, drafter, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the drafter's step-0 argmax at every row t, the target's argmax at every position t), target ids [B, T]."""
    out = target.forward(input_ids)
    with torch.no_grad():
        ttt = drafter.forward_ttt(input_ids, out.aux.float(), steps=1)
        got = drafter.draft_to_target[drafter.logits(ttt.hidden[0]).argmax(-1)]
    return got, out.logits.argmax(-1)


def _agreement(target, drafter, input_ids: torch.Tensor, shift: int = 0) -> float:
    """How often the drafter's step-0 argmax at row t equals the target's argmax at position t + shift: shift 0 is
    the target's prediction of x_{t+1} (the row's own input token), shift 1 its prediction of x_{t+2} (what row t
    is trained on)."""
    got, want = _step0(target, drafter, input_ids)
    t = input_ids.shape[1] - shift
    return float((got[:, :t] == want[:, shift:]).float().mean())


def _drafters(target, draft_vocab_size: int):
    counts = torch.arange(target.vocab_size, 0, -1)  # any fixed vocabulary
    vocab = build_draft_vocab(counts, draft_vocab_size)
    cfg = dict(draft_vocab_size=draft_vocab_size)
    random = build_drafter(target, DraftModelConfig(**cfg, init="random"), vocab, seed=0)
    warm = build_drafter(target, DraftModelConfig(**cfg, init="target"), vocab, seed=0)
    return random, warm


def test_target_init_reproduces_the_targets_prediction_of_the_rows_own_input_token(tiny_target):
    target = tiny_target("llama", num_layers=6)  # aux layers 0, 2, 4: the drafter starts as layer 5, the last
    random, warm = _drafters(target, target.vocab_size)
    ids = torch.randint(3, target.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    got, want = _step0(target, warm, ids)
    assert torch.equal(got, want)  # row t = the target at position t: its prediction of x_{t+1}
    # not the objective: against x_{t+2} it agrees exactly where the target predicts the same token twice
    same = float((want[:, :-1] == want[:, 1:]).float().mean())
    assert _agreement(target, warm, ids, shift=1) == pytest.approx(same)
    assert _agreement(target, random, ids) < 0.2
    # the row's own input token x_{t+1} does not enter step 0: its half of q/k/v is zero
    other = ids.clone()
    other[:, 1:] = torch.randint(3, target.vocab_size, (2, 47), generator=torch.Generator().manual_seed(1))
    out = target.forward(ids)
    with torch.no_grad():
        a = warm.forward_ttt(ids, out.aux.float(), steps=1).hidden[0]
        b = warm.forward_ttt(other, out.aux.float(), steps=1).hidden[0]  # same features, other tokens
    assert torch.equal(a, b)
    h = warm.config.hidden_size
    assert torch.count_nonzero(warm.midlayer.self_attn.q_proj.weight[:, :h]) == 0  # the embedding half
    assert torch.equal(warm.fc.weight[:, -h:], torch.eye(h))


def test_a_wider_drafter_mlp_still_starts_as_the_targets_layer(tiny_target):
    """Extra MLP units get zero down_proj columns: step 0 is the target's layer; the units are there to train."""
    target = tiny_target("llama", num_layers=6)
    width = target.layers[5].mlp.down_proj.weight.shape[1]
    vocab = build_draft_vocab(torch.arange(target.vocab_size, 0, -1), target.vocab_size)
    cfg = DraftModelConfig(draft_vocab_size=target.vocab_size, init="target", intermediate_size=3 * width)
    wide = build_drafter(target, cfg, vocab, seed=0)
    ids = torch.randint(3, target.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    assert _agreement(target, wide, ids) == 1.0
    mlp = wide.midlayer.mlp
    assert torch.equal(mlp.gate_proj.weight[:width], target.layers[5].mlp.gate_proj.weight.float())
    assert torch.count_nonzero(mlp.down_proj.weight[:, width:]) == 0
    assert torch.count_nonzero(mlp.up_proj.weight[width:]) > 0  # random, so they can learn


def test_target_init_refuses_a_layer_the_target_lacks(tiny_target):
    target = tiny_target("llama", num_layers=4)
    vocab = build_draft_vocab(torch.ones(target.vocab_size), 64)
    with pytest.raises(ValueError, match="init_layer=9"):
        build_drafter(target, DraftModelConfig(draft_vocab_size=64, init="target", init_layer=9), vocab)


def test_target_init_predicts_the_embedded_targets_next_token_not_the_one_after(embedded_target_fp32):
    target = embedded_target_fp32
    text = (
        "The quick brown fox jumps over the lazy dog. To solve 12 * 7, multiply 10 * 7 = 70 and 2 * 7 = 14, "
        "then add them: 70 + 14 = 84. The answer is 84."
    )
    ids = torch.tensor([target.tokenizer(text)["input_ids"]])
    random, warm = _drafters(target, 8192)
    a_warm, a_random = _agreement(target, warm, ids), _agreement(target, random, ids)
    assert a_warm >= 0.5, a_warm
    assert a_warm > a_random + 0.4, (a_warm, a_random)
    assert (
        _agreement(target, warm, ids, shift=1) < 0.2
    )  # the objective, x_{t+2}: the init does not predict it


def test_the_default_drafter_starts_from_the_target():
    """The recipe study's winner is the default (BENCH.md, "Recipe"): `eyas train`, the demo and the bench build
    a drafter started from the target, with an 8k draft vocabulary, with no overrides."""
    from hydra import compose, initialize_config_dir

    from eyas.common import build_config

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for name in ("config", "demo", "bench"):
            cfg = build_config(DraftModelConfig, compose(name).drafter, "drafter")
            assert cfg.init == "target" and cfg.draft_vocab_size == 8192, name
    assert DraftModelConfig().init == "target" and DraftModelConfig().draft_vocab_size == 8192


def test_the_training_config_window_reaches_the_drafter(tiny_target):
    target = tiny_target("llama", num_layers=6)
    vocab = build_draft_vocab(torch.arange(target.vocab_size, 0, -1), 64)
    d = build_drafter(target, DraftModelConfig(draft_vocab_size=64, attention_window=32), vocab, seed=0)
    assert d.config.attention_window == 32
    assert build_drafter(target, DraftModelConfig(draft_vocab_size=64), vocab).config.attention_window is None
    with pytest.raises(ValueError, match="drafter.attention_window"):
        DraftModelConfig(attention_window=0)
