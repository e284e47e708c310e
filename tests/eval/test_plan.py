"""Memory plan arithmetic: KV bytes per token (MLA / GQA / sliding), parameter counts, pools, limits, errors."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.eval.plan import (
    PRESET_DIR,
    ContextTooLong,
    MissingConfigField,
    PlanError,
    count_parameters,
    load_model_config,
    main,
    model_shape,
    plan,
)
from eyas.serving.models.tiny import ARCHS, tiny_config, tiny_model
from tests.conftest import run_app

KIMI_KV = (512 + 64) * 61 * 2  # (kv_lora_rank + qk_rope_head_dim) × layers × bf16 bytes = 70272 B
LLAMA3_KV = 2 * 8 * 128 * 32 * 2  # K and V × kv heads × head_dim × layers × bf16 bytes = 131072 B = 128 KiB
LLAMA31_8B_PARAMS = 8_030_261_248  # published parameter count of Llama-3.1-8B


def test_kimi_k2_kv_per_token_full_model():
    r = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8)
    assert r.attention == "mla"
    assert r.kv_bytes_per_token == KIMI_KV
    assert round(r.kv_bytes_per_token / 1024, 1) == 68.6


def test_kimi_k2_per_gpu_share_needs_dp_attention():
    """~8.6 KiB per GPU over 8 GPUs is the DP-attention layout; plain TP replicates the latent on every rank."""
    tp = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8)
    dp = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, dp_attention=8)
    assert tp.kv_bytes_per_token_per_gpu == KIMI_KV == tp.kv_bytes_per_token_avg_gpu  # replicated
    assert dp.kv_bytes_per_token_per_gpu == KIMI_KV  # a rank stores whole latents, of its own requests only
    assert dp.kv_bytes_per_token_avg_gpu == KIMI_KV / 8
    assert round(dp.kv_bytes_per_token_avg_gpu / 1024, 1) == 8.6
    assert dp.pool_tokens_total == 8 * dp.pool_tokens_per_rank
    assert tp.pool_tokens_total == tp.pool_tokens_per_rank
    # DP-attention replicates the attention weights, so each rank has less room, yet the group holds more tokens
    assert dp.weight_bytes_per_gpu > tp.weight_bytes_per_gpu
    assert dp.pool_tokens_total > tp.pool_tokens_total


def test_fp8_kv_halves_the_latent():
    r = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, kv_dtype="fp8")
    assert r.kv_bytes_per_token == KIMI_KV // 2


def test_llama3_gqa_by_hand():
    r = plan("llama3_8b", gpu_mem_gib=80, num_gpus=1)
    assert r.attention == "gqa"
    assert r.kv_bytes_per_token == r.kv_bytes_per_token_per_gpu == LLAMA3_KV == 128 * 1024
    assert r.params.total == LLAMA31_8B_PARAMS
    weights = 2 * LLAMA31_8B_PARAMS  # bf16
    kv_mem = 80 * 0.9 * 2**30 - weights  # 77,309,411,328 − 16,060,522,496 = 61,248,888,832 B
    assert r.kv_bytes_per_gpu == kv_mem
    assert r.pool_tokens_per_rank == 467_291 == int(kv_mem // LLAMA3_KV)
    assert r.largest_context_memory == 467_291
    assert r.largest_context == r.supported_context.tokens == 131_072  # capped by the model, not by memory


def test_gqa_heads_split_then_replicate_over_tp():
    tp8 = plan("llama3_8b", gpu_mem_gib=80, num_gpus=8)
    assert tp8.kv_bytes_per_token_per_gpu == LLAMA3_KV / 8  # one of the 8 kv heads per GPU
    tp16 = plan("llama3_8b", gpu_mem_gib=80, num_gpus=16)
    assert tp16.kv_bytes_per_token_per_gpu == LLAMA3_KV / 8  # still one head: each is replicated twice
    assert any("replicated 2×" in n for n in tp16.notes)


def test_concurrency_at_a_context():
    r = plan("llama3_8b", gpu_mem_gib=80, num_gpus=1, context=32768, concurrency=20)
    assert r.max_concurrency == 467_291 // 32768 == 14
    assert not r.fits


def test_sliding_window_layers_cost_at_most_the_window():
    r = plan("gemma3_270m", gpu_mem_gib=1, num_gpus=1)
    s = model_shape(*load_model_config("gemma3_270m"))
    assert (s.sliding_layers, s.full_layers, s.sliding_window) == (15, 3, 512)
    per_layer = 2 * 1 * 256 * 2  # K and V × 1 kv head × head_dim 256 × bf16
    assert r.kv_bytes_per_token == 18 * per_layer
    n = r.largest_context_memory

    def cost(tokens):
        return tokens * 3 * per_layer + min(tokens, 512) * 15 * per_layer

    assert cost(n) <= r.kv_bytes_per_gpu < cost(n + 1)
    assert n > r.pool_tokens_per_rank  # long sequences stop paying for the sliding layers


def test_context_beyond_the_supported_maximum_names_the_limit():
    with pytest.raises(ContextTooLong, match=r"exceeds the model's supported maximum of 262144 tokens"):
        plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, context=262_145)


def test_yarn_factor_extends_a_short_max_position_embeddings():
    cfg, _ = load_model_config("llama3_8b")
    cfg = {
        **cfg,
        "max_position_embeddings": 32768,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    r = plan(cfg, gpu_mem_gib=80)
    assert r.supported_context.tokens == 131_072 and "yarn factor 4" in r.supported_context.how
    dsv3 = plan("deepseek_v3", gpu_mem_gib=141, num_gpus=8)
    assert dsv3.supported_context.tokens == 40 * 4096 == 163_840


def test_missing_field_is_named(tmp_path):
    cfg, _ = load_model_config("kimi_k2")
    del cfg["qk_rope_head_dim"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(MissingConfigField, match="'qk_rope_head_dim'") as e:
        plan(str(tmp_path), gpu_mem_gib=80)
    assert e.value.field == "qk_rope_head_dim"
    cfg, _ = load_model_config("llama3_8b")
    del cfg["num_hidden_layers"]
    with pytest.raises(MissingConfigField, match="'num_hidden_layers'"):
        plan(cfg, gpu_mem_gib=80)


def test_impossible_settings_are_refused():
    with pytest.raises(PlanError, match=r"weights need .* GiB per GPU but only .* GiB is available"):
        plan("kimi_k2", gpu_mem_gib=80, num_gpus=1)
    with pytest.raises(PlanError, match="9 attention heads do not split over attention TP 2"):
        plan("smollm2_135m", gpu_mem_gib=80, num_gpus=2)
    with pytest.raises(PlanError, match="dp_attention=3 must divide tp=8"):
        plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, dp_attention=3)
    with pytest.raises(PlanError, match="kv_dtype must be one of"):
        plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, kv_dtype="int3")


def test_published_parameter_counts():
    dsv3, _ = load_model_config("deepseek_v3")
    n = count_parameters(dsv3)
    assert abs(n.total / 1e9 - 671) < 1  # "671B total parameters"
    assert abs(n.active / 1e9 - 36.6) < 0.05  # "36.6B activated, including 0.9B for the output head"
    kimi, _ = load_model_config("kimi_k2")
    assert 1.0e12 < count_parameters(kimi).total < 1.05e12  # "1T total parameters"


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_count_equals_the_built_model(arch):
    model = tiny_model(arch)
    built = sum(p.numel() for p in model.parameters())
    built += sum(b.numel() for k, b in model.named_buffers() if k.endswith("e_score_correction_bias"))
    cfg, _ = load_model_config(tiny_config(arch))
    assert count_parameters(cfg).total == built


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
        (
            "qwen2_moe",
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                decoder_sparse_step=2,
            ),
        ),
        (
            "qwen3_moe",
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                head_dim=16,
                mlp_only_layers=[1],
            ),
        ),
        ("llama", dict(tie_word_embeddings=True)),
    ],
)
def test_parameter_count_of_other_moe_layouts(arch, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        **extra,
    )
    torch.manual_seed(0)
    built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count_parameters(load_model_config(config)[0]).total == built


def test_drafter_kv_follows_the_exported_drafter():
    """An eyas drafter of an MLA target keeps all 64 heads as kv heads (head_dim = v_head_dim = 128)."""
    base = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8)
    with_d = plan("kimi_k2", gpu_mem_gib=141, num_gpus=8, with_drafter=True)
    assert with_d.drafter_kv_bytes_per_token_per_gpu == 2 * (64 // 8) * 128 * 2
    assert with_d.kv_bytes_per_token_per_gpu == base.kv_bytes_per_token_per_gpu + 4096
    assert with_d.weight_bytes_per_gpu > base.weight_bytes_per_gpu


def test_every_preset_loads():
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert {"deepseek_v3", "kimi_k2", "smollm2_135m", "llama3_8b"} <= set(names)
    for name in names:
        cfg, shown = load_model_config(name)
        assert shown == name and model_shape(cfg, name).num_layers > 0


def test_smollm2_preset_matches_the_embedded_model():
    from eyas.serving.models.embedded import cache_dir

    local = cache_dir() / "models" / "smollm2-135m-instruct" / "config.json"
    if not local.exists():
        pytest.skip("embedded target not converted on this machine")
    preset, _ = load_model_config("smollm2_135m")
    real = json.loads(local.read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "intermediate_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert preset[key] == real[key], key


def test_cli_prints_the_table(capsys, monkeypatch, tmp_path):
    argv = ["plan.model=kimi_k2", "plan.gpu_mem_gib=141", "plan.num_gpus=8"]
    assert run_app(main, [*argv, "plan.dp_attention=8"], monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    assert "68.62 KiB" in out and "8.58 KiB" in out
    assert run_app(main, [*argv, "plan.context=300000"], monkeypatch, tmp_path) == 2
    assert "supported maximum of 262144" in capsys.readouterr().err
    assert run_app(main, [*argv, "+plan.bogus=1"], monkeypatch, tmp_path) == 2
    assert capsys.readouterr().err.startswith("error: plan.bogus: unknown key")
    assert run_app(main, [*argv, "plan.gpu_mem_gib=lots"], monkeypatch, tmp_path) == 2
    assert capsys.readouterr().err == "error: plan.gpu_mem_gib: expected float, got 'lots'\n"
