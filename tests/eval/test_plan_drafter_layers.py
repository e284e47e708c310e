"""``eyas plan plan.with_drafter=true`` prices the drafter a target of that depth gets: the aux layers of the one
rule training and serving use (``serving.target.default_aux_layers``), and the weights of the drafter built from
them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eyas.eval.plan import plan
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.target import default_aux_layers


def _config(layers: int) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": layers,
        "vocab_size": 256,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }


@pytest.mark.parametrize("layers", [*range(2, 12), 16, 24, 30, 32, 61, 80, 126])
def test_plan_and_the_target_agree_on_the_drafters_layers(layers):
    cfg = _config(layers)
    res = plan(cfg, gpu_mem_gib=80, with_drafter=True, draft_vocab_size=128)
    aux = default_aux_layers(layers)
    assert res.drafter_aux_layers == aux
    drafter = Eagle3Drafter(DrafterConfig.from_target(SimpleNamespace(**cfg), aux, 128))
    weights = sum(v.numel() for v in drafter.trainable_state_dict().values() if v.is_floating_point())
    assert res.drafter_weight_bytes_per_gpu == 2 * weights  # bf16, one GPU
    assert f"reads target layers {aux}" in res.table()
