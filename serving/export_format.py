"""The export format both sides share: file names, the tensors an export holds, and their checks.

Design decisions:
- Writing an export (:mod:`eyas.serving.export`) and reading one (:mod:`eyas.serving.load`) are two modules; what
  both must agree on lives here, below both, so neither imports the other's internals.
- Tensor names are eyas's (= SGLang's ``midlayer.*``); the speculators format's ``layers.0.*`` names are mapped at
  the file boundary (:func:`to_speculators_name`, :func:`from_speculators_name`).
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.serving.models.drafter import DrafterConfig
from eyas.serving.target_record import EXPORT_SIDECAR

FORMATS = ("sglang", "speculators")
SPECULATORS_ARCH = "Eagle3Speculator"
EYAS_SIDECAR = EXPORT_SIDECAR
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MASK_EMBEDDING = "mask_embedding.pt"
"""A DFlash export's learned mask embedding (what vLLM's ``DFlashQwen3ForCausalLM`` reads)."""
EXPORT_FILES = frozenset({CONFIG, WEIGHTS, EYAS_SIDECAR, MASK_EMBEDDING})
"""What an export directory holds (a DFlash one also its mask embedding): ``overwrite`` replaces a directory holding
these (sidecar included) only."""
EMBED = "embed_tokens.weight"

EAGLE31_KEYS = ("norm_before_fc", "fc_norm", "norm_output")
"""Config keys of the EAGLE-3.1 options, as vLLM reads them (``DrafterConfig`` fields of the same names; missing = off)."""


class ExportError(ValueError):
    """A drafter, target description or directory that would give a checkpoint servers mis-load."""


def expected_tensors(
    cfg: DrafterConfig, include_embedding: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Names (eyas/SGLang naming) and shapes of the tensors an export holds; dtype None = any floating type."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((h, cfg.fc_in_features), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, q), None),
        "midlayer.mlp.gate_proj.weight": ((cfg.intermediate_size, h), None),
        "midlayer.mlp.up_proj.weight": ((cfg.intermediate_size, h), None),
        "midlayer.mlp.down_proj.weight": ((h, cfg.intermediate_size), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, h), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }
    if cfg.parallel_drafting:
        out["mask_hidden"] = ((cfg.fc_in_features,), None)
    if cfg.norm_before_fc:
        out["input_norm.weight"] = ((cfg.fc_in_features,), None)
    if cfg.fc_norm:
        for i in range(len(cfg.aux_layer_ids)):
            out[f"fc_norm.{i}.weight"] = ((int(cfg.target_hidden_size),), None)
    if include_embedding:
        out[EMBED] = ((cfg.vocab_size, h), None)
    return out


def check_tensors(
    tensors: dict[str, torch.Tensor], cfg: DrafterConfig, include_embedding: bool, where: str = "drafter"
) -> list[str]:
    """Problems (missing/extra keys, shapes, dtypes, non-finite values, vocab map) of a tensor set; [] if none."""
    problems: list[str] = []
    expected = expected_tensors(cfg, include_embedding)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"{where}: missing tensors {missing}")
    if extra:
        problems.append(f"{where}: unexpected tensors {extra}")
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(f"{where}: {name} has shape {tuple(t.shape)}, the config implies {shape}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{where}: {name} is {t.dtype}, must be {dtype}")
        if dtype is None and not t.is_floating_point():
            problems.append(f"{where}: {name} is {t.dtype}, must be floating point")
        elif dtype is None and not bool(torch.isfinite(t).all()):
            problems.append(f"{where}: {name} holds NaN or Inf values")
    return problems + _check_vocab_map(tensors.get("d2t"), tensors.get("t2d"), cfg, where)


def _check_vocab_map(d2t, t2d, cfg: DrafterConfig, where: str) -> list[str]:
    if d2t is None or t2d is None or d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return []
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        return []
    ids = d2t + torch.arange(d2t.numel())  # target id of each draft id (SGLang's hot_token_id)
    problems = []
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        bad = int(((ids < 0) | (ids >= cfg.vocab_size)).sum())
        problems.append(
            f"{where}: d2t maps {bad} draft ids outside the target vocabulary [0, {cfg.vocab_size})"
        )
        return problems
    if ids.unique().numel() != ids.numel():
        problems.append(
            f"{where}: d2t maps {ids.numel() - ids.unique().numel()} draft ids onto target ids "
            "already taken (target_id = draft_id + d2t[draft_id] must be distinct)"
        )
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[ids].all()):
        problems.append(
            f"{where}: t2d (marks {int(t2d.sum())} target ids) disagrees with d2t + arange "
            f"({cfg.draft_vocab_size} draft ids)"
        )
    return problems


def clean_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """transformers-v5 style: ``rope_type`` (never the legacy ``type``), no None values."""
    out = {k: v for k, v in rope.items() if v is not None and k != "type"}
    out.setdefault("rope_type", rope.get("type", "default"))
    return out


def to_speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def from_speculators_name(name: str) -> str:
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name
