"""Row-exact attention: every verified position computed bit for bit as one-token decoding computes it.

Design decisions:
- Why: greedy speculative decoding returns the target's own greedy text only if the target scores each verified
  position exactly as a one-token forward would. The stock kernels do not promise that: transformers' ``sdpa``
  path packs GQA heads for one query but repeats K/V for several, and PyTorch's CPU kernels (flash attention,
  oneDNN GEMMs) choose other blockings for other query counts and key lengths. In fp32 the differences are
  ~1e-7 and rarely flip an argmax; in bf16 they flip near-ties within a hundred tokens (the CPU demo in bf16:
  greedy match 0-25%). fp32 is no way out on a small CPU: its multi-token verify is compute-bound (7 tokens cost
  1.9x one token here, against 1.09x in bf16), which is not the regime speculative decoding is served in.
- How: with a KV cache, attention runs in blocks of :data:`BLOCK` query positions (the last block padded) over
  the cache's whole capacity (slots not yet written are masked), so decode and verify forwards run the same
  kernels on the same shapes, and a row's result depends only on its own query, its mask and the cache, never
  on how many rows came with it. Masked keys contribute exact zeros.
- Linear layers: a bf16 GEMM is not row-invariant on every CPU. On an AMD EPYC with AVX512-BF16 and no AMX, the
  embedded target's ``down_proj`` (a 1536-long reduction) gives a row of a 2-25-row product other bits than the
  same row alone, while every reduction of 576 (q/k/v/o, gate/up) and 768 was exact; on an Intel CPU with AMX all
  were. So this mode also splits every linear layer whose reduction is longer than :data:`LINEAR_K` into equal
  pieces of at most that length and adds the pieces' products in fp32 (:class:`RowExactLinear`): the same weights
  and FLOPs, one rounding to bf16 at the end. Norms and rotary embeddings are row-wise. None of this is assumed:
  :func:`eyas.serving.exactness.probe` compares verify rows with one-token forwards bit for bit, and evaluation uses this mode only
  where the probe passes (float32 otherwise).
- Forwards of more than :data:`MAX_ROWS` queries (prefill) use ``sdpa``: every method shares the same prefill.
- Scope: a chain (EAGLE-3 chains, prompt lookup, plain decoding) lays its path out at the slots decoding would
  use, so it is bit-exact. A tree's side branches sit at other slots, so their rows add the same terms in
  another order and can round differently: near-exact, not exact. Recomputing each such row in decoding's
  layout (its visible keys and values gathered, in order, to the front of a cache-sized buffer; its query alone
  in a block) was tried on 2026-12-05: bit-exact on the embedded target (random 8- and 13-node trees), but with
  R rows off the layout it costs R more blocks of attention and R copies of the layer's K/V: 4-8x the block's
  own attention per layer (+4 ms per layer at 800 slots, +25 ms at 2,000, on the AMX machine), more than a
  7-node tree saves. So trees stay near-exact; chains carry the exactness checks.
- Cost: decode attends over the whole cache (the loop sizes it to prompt + answer + draft room) and computes
  :data:`BLOCK` query rows; for the embedded target that is ~1 ms of a 40 ms step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT = "exact"
"""The ``attn_implementation`` name this module registers with transformers."""
BLOCK = 8
"""Query positions per attention block (chains up to K = 7 verify in one block)."""
MAX_ROWS = 64
"""Forwards with more query positions than this (prefill) go through ``sdpa``."""
LINEAR_K = 768
"""Longest reduction one GEMM runs in this mode; longer linear layers are split (:class:`RowExactLinear`)."""


_prepared: tuple[torch.Tensor, torch.Tensor] | None = None  # (the last bool mask, its additive block form)


def _additive_blocks(mask: torch.Tensor) -> torch.Tensor:
    """The bool mask [B, 1|H, M, S] (:meth:`Target.forward` pads it to the cache's capacity S) as an additive fp32
    mask [B, 1|H, blocks * BLOCK, S], rows padded to whole blocks (padded rows see everything: no empty softmax).
    Every layer of a forward gets the same mask, so the last one is kept."""
    global _prepared
    if _prepared is not None and _prepared[0] is mask:
        return _prepared[1]
    m = mask.shape[-2]
    pad = -(-m // BLOCK) * BLOCK - m
    full = F.pad(mask, (0, 0, 0, pad), value=True) if pad else mask
    additive = torch.zeros(full.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~full, float("-inf")
    )
    _prepared = (mask, additive)
    return additive


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [B, H, M, D], key/value [B, KVH, S, D]; returns [B, M, H, Dv]."""
    b, h, m, d = query.shape
    if (
        m > MAX_ROWS
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.dtype != torch.bool
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(
            "exact attention does not implement attention sinks; use attn_implementation=sdpa"
        )
    kvh, s, dv = key.shape[1], key.shape[2], value.shape[-1]
    g = h // kvh
    scale = d**-0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    mask = _additive_blocks(attention_mask)  # [B, 1|H, blocks * BLOCK, S]
    blocks = mask.shape[-2] // BLOCK
    mask = mask.view(mask.shape[0], 1, 1, -1, s) if mask.shape[1] == 1 else mask.view(b, kvh, g, -1, s)
    q = query.reshape(b, kvh, g, m, d)
    if blocks * BLOCK > m:
        q = F.pad(q, (0, 0, 0, blocks * BLOCK - m))
    keys_t = key.transpose(-1, -2)
    outs = []
    for i in range(blocks):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        scores = torch.matmul(q[:, :, :, rows].reshape(b, kvh, g * BLOCK, d), keys_t).float().mul_(scale)
        scores = scores.view(b, kvh, g, BLOCK, s)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.add_(mask[:, :, :, rows]), dim=-1).to(value.dtype)
        outs.append(torch.matmul(probs.view(b, kvh, g * BLOCK, s), value).view(b, kvh, g, BLOCK, dv))
    out = outs[0] if blocks == 1 else torch.cat(outs, dim=3)
    return out[:, :, :, :m].reshape(b, h, m, dv).transpose(1, 2).contiguous(), None


class RowExactLinear(nn.Module):
    """A linear layer computed as the fp32 sum of GEMMs over equal slices of its input features, each at most
    :data:`LINEAR_K` long, rounded once to the input's dtype. Same result as the layer up to that rounding, and
    row-invariant wherever the shorter GEMMs are (see the module docstring). Holds the slices instead of the
    weight; ``weight`` reassembles it (a copy) for code that reads it."""

    def __init__(self, linear: nn.Linear, max_k: int = LINEAR_K):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        pieces = -(-linear.in_features // max_k)
        w = linear.weight.detach()
        edges = [i * linear.in_features // pieces for i in range(pieces + 1)]
        self.bounds = list(zip(edges[:-1], edges[1:]))
        self.pieces = nn.ParameterList(
            nn.Parameter(w[:, a:b].contiguous(), requires_grad=False) for a, b in self.bounds
        )
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        )

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(list(self.pieces), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None
        for (a, b), w in zip(self.bounds, self.pieces):
            part = F.linear(x[..., a:b], w).float()
            y = part if y is None else y.add_(part)
        if self.bias is not None:
            y = y.add_(self.bias.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pieces={len(self.bounds)}"


def split_long_linears(model: nn.Module, max_k: int = LINEAR_K) -> int:
    """Replace, in place, every ``nn.Linear`` of ``model`` with more than ``max_k`` input features by a
    :class:`RowExactLinear`, except the output head (the target's frozen head shares its weight; the probe
    covers its rows too); returns how many were replaced."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features > max_k and child is not head:
                setattr(parent, name, RowExactLinear(child, max_k))
                n += 1
    return n


AttentionInterface.register(EXACT, exact_attention)
AttentionMaskInterface.register(EXACT, sdpa_mask)
