"""Tiny random-init causal LMs of real architectures, for tests and smoke runs (no downloads).

``tiny_config("deepseek_v3")`` gives an MLA + MoE model with the same code path as DeepSeek-V3 / Kimi-K2.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3", "deepseek_v3", "gemma3_text")


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 4,
    max_position_embeddings: int = 2048,
    **overrides: Any,
):
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "deepseek_v3":
        common.update(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": max_position_embeddings // 4,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    elif arch == "gemma3_text":
        common.update(head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    elif arch in ("qwen3",):
        common.update(head_dim=16)
    common.update(overrides)
    return AutoConfig.for_model(arch, **common)


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **kw: Any,
):
    """A random-init causal LM of ``arch`` in eval mode (the same weights for a seed, whatever the backend)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()
