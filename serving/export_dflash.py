"""Export a DFlash block drafter as vLLM 0.32 serves it (method ``dflash``), and read one back.

Design decisions (read from vLLM 0.32's ``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``
and ``transformers_utils/configs/eagle.py``):
- ``config.json``: ``architectures: ["DFlashDraftModel"]`` (vLLM's registry name for ``DFlashQwen3ForCausalLM``;
  with method ``dflash`` a name without the prefix would get one), ``model_type: "qwen3"``, the drafter's sizes
  and ``num_hidden_layers``, the target's rope and positions, ``draft_vocab_size``, and ``dflash_config``:
  ``mask_token_id`` and ``target_layer_ids`` (eyas's aux ids, the output of layer i; vLLM adds 1). The
  top-level ``eagle_aux_hidden_state_layer_ids`` (capture ids, eyas's + 1), which vLLM reads first, says the same.
- Tensors, named as vLLM's loader maps them (no ``model.`` prefix): ``fc``, ``hidden_norm``, ``norm``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj`` / ``{q,k}_norm``, ``layers.{i}.mlp.*``, ``layers.{i}.*_layernorm``
  (eyas's own names: the export is a filter). vLLM leaves any tensor the file lacks at its initial values
  without a word, so every one is checked before writing. ``lm_head.weight`` is the frozen head of the draft
  vocabulary with ``d2t`` (vLLM scatters those logits to target ids, -inf elsewhere) when the draft vocabulary
  is smaller than the target's; with the whole vocabulary it is written in target order and without ``d2t``
  (vLLM has no parameter for it then). ``t2d`` is not written (vLLM skips it). The embedding is not written:
  vLLM shares the target's.
- The learned mask embedding goes to ``mask_embedding.pt`` as ``{"embedding": [H], "mask_token_id": id}``, what
  ``DFlashQwen3ForCausalLM._read_mask_embedding`` reads; vLLM then embeds the mask token with it, as the
  drafter does. The file holds it in the export's dtype (vLLM copies it into a parameter of the served dtype).
- vLLM serves it with ``--speculative-config '{"method": "dflash", "model": <dir>, "num_speculative_tokens":
  K}'`` (recorded in ``eyas_export.json``). Recent SGLang releases serve DFlash too (``--speculative-algorithm
  DFLASH``, written for z-lab's checkpoints, whose mask token keeps the target's own embedding row and whose head
  is the target's); whether SGLang reads this export's ``mask_embedding.pt`` and ``d2t`` is not verified (SGLang has
  no CPU build to test against), so no SGLang command is recorded.
- vLLM's CPU build normalises every layer's context keys with layer 0's ``k_norm``: an export of a deeper
  drafter is written (vLLM's GPU build serves it right) with a warning.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from eyas.serving.export_format import CONFIG, MASK_EMBEDDING, WEIGHTS, ExportError, clean_rope
from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter, mask_embedding_file

log = logging.getLogger(__name__)

DFLASH_ARCH = "DFlashDraftModel"


def expected_dflash_tensors(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor a DFlash export holds (vLLM names)."""
    h, d = c.hidden_size, c.head_dim
    q, kv, m = c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, c.fc_in_features),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (m, h),
            p + "mlp.up_proj.weight": (m, h),
            p + "mlp.down_proj.weight": (h, m),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if c.draft_vocab_size != c.vocab_size:
        out["d2t"] = (c.draft_vocab_size,)
    return out


def dflash_tensors(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The export's tensors (see the module docstring), floats in ``dtype``."""
    c = drafter.config
    sd = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    out = {
        k: v for k, v in sd.items() if k in expected_dflash_tensors(c) and k not in ("d2t", "lm_head.weight")
    }
    head = sd["lm_head.weight"]
    if c.draft_vocab_size == c.vocab_size:  # vLLM reads the rows as target ids: put them in target order
        full = torch.empty_like(head)
        full[drafter.draft_to_target.cpu()] = head
        out["lm_head.weight"] = full
    else:
        out["lm_head.weight"] = head
        out["d2t"] = sd["d2t"].to(torch.int64)
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in out.items()}


def check_dflash_tensors(tensors: dict[str, torch.Tensor], c: DFlashConfig, where: str) -> list[str]:
    """Missing, unexpected or misshapen tensors (vLLM would leave a missing one uninitialised, silently)."""
    want = expected_dflash_tensors(c)
    problems = [f"{where}: lacks {k}" for k in want if k not in tensors]
    problems += [f"{where}: unexpected tensor {k}" for k in tensors if k not in want]
    problems += [
        f"{where}: {k} has shape {tuple(tensors[k].shape)}, expected {shape}"
        for k, shape in want.items()
        if k in tensors and tuple(tensors[k].shape) != shape
    ]
    return problems


def dflash_config_json(drafter: DFlashDrafter, dtype: str) -> dict[str, Any]:
    """``config.json`` as vLLM's ``DFlashQwen3ForCausalLM`` reads it (module docstring), but for the rope keys, which
    :func:`eyas.serving.export.export` adds as it does for EAGLE-3."""
    c = drafter.config
    out: dict[str, Any] = {
        "architectures": [DFLASH_ARCH],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.aux_layer_ids)},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layer_ids],
    }
    if c.target_hidden_size != c.hidden_size:
        out["target_hidden_size"] = c.target_hidden_size
    return out


def dflash_config_from(config: dict[str, Any], path: Path) -> DFlashConfig:
    """The :class:`DFlashConfig` a DFlash export's ``config.json`` describes (aux ids as vLLM reads them)."""
    dc = config.get("dflash_config") or {}
    top = config.get("eagle_aux_hidden_state_layer_ids")
    aux = [int(i) - 1 for i in top] if top else [int(i) for i in dc.get("target_layer_ids") or []]
    if not aux:
        raise ExportError(f"{path}: names no target layers (dflash_config.target_layer_ids)")
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise ExportError(f"{path}: no dflash_config.mask_token_id (vLLM needs it)")
    rope = config.get("rope_parameters") or {
        **(config.get("rope_scaling") or {}),
        "rope_theta": config.get("rope_theta", 1e6),  # vLLM's default for a DFlash layer
    }
    heads = int(config["num_attention_heads"])
    try:
        return DFlashConfig(
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            aux_layer_ids=aux,
            max_position_embeddings=int(config["max_position_embeddings"]),
            mask_token_id=int(mask),
            num_hidden_layers=int(config["num_hidden_layers"]),
            block_size=int(config.get("block_size", 8)),
            rope_parameters=clean_rope(dict(rope)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            hidden_act=str(config.get("hidden_act", "silu")),
            target_hidden_size=config.get("target_hidden_size"),
        )
    except KeyError as e:
        raise ExportError(f"{path}: config.json lacks {e.args[0]!r}") from e
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from e


def mask_embedding_bytes(drafter: DFlashDrafter, dtype: torch.dtype) -> bytes:
    """``mask_embedding.pt``'s bytes, as vLLM reads the file (module docstring)."""
    buf = io.BytesIO()
    torch.save(mask_embedding_file(drafter, dtype), buf)
    return buf.getvalue()


def load_dflash_export(
    d: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    embedding: torch.Tensor,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> DFlashDrafter:
    """The drafter a DFlash export holds (``tensors``: its weights file, read by :mod:`eyas.serving.load`), on the
    target's embedding ``embedding`` (a [V, H] tensor)."""
    c = dflash_config_from(config, d / CONFIG)
    problems = check_dflash_tensors(tensors, c, str(d / WEIGHTS))
    mask_path = d / MASK_EMBEDDING
    if not mask_path.is_file():
        problems.append(f"{d}: lacks {MASK_EMBEDDING} (the learned mask embedding)")
    if problems:
        raise ExportError(f"cannot load {d}:\n  - " + "\n  - ".join(problems))
    mask = torch.load(mask_path, weights_only=True)
    if isinstance(mask, dict):
        if int(mask.get("mask_token_id", c.mask_token_id)) != c.mask_token_id:
            raise ExportError(f"{mask_path}: mask_token_id {mask['mask_token_id']} is not the config's")
        mask = mask["embedding"]
    drafter = DFlashDrafter(c)
    if "d2t" in tensors:
        drafter.set_vocab_map(tensors.pop("d2t") + torch.arange(c.draft_vocab_size))
    with torch.no_grad():
        state = drafter.state_dict()
        for k, v in tensors.items():
            state[k].copy_(v)
        drafter.mask_embedding.copy_(mask.reshape(-1))
    try:
        drafter.set_embedding(embedding.detach().to("cpu", torch.float32))
    except ValueError as e:
        raise ExportError(f"{d}: {e}: the export was made for another target") from None
    for p in drafter.parameters():
        p.data = p.data.to(dtype or torch.float32)
    return drafter.to(device)


def is_dflash_export(export_dir: str | os.PathLike) -> bool:
    """Whether ``export_dir`` holds a DFlash export (False where it holds no config)."""
    path = Path(export_dir) / CONFIG
    if not path.is_file():
        return False
    try:
        return DFLASH_ARCH in (json.loads(path.read_text()).get("architectures") or [])
    except (json.JSONDecodeError, AttributeError):
        return False
