"""The layers both drafter families build on (EAGLE-3's in :mod:`eyas.serving.models.drafter`, DFlash's in
:mod:`eyas.serving.models.dflash`): RMSNorm, the rope tables and their application, the SiLU MLP, and what a
drafter holds of the target's vocabulary (:class:`TargetVocabulary`).

Design decisions:
- Below both families, so neither imports the other for its building blocks (the checkpoint loader in
  ``drafter`` dispatches to ``dflash`` by family; ``dflash`` imports nothing from ``drafter``).
- ``cfg`` is any drafter config carrying the fields a layer reads (``hidden_size``, ``intermediate_size``,
  ``hidden_act``, ``head_dim``, ``rope_parameters``, ...): EAGLE-3's ``DrafterConfig`` and DFlash's
  ``DFlashConfig`` both do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def rope_parameters_of(c) -> dict[str, Any]:
    """The rope parameters of a model config ``c`` (transformers v5 ``rope_parameters`` or the classic keys)."""
    rope = getattr(c, "rope_parameters", None)
    if isinstance(rope, dict) and rope:
        # some models nest per-layer-type parameters (Gemma 3): take the full-attention ones
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):
            rope = rope["full_attention"]
        rope = dict(rope)
    else:
        rope = dict(getattr(c, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", float(getattr(c, "rope_theta", 10000.0)))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables from the target's rope settings, via transformers' own rope initialisers."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type.startswith("dynamic"):
            raise ValueError(
                "dynamic rope scaling depends on the running length; eyas drafters need a static rope"
            )
        lc = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        if rope_type == "default":  # transformers v5 keeps it per model class, not in ROPE_INIT_FUNCTIONS
            # partial rope (GLM, NeoX, ...): only the first head_dim * factor dims of each head rotate
            dim = int(cfg.head_dim * float(cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
            base = float(cfg.rope_parameters.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](lc, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin: [B, T, r] with r <= d: the first r dims rotate, the rest pass (partial rope)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos[:, None] + _rotate_half(x) * sin[:, None]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos[:, None] + _rotate_half(rot) * sin[:, None], rest], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act != "silu":
            raise ValueError(f"only silu drafters are supported, not {cfg.hidden_act}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TargetVocabulary(nn.Module):
    """What either drafter family holds of the target's vocabulary: the target's input embedding (frozen) and the
    draft vocabulary's map into it (``d2t``: target id minus draft id, vLLM's layout; ``t2d``: which target ids
    are draft tokens). A drafter calls :meth:`init_vocabulary` in its constructor."""

    def init_vocabulary(self, cfg) -> None:
        """``embed_tokens``, ``d2t`` and ``t2d`` for ``cfg.vocab_size`` target and ``cfg.draft_vocab_size`` draft
        tokens (the identity map until :meth:`set_vocab_map`)."""
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Copy in the target's input embedding table (frozen)."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight.shape)} does not fit this drafter "
                f"({tuple(self.embed_tokens.weight.shape)})"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_to_target[i]`` is the target id of draft token ``i``."""
        ids = draft_to_target.long().cpu()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"{ids.numel()} draft tokens for draft_vocab_size={self.config.draft_vocab_size}"
            )
        if (
            ids.unique().numel() != ids.numel()
            or int(ids.min()) < 0
            or int(ids.max()) >= self.config.vocab_size
        ):
            raise ValueError("draft vocabulary must be distinct target ids inside the target vocabulary")
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding (what checkpoints and exports hold)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
