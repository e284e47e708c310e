"""Starting the drafter from the target: at step 0 it reads out the target's own upper layer, so its predictions
agree with the target's next-token argmax far more often than a random start's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eyas.train.config import DraftModelConfig
from eyas.train.setup import build_drafter
from eyas.train.vocab import build_draft_vocab


def _agreement(target, drafter, input_ids: torch.Tensor) -> float:
    """How often the drafter's step-0 argmax at row t equals the target's argmax at position t."""
    out = target.forward(input_ids)
    want = out.logits.argmax(-1)  # [B, T] the target's next token at each position
    with torch.no_grad():
        ttt = drafter.forward_ttt(input_ids, out.aux.float(), steps=1)
        got = drafter.draft_to_target[drafter.logits(ttt.hidden[0]).argmax(-1)]  # [B, T] target ids
    return float((got == want).float().mean())


def _drafters(target, draft_vocab_size: int):
    counts = torch.arange(target.vocab_size, 0, -1)  # any fixed vocabulary
    vocab = build_draft_vocab(counts, draft_vocab_size)
    cfg = dict(draft_vocab_size=draft_vocab_size)
    random = build_drafter(target, DraftModelConfig(**cfg, init="random"), vocab, seed=0)
    warm = build_drafter(target, DraftModelConfig(**cfg, init="target"), vocab, seed=0)
    return random, warm


def test_target_init_reproduces_the_tiny_targets_top_layer(tiny_target):
    target = tiny_target("llama", num_layers=6)  # aux layers 0, 2, 4: the drafter starts as layer 5, the last
    random, warm = _drafters(target, target.vocab_size)
    ids = torch.randint(3, target.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    assert _agreement(target, warm, ids) == 1.0
    assert _agreement(target, random, ids) < 0.2
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


def test_target_init_agrees_with_the_embedded_target(embedded_target_fp32):
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
