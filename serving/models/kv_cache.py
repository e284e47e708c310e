"""Static, position-indexed KV caches.

Design decisions:
- One preallocated buffer per layer, ``[B, heads, max_len, dim]``; a forward writes its new keys/values at
  explicit *slots* and attends over the first ``kv_len`` slots, with visibility decided by the mask the caller
  passes. Rolling back a rejected draft is therefore just not advancing ``length``; keeping the accepted path of
  a tree is one gather (:meth:`SlotCache.keep`).
- The buffers store whatever the attention module hands to ``Cache.update``: full keys/values for MHA/GQA
  models, the compressed latents for transformers' MLA implementation (DeepSeek-V3, Kimi-K2). No
  per-architecture cache surgery is needed.
- ``full_reads`` makes every forward read the whole capacity instead of ``[0, kv_len)``: row-exact attention
  (:mod:`eyas.serving.models.exact_attention`) needs the same key length in every forward.
- The same class serves the target (as a transformers ``Cache``) and the drafter (which calls
  :meth:`SlotCache.update` directly).
- :meth:`SlotCache.clone` copies a filled cache whole (capacity, committed length, every slot, the unwritten
  zeros included), so a prefill shared by several generations (:class:`serving.loop.PrefillMemo`) continues
  bit for bit as a fresh one would, also under row-exact attention, which reads the whole capacity.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One layer's buffers; writes land at the slots the owning cache was told about."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        n = self.owner.max_len
        self.keys = key_states.new_zeros((b, h, n, dk))
        self.values = value_states.new_zeros((b, value_states.shape[1], n, dv))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner._write_slots
        if slots is None:
            raise RuntimeError("SlotCache.prepare(...) must be called before each forward")
        if slots.shape[0] != key_states.shape[-2]:
            raise ValueError(f"{slots.shape[0]} write slots for {key_states.shape[-2]} new tokens")
        self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
        if self.owner.full_reads:
            return self.keys, self.values
        kv_len = self.owner._kv_len
        return self.keys[:, :, :kv_len], self.values[:, :, :kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_len

    def reset(self) -> None:
        pass


class SlotCache(Cache):
    """KV cache with explicit write slots; usable as a transformers ``Cache`` and by the drafter.

    Protocol, per forward: ``prepare(slots, kv_len)`` → model forward (every layer writes at ``slots`` and reads
    ``[0, kv_len)``) → :meth:`commit` what to keep: ``commit(n)`` makes the rows written at ``[length, length +
    n)`` part of the context, ``commit(path=...)`` first moves a tree's accepted nodes there. Whatever is not
    committed is rolled back by never being read again.
    """

    def __init__(self, num_layers: int, max_len: int):
        self.max_len = int(max_len)
        self.length = 0  # committed tokens: slots [0, length) hold the accepted context
        self._write_slots: torch.Tensor | None = None
        self._kv_len = 0
        self.full_reads = False  # hand attention every slot (the caller's mask covers the unwritten ones)
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    # transformers asks for this when it builds masks or positions itself; eyas always passes both.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def prepare(self, slots: torch.Tensor, kv_len: int | None = None) -> None:
        """Declare where the next forward's tokens go (``slots``: LongTensor [q]) and how far it may read."""
        slots = slots.reshape(-1).long()
        top = int(slots.max()) + 1 if slots.numel() else self.length
        kv_len = max(top, self.length) if kv_len is None else int(kv_len)
        if kv_len > self.max_len:
            raise ValueError(
                f"context of {kv_len} tokens exceeds this cache's max_len={self.max_len}; "
                "start a cache with a larger max_len (or shorten the prompt)"
            )
        self._write_slots = slots
        self._kv_len = kv_len

    @torch.no_grad()
    def commit(self, n: int | None = None, *, path: torch.Tensor | None = None) -> None:
        """Extend the committed context after a forward: by the ``n`` rows it wrote at ``[length, length + n)``,
        or by the tree nodes ``path`` (indices from ``length``, as written by a tree forward), which are first
        moved to ``[length, length + len(path))``."""
        if (n is None) == (path is None):
            raise ValueError("SlotCache.commit takes n or path, not both")
        if path is not None:
            n = path.numel()
            self.keep(self.length + path.reshape(-1), self.length)
        if n < 0 or self.length + n > self._kv_len:
            raise ValueError(
                f"cannot commit {n} rows at {self.length}: the last forward wrote up to {self._kv_len}"
            )
        self.length += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    @torch.no_grad()
    def keep(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy the entries at ``src_slots`` to ``[dst_start, dst_start + n)`` in every layer (tree path keep)."""
        src = src_slots.reshape(-1).long()
        n = src.numel()
        if n == 0:
            return
        dst = torch.arange(dst_start, dst_start + n, device=src.device)
        if torch.equal(src.cpu(), dst.cpu()):
            return
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            s = src.to(layer.keys.device)
            d = dst.to(layer.keys.device)
            layer.keys.index_copy_(2, d, layer.keys.index_select(2, s))
            layer.values.index_copy_(2, d, layer.values.index_select(2, s))

    @torch.no_grad()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (e.g. drop finished sequences from a batched generation)."""
        for layer in self.layers:
            if layer.is_initialized:
                idx = rows.to(layer.keys.device)
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)

    @torch.no_grad()
    def clone(self) -> SlotCache:
        """An independent copy with the same capacity, committed length and buffers (every slot, written or not)."""
        out = SlotCache(len(self.layers), self.max_len)
        out.length, out._kv_len = self.length, self._kv_len
        for src, dst in zip(self.layers, out.layers):
            if src.is_initialized:
                dst.keys, dst.values = src.keys.clone(), src.values.clone()
                dst.device, dst.is_initialized = src.device, True
        return out

    def reset(self) -> None:
        self.length = 0
        self._write_slots = None
        self._kv_len = 0
