"""The EAGLE-3 drafter module: its rope equals transformers' (partial rope included), the caller says whether a
row's hidden input is target aux states or the drafter's own output, and aux layer ids are checked on entry."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.serving.loop import generate
from eyas.serving.models.drafter import (
    CONFIG_FILE,
    DrafterConfig,
    Eagle3Drafter,
    Rotary,
    apply_rope,
    load_trained_drafter,
    save_drafter_weights,
)
from eyas.serving.proposers import DraftContext, Eagle3Proposer
from eyas.serving.verify import SamplingConfig, warp_probs
from tests.conftest import make_tiny_target
from tests.serving.test_speculative_loop import make_drafter, ttt_logits


# -- rope -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 1.0},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "partial_rotary_factor": 0.5,
        },
    ],
)
def test_rope_equals_transformers_partial_rotary_included(rope):
    """cos/sin and the rotated q/k equal transformers' GLM-4-MoE rope (a model with partial rope)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    target_cfg = Glm4MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_parameters=dict(rope),
    )
    cfg = DrafterConfig.from_target(target_cfg, [0], 32)
    assert cfg.rope_parameters["partial_rotary_factor"] == rope["partial_rotary_factor"]
    ours, ref = Rotary(cfg), Glm4MoeRotaryEmbedding(target_cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 1, 7, 300, 1999]])
    q = torch.randn(1, 4, 5, 16, generator=g)
    k = torch.randn(1, 2, 5, 16, generator=g)
    cos, sin = ours(pos, torch.float32)
    ref_cos, ref_sin = ref(q, pos)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-6, atol=1e-6)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos, sin), ref_k, rtol=1e-6, atol=1e-6)


# -- context rows vs draft rows ---------------------------------------------------------------------------------
def test_one_aux_layer_drafter_drafts_equal_the_uncached_unroll():
    """With one aux layer the aux states and the drafter's own output are both H wide: the draft rows must not go
    through fc again. The proposer's chain distributions equal the training-time unroll's (fc once, at step 0)."""
    target = make_tiny_target("llama", num_layers=2)  # default aux layers: [0]
    assert target.aux_layers == (0,)
    drafter = make_drafter(target, seed=5, draft_vocab=200)
    assert drafter.config.fc_in_features == drafter.config.hidden_size
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(1))
    proposer = Eagle3Proposer(drafter, chain_length=3)
    res = generate(target, proposer, prompt, 6)
    committed = torch.cat([prompt, torch.tensor(res.tokens[:-1])])
    length, pending = committed.numel(), res.tokens[-1]
    aux = target.forward(committed[None], logits="none").aux
    sampling = SamplingConfig(temperature=0.9)
    chain = proposer.propose(
        DraftContext(
            tokens=torch.cat([committed, torch.tensor([pending])]),
            length=length,
            sampling=sampling,
            generator=torch.Generator().manual_seed(0),
            mode="chain",
            max_depth=3,
            max_tokens=3,
        )
    )
    drafts = chain.tree.tokens[1:].tolist()
    assert len(drafts) == 3
    for j in range(len(drafts)):
        q = torch.zeros(target.vocab_size)
        q[drafter.draft_to_target] = warp_probs(
            ttt_logits(drafter, aux, committed, pending, drafts[:j]), 0.9, 1.0
        )
        torch.testing.assert_close(chain.draft_probs[j + 1], q, rtol=1e-4, atol=1e-5)


def _rows(drafter: Eagle3Drafter, width: int):
    t = 3
    cache = drafter.new_cache(8)
    cache.prepare(torch.arange(t), t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    return (torch.arange(3, 3 + t)[None], torch.randn(1, t, width), torch.arange(t)[None], cache, mask)


def test_the_caller_says_what_the_hidden_input_is():
    cfg = DrafterConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=64,
        draft_vocab_size=16,
        aux_layer_ids=[0, 1, 2],
        max_position_embeddings=64,
    )
    drafter = Eagle3Drafter(cfg).eval()
    with pytest.raises(TypeError, match="hidden_is_aux"):
        drafter(*_rows(drafter, 96))
    with pytest.raises(
        ValueError, match=r"aux states of width 32; this drafter fuses 3 aux layers of width 32"
    ):
        drafter(*_rows(drafter, 32), hidden_is_aux=True)
    with pytest.raises(
        ValueError, match=r"draft rows take the drafter's own output \(width 32\), got width 96"
    ):
        drafter(*_rows(drafter, 96), hidden_is_aux=False)
    assert drafter(*_rows(drafter, 96), hidden_is_aux=True).hidden.shape == (1, 3, 32)


# -- aux layer ids ----------------------------------------------------------------------------------------------
def _config(**kw) -> dict:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=64,
        draft_vocab_size=16,
        aux_layer_ids=[0, 1, 2],
        max_position_embeddings=64,
    )
    return {**base, **kw}


@pytest.mark.parametrize("ids", [[2, 0, 1], [0, 1, 1], [-1, 0, 1], []])
def test_drafter_config_refuses_aux_ids_the_engines_capture_differently(ids):
    with pytest.raises(
        ValueError, match=r"drafter aux_layer_ids: .*strictly increasing and lie in \[0, L-2\]"
    ):
        DrafterConfig(**_config(aux_layer_ids=ids))


def test_trained_checkpoint_with_bad_aux_ids_is_named_at_load(tmp_path):
    drafter = Eagle3Drafter(DrafterConfig(**_config()))
    config = drafter.config.to_dict()
    config["aux_layer_ids"] = [0, 2, 1]
    save_drafter_weights(tmp_path, drafter.trainable_state_dict(), config)
    with pytest.raises(ValueError, match=rf"{CONFIG_FILE}: drafter aux_layer_ids: aux layer ids \[0, 2, 1\]"):
        load_trained_drafter(tmp_path)
    config["aux_layer_ids"] = [0, 1, 2]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    assert load_trained_drafter(tmp_path).config.aux_layer_ids == [0, 1, 2]
