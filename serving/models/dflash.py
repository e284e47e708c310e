"""The DFlash block drafter: one module for training (many blocks per row) and the bundled loop (one block a step).

Design decisions:
- What vLLM 0.32 runs (``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``), so an export is
  a renaming-free filter over ``state_dict()``: the target's aux states at each context position ``t < p``,
  concatenated, go through ``fc`` (no bias) and ``hidden_norm``; every drafter layer projects that *same* state
  with its own ``k_proj`` / ``v_proj``, ``k_norm`` (per head) and RoPE at ``t`` into extra keys and values. No
  ``input_layernorm`` on the context. The query block is ``[x_p, mask x K]`` at positions ``p .. p + K`` (``x_p``
  the pending token the target has not read yet), embedded by the target's frozen table with the mask token's
  row replaced by the learned ``mask_embedding`` (vLLM's ``mask_embedding.pt``), through ``N`` pre-norm Qwen3
  layers (``q_norm`` / ``k_norm``, neox RoPE, SiLU MLP) and the final ``norm``. Attention is bidirectional
  over the whole block plus every context key; slot ``j`` (1..K) predicts ``x_{p+j}``. One forward drafts K.
- Position convention, against the store's (``data.types``): ``aux[t]`` is the target's state after reading
  ``x_0..x_t``. A block anchored at ``a`` reads ``aux[0..a-1]`` and ``x_a``; slot ``j``'s teacher is the
  target's distribution stored at ``a + j - 1`` (that of ``x_{a+j}``). At serving ``a`` is the committed length.
- Training runs many blocks of a packed row at once (:meth:`DFlashDrafter.forward_blocks`): queries
  ``[B, A, S]`` (A anchors, S = K + 1 slots) attend to the row's context keys masked to ``t < a`` in the
  anchor's own sample, and to their own block, never to another block. The scores are computed in two parts
  (context, block) and soft-maxed together, so no ``[A*S, T + A*S]`` mask is built. The bundled loop calls the
  same attention with one block (:meth:`DFlashDrafter.draft_block`), so training and serving share every op.
- The output head is the target head's draft-vocabulary rows, frozen (``lm_head`` requires no grad); like the
  embedding it is the target's, but it is exported with ``d2t`` because vLLM's ``DFlashQwen3ForCausalLM`` needs
  the head of the vocabulary the drafter drafts from when ``draft_vocab_size`` differs from the target's (it
  then scatters the logits to target ids, -inf elsewhere, exactly what the bundled loop drafts from).
- vLLM's CPU build applies layer 0's ``k_norm`` to the context keys of every layer (``_normalize_context_k``):
  the default is one layer; deeper drafters are correct here and in vLLM's GPU build only.
- The mask token's embedding is replaced wherever the id occurs in a block, the pending token included, as vLLM's
  ``embed_input_ids`` does; the default mask id is the target vocabulary's last. Embeddings are never scaled (vLLM
  does not scale them for this architecture).
- Initialisation: random (``drafter.init=random``, what the recipe's ``dflash`` variant uses: it learned faster
  on the demo store, docs/LOG.md), or the target's upper layers (``train.setup.init_dflash_from_target``);
  ``mask_embedding`` starts at zeros either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from eyas.serving.models.layers import MLP, RMSNorm, Rotary, TargetVocabulary, apply_rope, rope_parameters_of
from eyas.serving.models.target import aux_layer_problem

FAMILY = "dflash"
"""``family`` key of a DFlash drafter's config (an EAGLE-3 drafter's config has none)."""


@dataclass
class DFlashConfig:
    """Sizes and conventions of a DFlash drafter; built from the target's config by :meth:`from_target`."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """The target's vocabulary size."""
    draft_vocab_size: int
    """Rows of the frozen head (the N most frequent loss-masked target tokens; ``vocab_size``: the whole head)."""
    aux_layer_ids: list[int]
    """Target layers whose outputs are fused (SGLang convention: output of decoder layer i), as EAGLE-3's."""
    max_position_embeddings: int
    mask_token_id: int
    """The target token id the mask slots carry; its embedding is replaced by the learned ``mask_embedding``."""
    num_hidden_layers: int = 1
    """Decoder layers (1 by default: vLLM's CPU build normalises every layer's context keys with layer 0's
    ``k_norm``)."""
    block_size: int = 7
    """Slots per block the drafter was trained on: the pending token and K = block_size - 1 masks."""
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    target_hidden_size: int | None = None
    family: str = FAMILY

    def __post_init__(self) -> None:
        if self.family != FAMILY:
            raise ValueError(f"a DFlash config has family {FAMILY!r}, not {self.family!r}")
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_hidden_layers < 1:
            raise ValueError(f"a DFlash drafter needs >= 1 layer, not {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the pending token and a mask), not {self.block_size}")
        if not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(f"mask_token_id must be a target token id in [0, {self.vocab_size})")
        self.mask_token_id = int(self.mask_token_id)
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        problem = aux_layer_problem(self.aux_layer_ids)
        if problem:
            raise ValueError(f"drafter aux_layer_ids: {problem}")
        if "rope_type" not in self.rope_parameters:
            self.rope_parameters = {"rope_type": "default", **self.rope_parameters}

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * int(self.target_hidden_size)

    @classmethod
    def from_target(cls, target_config, aux_layer_ids: list[int], draft_vocab_size: int, **overrides: Any):
        """Sizes, rope and positions from a transformers config of the target."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if getattr(c, "kv_lora_rank", None) is not None:
            raise ValueError("DFlash drafters need a target with standard attention heads (not MLA)")
        heads = int(c.num_attention_heads)
        values: dict[str, Any] = dict(
            hidden_size=int(c.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            intermediate_size=int(getattr(c, "intermediate_size", None) or 4 * c.hidden_size),
            vocab_size=int(c.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            max_position_embeddings=int(c.max_position_embeddings),
            rope_parameters=rope_parameters_of(c),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            mask_token_id=int(c.vocab_size) - 1,
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_dflash_config(config: dict[str, Any]) -> bool:
    """Whether a drafter config dict (a checkpoint's ``drafter_config.json``) is a DFlash drafter's."""
    return config.get("family") == FAMILY


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of rows x [B, T, H] -> [B, kv, T, d] each."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)  # [B, h, T, d]


def block_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    ctx_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each block's queries over its own block (bidirectional) and the context keys ``ctx_mask`` allows.

    q [B, h, A, S, d]; k_blk / v_blk [B, kv, A, S, d]; k_ctx / v_ctx [B, kv, T, d]; ctx_mask [B, A, T] bool
    (True = may attend). Returns [B, h, A, S, d]. Softmax in fp32 over the context and block scores together."""
    b, h, a, s, d = q.shape
    kv = k_blk.shape[1]
    qg = q.view(b, kv, h // kv, a, s, d)  # grouped-query: heads of one kv head together
    s_ctx = torch.einsum("bgrasd,bgtd->bgrast", qg, k_ctx).float() * scale  # [B, kv, g, A, S, T]
    s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None, :, None, :], float("-inf"))
    s_blk = torch.einsum("bgrasd,bgaud->bgrasu", qg, k_blk).float() * scale  # [B, kv, g, A, S, S]
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    t = k_ctx.shape[2]
    out = torch.einsum("bgrast,bgtd->bgrasd", p[..., :t], v_ctx)
    out = out + torch.einsum("bgrasu,bgaud->bgrasd", p[..., t:], v_blk)
    return out.reshape(b, h, a, s, d)


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_ctx: torch.Tensor,
        v_ctx: torch.Tensor,
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """h [B, A, S, H] block rows; cos/sin [B, A*S, r]; context keys/values [B, kv, T, d]; ctx_mask [B, A, T]."""
        b, a, s, width = h.shape
        attn = self.self_attn
        x = self.input_layernorm(h).view(b, a * s, width)
        q = attn.q(x, cos, sin)  # [B, h, A*S, d]
        k, v = attn.kv(x, cos, sin)
        split = lambda t: t.view(t.shape[0], t.shape[1], a, s, t.shape[-1])  # noqa: E731
        o = block_attention(split(q), split(k), split(v), k_ctx, v_ctx, ctx_mask, attn.scale)
        o = attn.o_proj(o.permute(0, 2, 3, 1, 4).reshape(b, a, s, attn.heads * attn.head_dim))
        h = h + o
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class BlockOutput:
    """Result of :meth:`DFlashDrafter.forward_blocks`: ``hidden`` [B, A, S, H] (after the final norm; slot j
    predicts ``x_{a+j}``) and ``valid`` [B, A] (a real anchor, not padding)."""

    hidden: torch.Tensor
    valid: torch.Tensor


class DFlashDrafter(TargetVocabulary):
    """See the module docstring."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target head's draft rows (set_head)
        self.init_vocabulary(cfg)
        self.rotary = Rotary(cfg)

    # -- setup (the frozen target parts) -----------------------------------------------------------------------
    def set_head(self, target_head_weight: torch.Tensor) -> None:
        """The frozen head: the target head's rows of the draft vocabulary (call after :meth:`set_vocab_map`)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_weight.detach().float().cpu()[self.draft_to_target.cpu()])

    # -- pieces ------------------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding, the mask token's replaced by ``mask_embedding`` (vLLM's ``embed_input_ids``)."""
        e = self.embed_tokens(ids)
        is_mask = (ids == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(e.dtype), e)

    def context_kv(
        self, aux: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values ([B, kv, T, d] each) from the aux states [B, T, n_aux*H] at
        ``positions`` [B, T]: ``hidden_norm(fc(aux))`` through the layer's k/v projections, k_norm and RoPE."""
        if aux.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"aux states of width {aux.shape[-1]}; this drafter fuses {len(self.config.aux_layer_ids)} aux "
                f"layers of width {self.config.target_hidden_size} ({self.config.fc_in_features})"
            )
        x = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions, x.dtype)
        return [layer.self_attn.kv(x, cos, sin) for layer in self.layers]

    def blocks(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block rows ``ids`` / ``positions`` [B, A, S] over the context ``ctx`` (:meth:`context_kv`) as
        ``ctx_mask`` [B, A, T] allows: the final-normed hidden states [B, A, S, H]."""
        b, a, s = ids.shape
        h = self.embed(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions.reshape(b, a * s), h.dtype)
        for layer, (k, v) in zip(self.layers, ctx):
            h = layer(h, cos, sin, k, v, ctx_mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (fp32) of final-normed hidden states."""
        return self.lm_head(hidden).float()

    # -- training ----------------------------------------------------------------------------------------------
    def forward_blocks(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        anchors: torch.Tensor,
        slots: int,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        anchor_chunk: int | None = None,
    ) -> BlockOutput:
        """Blocks of ``slots`` masks at every anchor of each row (see the module docstring).

        input_ids [B, T]; aux [B, T, n_aux*H]; anchors [B, A] long (-1: no anchor); position_ids / segment_ids
        [B, T] as in ``data.types.Batch`` (defaults: one sample per row). ``anchor_chunk``: run at most that many
        anchors per row at once (evaluation without gradients, whose every position is an anchor)."""
        b, t = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(t, device=dev).expand(b, t)
        if segment_ids is None:
            segment_ids = torch.ones(b, t, dtype=torch.long, device=dev)
        ctx = self.context_kv(aux, position_ids)
        valid = anchors >= 0
        a_c = anchors.clamp(min=0)
        rows = torch.arange(b, device=dev)[:, None]
        steps = torch.arange(slots + 1, device=dev)
        ids = torch.full((*anchors.shape, slots + 1), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[..., 0] = input_ids[rows, a_c]
        pos = position_ids[rows, a_c][..., None] + steps  # [B, A, S]
        seg = segment_ids[rows, a_c]  # [B, A]
        keys = torch.arange(t, device=dev)
        ctx_mask = (keys[None, None] < a_c[..., None]) & (segment_ids[:, None, :] == seg[..., None])
        ctx_mask &= valid[..., None]
        n = anchors.shape[1]
        step = anchor_chunk or max(n, 1)
        parts = [
            self.blocks(ids[:, i : i + step], pos[:, i : i + step], ctx, ctx_mask[:, i : i + step])
            for i in range(0, n, step)
        ]
        hidden = torch.cat(parts, dim=1) if parts else aux.new_zeros(b, 0, slots + 1, self.config.hidden_size)
        return BlockOutput(hidden=hidden, valid=valid)

    # -- the bundled loop --------------------------------------------------------------------------------------
    def draft_block(
        self, token: torch.Tensor, position: int, ctx: list[tuple[torch.Tensor, torch.Tensor]], k: int
    ) -> torch.Tensor:
        """One block ``[token, mask x k]`` at ``position ..`` over the whole context ``ctx`` (keys [1, kv, L, d]):
        the draft logits [k, draft_vocab] of slots 1..k."""
        dev = token.device
        ids = torch.full((1, 1, k + 1), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0, 0] = token.reshape(())
        pos = (position + torch.arange(k + 1, device=dev)).view(1, 1, k + 1)
        mask = torch.ones(1, 1, ctx[0][0].shape[2], dtype=torch.bool, device=dev)
        return self.logits(self.blocks(ids, pos, ctx, mask)[0, 0, 1:])


def mask_embedding_file(drafter: DFlashDrafter, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """What vLLM reads from ``mask_embedding.pt``: ``{"embedding": [H], "mask_token_id": id}`` (``dtype``: the
    export's, so the served value is the one the rest of the export rounds to)."""
    return {
        "embedding": drafter.mask_embedding.detach().to("cpu", dtype).clone(),
        "mask_token_id": int(drafter.config.mask_token_id),
    }


__all__ = [
    "FAMILY",
    "BlockOutput",
    "DFlashConfig",
    "DFlashDrafter",
    "block_attention",
    "is_dflash_config",
    "mask_embedding_file",
]
