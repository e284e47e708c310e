"""The EAGLE-3 drafter: one module for inference (KV cache, chains and trees) and training (TTT unroll).

Design decisions:
- Parameter names are SGLang's ``LlamaForCausalLMEagle3`` names (``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``), so export is a filter over ``state_dict()`` and nothing is renamed.
- A *row* is one drafter input: ``(hidden, token)``. Context row ``r`` carries ``fc(aux_r)`` (the target's fused
  features after reading ``x_0..x_r``) and the embedding of ``x_{r+1}``, sits at position ``r``, and predicts
  ``x_{r+2}``. Draft step ``j`` after a context ending at ``n`` is a row at position ``n + j`` whose hidden is the
  previous row's output (pre-norm) and whose token is the previous draft. This is what SGLang runs.
- Training-time test reproduces exactly that at every position of a sequence at once: at unroll step ``j`` the
  row of chain ``t`` attends to the step-0 rows ``<= t`` (causal, same segment) plus its own rows of steps
  ``1..j`` (the "diagonal"), with rope position ``t + j``. ``tests`` check that it equals the cached path.
- Block: ``r = h + attn(cat(input_layernorm(e), hidden_norm(h)))``; ``out = r + mlp(post_attention_layernorm(r))``;
  ``logits = lm_head(norm(out))``; ``out`` (pre-norm) feeds the next step.
- EAGLE-3.1 options (:class:`DrafterConfig`, off by default, arXiv 2605.09992), as vLLM 0.32's
  ``Eagle3LlamaForCausalLM`` runs them: ``fc_norm`` normalises each aux state on its own (``fc_norm.{i}``)
  before ``fc``; ``norm_output`` feeds ``norm(out)`` (post-norm) to the next step instead of ``out``, so the
  state passed between steps keeps one scale however deep the chain (the logits, ``lm_head(norm(out))``, are
  unchanged). ``norm_before_fc`` (one RMSNorm over the concatenated aux states, ``input_norm``; speculators'
  gpt-oss option) runs before ``fc_norm`` when both are on. Training and the bundled loop go through the same
  :meth:`Eagle3Drafter.fuse` and :meth:`Eagle3Drafter.step_output`, so they cannot diverge.
- Parallel drafting (P-EAGLE, arXiv 2602.01469; ``DrafterConfig.parallel_drafting``), as vLLM 0.32 serves it:
  draft depths 1..K-1 are *mask rows* appended after the context in the same forward: token
  ``mask_token_id``, aux ``mask_hidden`` (a learned vector as wide as the aux states, fused by ``fc`` like a
  context row's), positions continuing the context's. A mask row attends to the context and the mask rows before
  it and reads nothing of the drafts before it, so K drafts cost one drafter forward. Training is the TTT unroll
  with step j >= 1's rows made mask rows (same attention pattern: step 0's causal prefix plus the diagonal).
- Draft vocabulary maps: ``target_id = draft_id + d2t[draft_id]``; ``t2d[target_id]`` is True for draft tokens.
- The embedding is the target's, frozen, and not part of what training updates or export writes.
- ``attention_window`` (None: full attention) is a sliding window by position, the same in the cached forward
  (:func:`window_mask`, key slot i taken as position i), in the TTT unroll (:mod:`serving.models.ttt_attention`)
  and in the export (``layer_types`` / ``sliding_window``, what vLLM reads): a row at position p sees the keys at
  positions ``> p - window``. It bounds the drafter's cost per step at long context as well as its drift. The
  cached forward takes a window of its own (``attention_window=``), so one drafter's weights serve several
  windows side by side (:class:`serving.proposers.Eagle3ProposerConfig`) without a copy or a config change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.serving.models.kv_cache import SlotCache
from eyas.serving.models.layers import MLP, RMSNorm, Rotary, TargetVocabulary, apply_rope, rope_parameters_of
from eyas.serving.models.target import aux_layer_problem
from eyas.serving.models.ttt_attention import segment_starts, ttt_attention

if TYPE_CHECKING:
    from eyas.serving.models.dflash import DFlashDrafter

WEIGHTS_FILE = "drafter.safetensors"
"""Trainable weights of a drafter checkpoint (everything but the frozen target embedding)."""
CONFIG_FILE = "drafter_config.json"
"""Its :class:`DrafterConfig`."""


@dataclass
class DrafterConfig:
    """Sizes and conventions of an EAGLE-3 drafter; built from the target's config by :meth:`from_target`."""

    hidden_size: int
    """Model width; equals the target's hidden size (the drafter reads the target's embeddings)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """The target's vocabulary size."""
    draft_vocab_size: int
    """Size of the reduced output vocabulary (the N most frequent loss-masked target tokens)."""
    aux_layer_ids: list[int]
    """Target layers whose outputs are fused (SGLang convention: output of decoder layer i); strictly increasing,
    at most L-2 for an L-layer target (``serving.target.AUX_RULE``)."""
    max_position_embeddings: int
    """The target's; never smaller than the contexts the drafter will serve."""
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    """transformers-style rope settings copied from the target (``rope_type``, ``rope_theta``, YaRN factors...)."""
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    embed_scale: float = 1.0
    """Multiplier the target applies to its input embeddings (sqrt(H) for Gemma, 1 elsewhere)."""
    target_hidden_size: int | None = None
    """Width of each aux state (defaults to ``hidden_size``)."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per aux layer (``fc_norm.{i}.weight``, ``target_hidden_size`` wide) on each aux state
    before ``fc``, so no aux layer's scale dominates the fused input (vLLM reads ``fc_norm`` from the config)."""
    norm_output: bool = False
    """EAGLE-3.1: each draft step's output state (the next step's hidden input, and what the head reads) is
    ``norm(out)`` instead of the pre-norm ``out``, against the scale drifting along the chain (vLLM:
    ``norm_output``; no new weight, ``norm`` is the one the head always read through)."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux states before ``fc`` (``input_norm.weight``, ``n_aux *
    target_hidden_size`` wide; vLLM and speculators: ``norm_before_fc``). Applied before ``fc_norm``."""
    parallel_drafting: bool = False
    """P-EAGLE: draft depths 1..K-1 are mask rows drafted in the context's own forward (module docstring); the
    learned aux vector is the ``mask_hidden`` weight (vLLM: ``parallel_drafting`` in the speculative config)."""
    mask_token_id: int | None = None
    """``parallel_drafting``: the target token id a mask row carries (vLLM: ``mask_token_id``)."""
    attention_window: int | None = None
    """Sliding window of the drafter's attention in tokens: a row at position p attends to keys at positions
    ``> p - attention_window`` (itself included), as vLLM's ``sliding_window`` does. None: full attention."""

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.attention_window is not None:
            self.attention_window = int(self.attention_window)
            if self.attention_window < 1:
                raise ValueError(
                    f"drafter attention_window must be a positive token count or None (full attention), "
                    f"not {self.attention_window}"
                )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} is larger than the target vocabulary ({self.vocab_size})"
            )
        if self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        problem = aux_layer_problem(self.aux_layer_ids)
        if problem:
            raise ValueError(f"drafter aux_layer_ids: {problem}")
        if "rope_type" not in self.rope_parameters:
            self.rope_parameters = {"rope_type": "default", **self.rope_parameters}
        if self.parallel_drafting and not (
            self.mask_token_id is not None and 0 <= int(self.mask_token_id) < self.vocab_size
        ):
            raise ValueError(
                f"parallel drafting needs mask_token_id, a target token id in [0, {self.vocab_size}), not "
                f"{self.mask_token_id!r}"
            )
        if self.mask_token_id is not None and not self.parallel_drafting:
            raise ValueError(
                "mask_token_id is the mask rows' token of parallel drafting; set it null without"
            )

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * int(self.target_hidden_size)

    @classmethod
    def from_target(cls, target_config, aux_layer_ids: list[int], draft_vocab_size: int, **overrides: Any):
        """Take sizes, rope and positions from a transformers config of the target (any architecture)."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = int(c.num_attention_heads)
        is_mla = getattr(c, "kv_lora_rank", None) is not None
        kv = heads if is_mla else int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = getattr(c, "head_dim", None)
        if is_mla:
            head_dim = getattr(c, "v_head_dim", None)
        head_dim = int(head_dim or c.hidden_size // heads)
        rope = rope_parameters_of(c)
        embed_scale = (
            math.sqrt(c.hidden_size) if str(getattr(c, "model_type", "")).startswith("gemma") else 1.0
        )
        values: dict[str, Any] = dict(
            hidden_size=int(c.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=int(getattr(c, "intermediate_size", None) or 4 * c.hidden_size),
            vocab_size=int(c.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            max_position_embeddings=int(c.max_position_embeddings),
            rope_parameters=rope,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            embed_scale=embed_scale,
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """All fields, but the off-by-default options (EAGLE-3.1's, parallel drafting's) only when on: checkpoints,
        identities and exports of drafters without them stay byte-identical to those from before the options."""
        d = asdict(self)
        for key in _OFF_BY_DEFAULT:
            if d[key] is None or d[key] is False:
                del d[key]
        return d


_OFF_BY_DEFAULT = (
    "fc_norm",
    "norm_output",
    "norm_before_fc",
    "parallel_drafting",
    "mask_token_id",
    "attention_window",
)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(2 * cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.scale = d**-0.5

    def qkv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, d]
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, h, q, d] over k/v [B, kv, s, d]; mask [B, 1, q, s] bool (True = may attend)."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.heads != self.kv_heads
        )


def window_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> tuple[torch.Tensor, int]:
    """``mask`` [B, 1, q, kv_len] (True = may attend) limited to keys at slots ``> position - window`` (key slot i
    taken as position i, as the drafter's cache lays out context rows and chain drafts; tree drafts sit at slots
    past their position and stay visible), and the first slot any query still sees: the keys before it can be
    skipped, which bounds the cost of a long context by the window."""
    slots = torch.arange(mask.shape[-1], device=mask.device)
    q_pos = position_ids[:, None, :, None]  # [B, 1, q, 1]
    lo = max(0, int(position_ids.min()) - window + 1)
    return mask & (slots > q_pos - window), min(lo, mask.shape[-1])


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        r = hidden + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The drafter block on rows ``(embeds, hidden)`` ([B, T, H] each): returns the pre-norm output [B, T, H].

        ``attend(q, k, v)`` ([B, h, T, d], [B, kv, T, d] x2, rope applied) returns the attention output
        [B, h, T, d]: over the KV cache at inference, over the step-0 and diagonal keys in the TTT unroll."""
        q, k, v = self.self_attn.qkv(self.attn_input(embeds, hidden), cos, sin)
        return self.finish(hidden, self.self_attn.out(attend(q, k, v)))


@dataclass
class DrafterOutput:
    """Result of a cached drafter forward."""

    hidden: torch.Tensor  # [B, q, H] the step output (Eagle3Drafter.step_output): next step's hidden input
    logits: torch.Tensor  # [B, q, draft_vocab] (fp32)


@dataclass
class TTTOutput:
    """Result of a training-time-test unroll over whole sequences.

    ``hidden[j]`` is the output of unroll step ``j`` ([B, T, H]; :meth:`Eagle3Drafter.step_output`); row ``t``
    of step ``j`` predicts ``x_{t+j+2}``. ``valid[j]`` ([B, T] bool) marks rows whose inputs lie inside their own
    sample. ``fused`` ([B, T, H]) is step 0's hidden input, ``fc`` of the target's aux states: what a context row
    at that position carries, and so what step ``j``'s output at row ``t`` stands in for at position
    ``t + j + 1``.
    """

    hidden: list[torch.Tensor]
    valid: list[torch.Tensor]
    fused: torch.Tensor | None = None


class Eagle3Drafter(TargetVocabulary):
    """See the module docstring."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        # EAGLE-3.1's norms exist only when on, so a drafter without them has exactly today's state_dict
        self.input_norm = RMSNorm(cfg.fc_in_features, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(int(cfg.target_hidden_size), cfg.rms_norm_eps) for _ in cfg.aux_layer_ids)
            if cfg.fc_norm
            else None
        )
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.init_vocabulary(cfg)
        # P-EAGLE's mask rows carry this learned aux vector (zeros to start, as vLLM's buffer before loading)
        self.mask_hidden = nn.Parameter(torch.zeros(cfg.fc_in_features)) if cfg.parallel_drafting else None

    # -- setup ------------------------------------------------------------------------------------------------
    # -- pieces -----------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(input_ids)
        return e * self.config.embed_scale if self.config.embed_scale != 1.0 else e

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the target's concatenated aux states: [..., n_aux * H] -> [..., H] (after ``input_norm``,
        then the per-layer ``fc_norm``, when those are on, in vLLM's order)."""
        if aux.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"aux states of width {aux.shape[-1]}; this drafter fuses {len(self.config.aux_layer_ids)} "
                f"aux layers of width {self.config.target_hidden_size} ({self.config.fc_in_features})"
            )
        x = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.chunk(len(self.fc_norm), dim=-1)  # [..., H_t] per aux layer
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def mask_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's ``n`` mask rows: their token ids [n] and aux states [n, n_aux * H] (fused like a context's)."""
        if self.mask_hidden is None:
            raise ValueError("mask rows belong to parallel drafting; this drafter drafts autoregressively")
        ids = torch.full(
            (n,), int(self.config.mask_token_id), dtype=torch.long, device=self.mask_hidden.device
        )
        return ids, self.mask_hidden.expand(n, -1)

    def step_output(self, out: torch.Tensor) -> torch.Tensor:
        """The state a draft step passes on (next step's hidden input, what :meth:`logits` reads) from the block's
        output: ``out`` itself, or ``norm(out)`` with ``norm_output``."""
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (fp32) from step outputs (:meth:`step_output`): ``lm_head(norm(out))`` either
        way (with ``norm_output`` the state is already ``norm(out)``)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden)).float()

    # -- inference --------------------------------------------------------------------------------------------
    def new_cache(self, max_len: int) -> SlotCache:
        return SlotCache(1, max_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        attention_mask: torch.Tensor,
        *,
        hidden_is_aux: bool,
        logits: str = "all",
        attention_window: int | None = None,
    ) -> DrafterOutput:
        """Rows ``(hidden, input_ids)`` at ``position_ids`` ([B, q]); keys/values written at the slots declared by
        ``cache.prepare``; ``attention_mask`` [B, 1, q, kv_len] bool (True = may attend).
        ``hidden_is_aux``: True for context rows, whose ``hidden`` is the target's aux states [B, q, n_aux * H]
        (fused by ``fc``); False for draft rows, whose ``hidden`` is this drafter's own output [B, q, H]. Said by
        the caller, not guessed from the width: with one aux layer both are H wide.
        ``logits``: ``all`` rows, or only the ``last`` one ([B, 1, draft_vocab]; context rows need no others).
        ``attention_window``: None reads ``config.attention_window``; 0 is full attention, n > 0 a window of n."""
        if hidden_is_aux:
            h = self.fuse(hidden)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"draft rows take the drafter's own output (width {self.config.hidden_size}), got width "
                f"{hidden.shape[-1]}; pass hidden_is_aux=True for the target's aux states"
            )
        else:
            h = hidden
        e = self.embed(input_ids).to(h.dtype)
        cos, sin = self.rotary(position_ids, h.dtype)
        attn = self.midlayer.self_attn
        window = self.config.attention_window if attention_window is None else (attention_window or None)
        lo = 0
        if window is not None:
            attention_mask, lo = window_mask(attention_mask, position_ids, window)
            attention_mask = attention_mask[..., lo:]

        def attend(q, k, v):
            k_all, v_all = cache.update(k, v, 0)  # [B, kv, kv_len, d]
            if lo:  # keys before every query's window: never read
                k_all, v_all = k_all[:, :, lo:], v_all[:, :, lo:]
            return attn.sdpa(q, k_all, v_all, attention_mask)

        out = self.step_output(self.midlayer(e, h, cos, sin, attend))
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', not {logits!r}")
        return DrafterOutput(hidden=out, logits=self.logits(out if logits == "all" else out[:, -1:]))

    # -- training ---------------------------------------------------------------------------------------------
    def forward_ttt(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> TTTOutput:
        """Unroll ``steps`` draft steps at every position (see module docstring).

        input_ids: [B, T] the sequence x; aux: [B, T, n_aux*H] target features at each position;
        position_ids: [B, T] (default 0..T-1; restart per packed sample); segment_ids: [B, T] int, 0 = padding
        (default: one sample per row, no padding). Attention runs block by block (``serving.ttt_attention``):
        memory linear in T, no ``[T, T]`` mask.
        """
        b, t = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(t, device=dev).expand(b, t)
        if segment_ids is None:
            segment_ids = torch.ones(b, t, dtype=torch.long, device=dev)
        attn = self.midlayer.self_attn
        window = self.config.attention_window
        rows = torch.arange(t, device=dev)
        starts = segment_starts(segment_ids)
        h = fused = self.fuse(aux)
        main: list[torch.Tensor] = []  # step 0's keys and values: the causal prefix every step reads
        keys: list[torch.Tensor] = []  # steps 1..j: each row sees only its own (the diagonal)
        values: list[torch.Tensor] = []

        def attend(q, k, v):
            if main:
                keys.append(k)
                values.append(v)
            else:
                main.extend((k, v))
            return ttt_attention(
                q, main[0], main[1], keys, values, segment_ids, attn.scale, starts=starts, window=window
            )

        hidden_out: list[torch.Tensor] = []
        valid_out: list[torch.Tensor] = []
        parallel = self.config.parallel_drafting
        if parallel and steps > 1:  # steps 1.. are mask rows: one token and one fused hidden for every row
            mask_tok = torch.full_like(input_ids, int(self.config.mask_token_id))
            mask_h = self.fuse(self.mask_hidden).to(h.dtype).expand(b, t, -1)  # [B, T, H]
        for j in range(steps):
            src = (rows + j + 1).clamp(max=t - 1)
            tok = input_ids[:, src]  # x_{t+j+1}
            if parallel and j > 0:  # P-EAGLE: what step j reads does not depend on the drafts before it
                tok, h = mask_tok, mask_h
            valid = (rows + j + 1 < t)[None, :] & (segment_ids[:, src] == segment_ids) & (segment_ids > 0)
            e = self.embed(tok).to(h.dtype)
            cos, sin = self.rotary(position_ids + j, h.dtype)
            h = self.step_output(self.midlayer(e, h, cos, sin, attend))
            hidden_out.append(h)
            valid_out.append(valid)
        return TTTOutput(hidden=hidden_out, valid=valid_out, fused=fused)


# -- trained checkpoints (the trainer's format; serving/export.py writes the SGLang/vLLM one) -----------------------
def save_drafter_weights(directory, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write ``weights`` (trainable tensors) and ``config`` (a ``DrafterConfig.to_dict()``) into ``directory``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True))


def is_drafter_checkpoint(directory) -> bool:
    from pathlib import Path

    return (Path(directory) / WEIGHTS_FILE).exists() and (Path(directory) / CONFIG_FILE).exists()


def load_trained_drafter(directory, embedding: torch.Tensor | None = None) -> Eagle3Drafter | DFlashDrafter:
    """A drafter from a trainer checkpoint directory (fp32, CPU): an EAGLE-3 one, or a DFlash one where its config
    says ``family: dflash``; ``embedding``: the target's input embedding table (the checkpoint does not hold it).
    A damaged or foreign file raises ``ValueError`` naming it."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_drafter_checkpoint(directory):
        raise FileNotFoundError(
            f"{directory} is not a drafter checkpoint (needs {WEIGHTS_FILE} and {CONFIG_FILE})"
        )
    fix = "use another checkpoint of the run (an earlier step_*, or best/), or train again"
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
        if raw.get("family") == "dflash":  # serving.models.dflash's FAMILY
            from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter

            config, make = DFlashConfig(**raw), DFlashDrafter
        else:
            config, make = DrafterConfig(**raw), Eagle3Drafter
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / CONFIG_FILE}: damaged (not valid JSON: {e}); {fix}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{directory / CONFIG_FILE}: {e}; {fix}") from None
    try:
        weights = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type, or OSError
        raise ValueError(
            f"{directory / WEIGHTS_FILE}: cannot be read ({type(e).__name__}: {e}): the file is damaged (truncated "
            f"or half copied); {fix}"
        ) from None
    drafter = make(config)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"{directory}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})"
        )
    if embedding is not None:
        try:
            drafter.set_embedding(embedding.detach().float().cpu())
        except ValueError as e:
            raise ValueError(f"{directory}: {e}: the checkpoint was trained for another target") from None
    return drafter.eval()
