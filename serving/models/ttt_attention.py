"""Training-time-test attention in memory linear in the row length.

At unroll step ``j`` the row of chain ``t`` attends to the step-0 keys ``s <= t`` of its own packed sample (the
causal prefix) plus its own keys of steps ``1..j`` (the "diagonal"); padding rows (segment 0) see only
themselves. Written as one dense mask this is ``[B, T, T]`` per step, and the scores ``[B, h, T, T]`` in fp32:
at 8k-token rows that is 2.4 GB of scores per head group per step, kept for the backward.

Design decisions:
- Queries are processed in blocks of ``block`` rows. A block's keys are the step-0 keys from the earliest
  sample start among its rows up to its last row (causal: nothing later is ever visible), followed by the
  block's own diagonal keys of steps ``1..j``; its mask is built from segment ids and indices for that block
  only (the index form). Nothing of size ``T x T`` exists at any time for a long row.
- A short row (:data:`DENSE_MAX_SCORES`) skips the blocks: one fused call at step 0 and the dense form after
  it, whose ``T x T`` scores are small there and faster than many small calls.
- Each block runs the fused ``scaled_dot_product_attention`` kernel and, when gradients are needed for a long
  row (:data:`CHECKPOINT_MIN_SCORES`), sits under activation checkpointing: the backward recomputes one block at
  a time, so what the unroll keeps between forward and backward is q/k/v and the outputs (linear in T), not the
  attention probabilities. Shorter rows keep what each block made: recomputing it would cost more time than
  keeping it costs memory.
- The diagonal is appended as ``j * block`` extra key columns with a block-diagonal mask. That wastes
  ``j * block`` columns per block (small next to the causal prefix) and keeps one kernel call per block.
- :func:`dense_ttt_attention` is the reference (the whole mask at once); tests check the two agree in values
  and gradients.
- A sliding window (``window``, :attr:`serving.models.drafter.DrafterConfig.attention_window`) is by position, as
  the cached forward and vLLM apply it: the step-``j`` row of chain ``t`` sits at position ``t + j`` and sees
  the keys at positions ``> t + j - window``, so step-0 key ``s`` iff ``t - s < window - j`` and its own step-``i``
  key iff ``j - i < window``. A block then reads at most ``window + block`` step-0 keys: cost and memory linear in
  T for a fixed window. ``window=None`` runs exactly the full-attention code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_BLOCK = 128
"""Query rows per block: large enough for efficient kernels, small enough that ``block x T`` scores are cheap."""

DENSE_MAX_SCORES = 1 << 22
"""Rows whose scores (``B * heads * T * T``) fit in this many elements (up to ~680 tokens of a 9-head drafter) run
as one call over the whole row instead of blocks: 512-token rows train ~12% faster that way (``eyas.lab.bench_train``
on 2 CPU cores), while at 1,024 tokens the blocks are 2.5x faster than the dense form."""

CHECKPOINT_MIN_SCORES = 1 << 24
"""Checkpoint the blocks only when one step's scores (``B * heads * T * T``) exceed this many elements (64 MiB in
fp32, ~1.4k-token rows of a 9-head drafter). Below it the backward keeps what each block made (its mask and
concatenated keys; the fused kernel keeps no probabilities) instead of running the block again: that
recomputation cost 25% of the attention's time at 512 tokens (273 against 206 ms, ``eyas.lab.bench_train
bench_train.attention=[block]``), and what is kept stays small at these lengths."""


def segment_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the first row of each row's sample (a padding row starts at itself)."""
    b, t = segment_ids.shape
    idx = torch.arange(t, device=segment_ids.device).expand(b, t)
    new = torch.ones_like(segment_ids, dtype=torch.bool)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    new |= segment_ids == 0
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=1).values


def step0_visibility(
    segment_ids: torch.Tensor, rows: slice, cols: slice, reach: int | None = None
) -> torch.Tensor:
    """[B, 1, len(rows), len(cols)] bool: may query row ``rows[i]`` see step-0 key ``cols[k]``; ``reach``: only
    keys fewer than ``reach`` rows back (a sliding window at unroll step j: ``window - j``; None: all)."""
    dev = segment_ids.device
    r = torch.arange(rows.start, rows.stop, device=dev)
    c = torch.arange(cols.start, cols.stop, device=dev)
    sr, sc = segment_ids[:, rows], segment_ids[:, cols]
    same = (sr[:, :, None] == sc[:, None, :]) & (sr[:, :, None] > 0)  # [B, q, k]
    causal = r[:, None] >= c[None, :]
    eye = r[:, None] == c[None, :]  # padding rows see themselves: no row is fully masked (no NaN)
    if reach is not None:
        causal = causal & (r[:, None] - c[None, :] < reach)
        eye = eye & (sr[:, :, None] == 0)  # a real row's own key may lie outside a window shorter than j
    return ((same & causal) | eye)[:, None]


def _block(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: torch.Tensor | None,
    diag_v: torch.Tensor | None,
    segment_ids: torch.Tensor,
    rows: tuple[int, int, int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Query rows ``a..e`` (``rows = (a, e, lo)``) over step-0 keys ``lo..e`` and their own diagonal keys.

    Everything larger than the inputs (the block's mask, the concatenated keys) is made here, inside the
    checkpointed region, so none of it outlives the block."""
    a, e, lo = rows
    b, h, _, d = q.shape
    kvh = k0.shape[1]
    n = e - a
    j = 0 if diag_k is None else diag_k.shape[3]  # the unroll step
    reach = None if window is None else window - j
    mask = step0_visibility(segment_ids, slice(a, e), slice(lo, e), reach)  # [B, 1, n, e - lo]
    k, v = k0[:, :, lo:e], v0[:, :, lo:e]
    if diag_k is not None:
        # the block's own rows of steps 1..j as n*j extra columns, each visible only to its own row
        k = torch.cat([k, diag_k[:, :, a:e].reshape(b, kvh, n * j, d)], dim=2)
        v = torch.cat([v, diag_v[:, :, a:e].reshape(b, kvh, n * j, d)], dim=2)
        own = torch.eye(n, dtype=torch.bool, device=q.device).repeat_interleave(j, dim=1)  # [n, n*j]
        if window is not None:  # step i's key sits j - i positions back
            own = own & (j - 1 - torch.arange(j, device=q.device) < window).repeat(n)
        mask = torch.cat([mask, own.expand(b, 1, n, n * j)], dim=-1)
    return F.scaled_dot_product_attention(
        q[:, :, a:e], k, v, attn_mask=mask, scale=scale, enable_gqa=h != kvh
    )


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    segment_ids: torch.Tensor,
    scale: float,
    block: int = DEFAULT_BLOCK,
    starts: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one unroll step, block by block (see the module docstring).

    q: [B, h, T, d]; k0/v0: [B, kv, T, d] step-0 keys/values; keys/values: the diagonal of steps 1..j, each
    [B, kv, T, d] (empty at step 0); segment_ids: [B, T] (0 = padding); starts: :func:`segment_starts` of
    ``segment_ids`` (computed when not given); window: the drafter's sliding window (None: full attention).
    Returns [B, h, T, d].
    """
    t = q.shape[2]
    scores = q.shape[0] * q.shape[1] * t * t  # one step's score count: which path this row takes
    if scores <= DENSE_MAX_SCORES:
        # a short row: one call over the whole row (the fused kernel at step 0, the dense reference with the
        # diagonal after it) is faster than blocks
        if keys:
            return dense_ttt_attention(q, k0, v0, keys, values, segment_ids, scale, window=window)
        block = t
    if starts is None:
        starts = segment_starts(segment_ids)
    # starts never decrease along a row: a block's earliest visible key is the earliest start of its first row
    first = starts[:, ::block].min(dim=0).values.tolist()
    if window is not None:  # nor, with a window, anything more than window - j - 1 rows before its first row
        first = [max(f, min(a, a - (window - len(keys)) + 1)) for f, a in zip(first, range(0, t, block))]
    diag_k = torch.stack(keys, dim=3) if keys else None  # [B, kv, T, j, d]
    diag_v = torch.stack(values, dim=3) if values else None
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k0, v0, *keys, *values))
    ckpt = grad and scores > CHECKPOINT_MIN_SCORES  # recompute only what is large
    outs = []
    for i, a in enumerate(range(0, t, block)):
        args = (q, k0, v0, diag_k, diag_v, segment_ids, (a, min(a + block, t), first[i]), scale, window)
        outs.append(checkpoint(_block, *args, use_reentrant=False) if ckpt else _block(*args))
    return torch.cat(outs, dim=2)


def dense_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    segment_ids: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The reference: the same attention with the whole ``[B, T, T + jT]`` mask and fp32 scores at once."""
    b, h, t, d = q.shape
    kvh = k0.shape[1]
    g = h // kvh
    qg = q.view(b, kvh, g, t, d)  # heads grouped by their kv head
    acc = torch.promote_types(q.dtype, torch.float32)
    j = len(keys)
    reach = None if window is None else window - j
    mask = step0_visibility(segment_ids, slice(0, t), slice(0, t), reach)  # [B, 1, T, T]
    s_main = torch.einsum("bkgtd,bksd->bkgts", qg, k0).to(acc) * scale  # [B, kv, g, T, T]
    s_main = s_main.masked_fill(~mask[:, :, None], float("-inf"))
    if not keys:
        p = torch.softmax(s_main, dim=-1).to(q.dtype)
        return torch.einsum("bkgts,bksd->bkgtd", p, v0).reshape(b, h, t, d)
    s_diag = torch.stack([(qg * k[:, :, None]).sum(-1) for k in keys], dim=-1).to(acc) * scale  # [B,kv,g,T,j]
    if window is not None:  # step i (1..j) is j - i positions back
        s_diag = s_diag.masked_fill(j - 1 - torch.arange(j, device=q.device) >= window, float("-inf"))
    p = torch.softmax(torch.cat([s_main, s_diag], dim=-1), dim=-1)
    p_main, p_diag = p[..., :t].to(q.dtype), p[..., t:].to(q.dtype)
    o = torch.einsum("bkgts,bksd->bkgtd", p_main, v0)
    vd = torch.stack(values, dim=-2)  # [B, kv, T, j, d]
    o = o + torch.einsum("bkgtj,bktjd->bkgtd", p_diag, vd)
    return o.reshape(b, h, t, d)
