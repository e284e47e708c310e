"""Narrow storage formats for the feature store's aux hidden states: fp8 e4m3 and int4, with their error bounds.

Design decisions:
- fp8 (e4m3, the ``float8_e4m3fn`` of torch / safetensors ``F8_E4M3``) uses one scale per *row group*: per token
  and per aux layer, so one outlier layer cannot flatten the others. ``q = x / s`` with ``s >= amax / 448``.
- int4 is symmetric, group-wise along the hidden dimension (``group_size`` values share a scale), codes in
  ``[-7, 7]`` stored as ``code + 8`` in a nibble, two per byte: element ``2i`` in the low nibble, ``2i + 1`` in
  the high one.
- Scales are bf16 (fp32's range at half the bytes) and rounded *up* to the next bf16 value, so ``x / s`` never
  exceeds the code range: nothing is clipped and the bounds below hold with the stored scale.
- An all-zero group gets scale 1 (its codes are 0), never a division by zero.

Error bounds (``s`` the stored scale, round to nearest):
- fp8 e4m3: ``|x - x̂| <= max(|x| * 2**-4, s * 2**-10)`` (3 mantissa bits; subnormal step ``2**-9``).
- int4: ``|x - x̂| <= s / 2``.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
INT4_MAX = 7
"""Symmetric int4 codes lie in [-INT4_MAX, INT4_MAX]."""


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """``x`` (positive, finite, fp32) rounded to the nearest bf16 value that is >= x."""
    y = x.float().to(torch.bfloat16)
    low = y.float() < x.float()
    bits = y.view(torch.int16)  # positive bf16: the next larger value is the next bit pattern
    return torch.where(low, bits + 1, bits).view(torch.bfloat16)


def _scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    s = amax.float() / qmax
    s = torch.where(amax > 0, s, torch.ones_like(s))
    return bf16_round_up(s)


def quantize_fp8(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n, D] -> (codes [n, D] float8_e4m3fn, scales [n, num_groups] bf16); D splits into equal groups."""
    n, d = x.shape
    if d % num_groups:
        raise ValueError(f"fp8: width {d} does not split into {num_groups} equal groups")
    xg = x.view(n, num_groups, d // num_groups)  # [n, G, D/G]
    scale = _scales(xg.abs().amax(dim=-1), FP8_MAX)  # [n, G]
    q = torch.div(xg, scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, d), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: [n, D] in ``dtype``."""
    n, d = q.shape
    g = scale.shape[-1]
    x = q.view(n, g, d // g).float() * scale.float()[..., None]  # [n, G, D/G]
    return x.view(n, d).to(dtype)


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [n, D] -> (packed [n, D/2] uint8, scales [n, D/group_size] bf16)."""
    n, d = x.shape
    if group_size % 2 or d % group_size:
        raise ValueError(f"int4: group size {group_size} must be even and divide the width {d}")
    xg = x.view(n, d // group_size, group_size)  # [n, G, g]
    scale = _scales(xg.abs().amax(dim=-1), INT4_MAX)  # [n, G]
    codes = torch.div(xg, scale.float()[..., None]).round_().clamp_(-INT4_MAX, INT4_MAX).add_(8)
    codes = codes.to(torch.uint8).view(n, d // 2, 2)  # [n, D/2, 2], codes in 1..15
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [n, D/2]
    return packed, scale


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: [n, D] in ``dtype``."""
    n, half = packed.shape
    d = 2 * half
    g = scale.shape[-1]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, d)  # [n, D] interleaved back
    x = (codes.to(torch.int16) - 8).float().view(n, g, d // g) * scale.float()[..., None]  # [n, G, D/G]
    return x.view(n, d).to(dtype)
