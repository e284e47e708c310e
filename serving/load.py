"""A drafter from a directory: which format a directory holds, and loading it onto a target.

Design decisions:
- Reading is this module, writing is :mod:`eyas.serving.export`; what both must agree on (file names, expected
  tensors, their checks) is :mod:`eyas.serving.export_format`, below both.
- One place decides what a directory is (:func:`drafter_format`): an export (``sglang``: ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]``; ``speculators``: ``speculators_model_type: "eagle3"``), a
  trainer checkpoint (``trainer``: ``drafter_config.json`` + ``drafter.safetensors``), or a training run's
  output directory (``best/``, else its newest checkpoint). Export, eval and diagnose all ask it.
- A run's newest checkpoint is the most recently written drafter directory under ``checkpoints/``: checkpoints
  are written in step order, and this keeps serving free of the trainer's directory naming.
- ``random`` is an untrained EAGLE-3 drafter for the target (τ ≈ 1; its step costs are a trained one's), so
  the arithmetic of eval and diagnose can be tested without training.
- The drafter names the target layers it reads (:func:`with_drafter_aux_layers`), as it does for vLLM and SGLang:
  a target loaded to evaluate a drafter captures that drafter's aux layers unless ``target.aux_layers`` says
  otherwise, so a drafter trained on other layers than the default is evaluated without restating them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.serving.export_format import (
    CONFIG,
    EAGLE31_KEYS,
    EMBED,
    WEIGHTS,
    ExportError,
    check_tensors,
    clean_rope,
    from_speculators_name,
)
from eyas.serving.models.drafter import (
    CONFIG_FILE,
    DrafterConfig,
    Eagle3Drafter,
    is_drafter_checkpoint,
    load_trained_drafter,
)
from eyas.serving.models.target import Target, aux_layer_problem
from eyas.serving.target_record import EXPORT_SIDECAR

log = logging.getLogger(__name__)

SGLANG_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
"""A DFlash export's architecture (``serving.export_dflash``)."""
FORMATS = ("sglang", "speculators", "dflash", "trainer")


class DrafterLoadError(ValueError):
    """A directory that holds no drafter eyas can load; the message says what it needs."""


class DamagedExportError(DrafterLoadError):
    """A file of an export that cannot be read (truncated, overwritten, half copied); the message names it."""


REEXPORT = (
    "export it again from its trainer checkpoint (python -m eyas.serving.export export.checkpoint=<run>/best "
    "export.out_dir=<this directory> export.overwrite=true)"
)


def read_export_json(path: Path, what: str) -> dict[str, Any]:
    """``config.json`` or ``eyas_export.json`` of an export as a dict; :class:`DamagedExportError` naming the file
    and the way out when it is not a JSON object (truncated, overwritten, half copied)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        data = e
    if not isinstance(data, dict):
        why = f"not valid JSON ({data})" if isinstance(data, Exception) else f"a JSON {type(data).__name__}"
        fix = (
            f"{REEXPORT}, or delete it (no server reads it; eyas then needs target= for this export)"
            if what == EXPORT_SIDECAR
            else REEXPORT
        )
        raise DamagedExportError(f"{path}: the export's {what} is damaged ({why}); {fix}")
    return data


def read_sidecar(d: Path) -> dict[str, Any]:
    """An export's ``eyas_export.json`` ({} when it has none: servers never need it)."""
    return read_export_json(d / EXPORT_SIDECAR, EXPORT_SIDECAR) if (d / EXPORT_SIDECAR).exists() else {}


def read_export_weights(w_path: Path) -> dict[str, torch.Tensor]:
    """An export's tensors; :class:`DamagedExportError` naming the file when it cannot be read."""
    from safetensors.torch import load_file

    try:
        return load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type, or OSError
        raise DamagedExportError(
            f"{w_path}: the export's weights cannot be read ({type(e).__name__}: {e}): the file is damaged "
            f"(truncated or half copied); {REEXPORT}"
        ) from None


def export_format(config: dict[str, Any]) -> str | None:
    """``speculators`` or ``sglang`` for an exported drafter's ``config.json``; None for anything else.

    Raises :class:`DrafterLoadError` for a speculators config of another model type."""
    if "speculators_model_type" in config:
        if config["speculators_model_type"] not in ("eagle3", "peagle"):
            raise DrafterLoadError(
                f"speculators model type {config['speculators_model_type']!r} is not eagle3 (or peagle, its "
                "parallel-drafting form)"
            )
        return "speculators"
    if SGLANG_ARCH in (config.get("architectures") or []):
        return "sglang"
    if DFLASH_ARCH in (config.get("architectures") or []):
        return "dflash"
    return None


def drafter_format(directory: str | Path) -> str | None:
    """``sglang``, ``speculators`` or ``trainer`` for a directory holding a drafter; None otherwise."""
    d = Path(directory)
    if is_drafter_checkpoint(d):
        return "trainer"
    try:
        config = json.loads((d / "config.json").read_text())
        return export_format(config) if isinstance(config, dict) else None
    except (OSError, json.JSONDecodeError, DrafterLoadError):
        return None


def find_drafter(root: str | Path) -> Path | None:
    """The newest exported or trained drafter directory under ``root`` (None: there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = {p.parent for name in ("config.json", "drafter_config.json") for p in root.rglob(name)}
    found = {p for p in found if drafter_format(p) and not any(part.startswith(".") for part in p.parts)}
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_drafter_dir(path: str | Path) -> tuple[Path, str]:
    """``(directory, format)`` of the drafter ``path`` names: itself, or a run directory's ``best/`` or newest
    checkpoint."""
    path = Path(path)
    if not path.is_dir():
        aside = path.with_name(f".{path.name}.old")  # serving.export.aside_dir: a replace cut short
        if aside.is_dir():
            raise DrafterLoadError(
                f"drafter {str(path)!r} is missing: an export replacing it was interrupted, and the previous export "
                f"is at {aside}; export again to that directory (it restores or replaces it) or mv {aside} {path}"
            )
        raise DrafterLoadError(f"drafter {str(path)!r} is not a directory")
    fmt = drafter_format(path)
    if fmt is None and (path / "config.json").is_file():  # a damaged export is named, not "no drafter here"
        read_export_json(path / "config.json", "config.json")
    if fmt is None:
        best = path / "best"
        found = best if drafter_format(best) == "trainer" else find_drafter(path / "checkpoints")
        if found is None:
            raise DrafterLoadError(
                f"{path}: no drafter here (an export needs config.json + model.safetensors; a trainer "
                "checkpoint needs drafter_config.json + drafter.safetensors)"
            )
        path, fmt = found, drafter_format(found)
    return path, fmt


def spec_path(spec: str, runs_dir: str | Path = "runs") -> Path:
    """The directory a drafter spec other than ``random`` names: ``auto`` is the newest drafter under
    ``runs_dir`` (:class:`DrafterLoadError` when there is none), anything else a path."""
    if spec != "auto":
        return Path(spec)
    found = find_drafter(runs_dir)
    if found is None:
        raise DrafterLoadError(
            f"export_dir=auto: no exported or trained drafter under {runs_dir}/; train and export one "
            "(eyas train, eyas export), or point export_dir= at an export"
        )
    return found


def drafter_aux_layers(path: str | Path) -> list[int] | None:
    """The aux layer ids (eyas convention: the output of layer i) that the drafter at ``path`` (an export, a
    trainer checkpoint or a training run's directory) reads; None when ``path`` holds no drafter."""
    try:
        d, fmt = resolve_drafter_dir(path)
    except DrafterLoadError:
        return None
    if fmt == "trainer":
        return [int(i) for i in json.loads((d / CONFIG_FILE).read_text())["aux_layer_ids"]]

    return [int(i) for i in describe_export(d)["aux_layers_sglang"]]


def with_drafter_aux_layers(target_cfg, drafter: str | Path | None, runs_dir: str | Path = "runs"):
    """``target_cfg`` (a :class:`serving.target.TargetConfig`) with ``aux_layers`` set to those of the drafter
    ``drafter`` names (a directory, or a :func:`load_drafter` spec) when it leaves them unset (null); unchanged
    otherwise, and for ``random``, ``None`` or a spec that names no drafter (loading it reports that)."""
    if drafter is None or str(drafter) == "random" or target_cfg.aux_layers is not None:
        return target_cfg
    try:
        path = spec_path(str(drafter), runs_dir)
    except DrafterLoadError:
        return target_cfg
    aux = drafter_aux_layers(path)
    return target_cfg if aux is None else replace(target_cfg, aux_layers=aux)


def load_target_for_drafter(target_cfg, drafter: str | Path | None, runs_dir: str | Path = "runs") -> Target:
    """:func:`serving.models.target.load_target` of ``with_drafter_aux_layers(target_cfg, drafter, runs_dir)``; aux layer
    ids the drafter supplied that this target does not have are refused as the drafter's, naming it."""
    from eyas.serving.models.target import load_target

    cfg = with_drafter_aux_layers(target_cfg, drafter, runs_dir)
    if cfg.aux_layers == target_cfg.aux_layers:
        return load_target(cfg)
    try:
        return load_target(cfg)
    except ValueError as e:
        if "aux layer ids" not in str(e):
            raise
        raise DrafterLoadError(
            f"the drafter at {spec_path(str(drafter), runs_dir)} reads target layers {list(cfg.aux_layers)} (from "
            f"its config), which target {target_cfg.path} does not have: {e}. "
            "Evaluate it with the target it was trained for (target=...)"
        ) from None


@dataclass
class LoadedDrafter:
    drafter: Eagle3Drafter
    source: str
    """Where it came from (a path, or ``random``)."""
    trained: bool


def random_drafter(target: Target, draft_vocab_size: int = 32000, seed: int = 0) -> Eagle3Drafter:
    """An untrained EAGLE-3 drafter for ``target`` (its τ is ~1; the step costs are a trained one's)."""
    dcfg = DrafterConfig.from_target(
        target.model.config, list(target.aux_layers), min(draft_vocab_size, target.vocab_size)
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def load_drafter(
    spec: str, target: Target, draft_vocab_size: int = 32000, seed: int = 0, runs_dir: str | Path = "runs"
) -> LoadedDrafter:
    """An EAGLE-3 drafter on the target's device and dtype from ``spec``: ``random``, ``auto`` (the newest
    under ``runs_dir``), an export, a trainer checkpoint or a training run's output directory."""
    if spec == "random":
        return LoadedDrafter(random_drafter(target, draft_vocab_size, seed), "random", False)
    path = spec_path(spec, runs_dir)
    if not path.is_dir() and not path.with_name(f".{path.name}.old").is_dir():
        raise DrafterLoadError(f"drafter {spec!r} is neither random, auto nor a directory")
    path, fmt = resolve_drafter_dir(path)  # names an export whose replace was interrupted
    try:
        if fmt == "trainer":
            drafter = load_trained_drafter(path, target.model.get_input_embeddings().weight)
            drafter = drafter.to(device=target.device, dtype=target.dtype)
        else:
            drafter = load_exported(path, embedding=target, dtype=target.dtype, device=target.device)
    except ValueError as e:  # damaged files and foreign embeddings name the file; say which target too
        where = "" if str(path) in str(e) else f"drafter {path}: "
        raise DrafterLoadError(f"{where}{e} (target {target.info.name})") from None
    problem = aux_layer_problem(drafter.config.aux_layer_ids, len(target.layers))
    if problem:
        raise DrafterLoadError(f"drafter {path} does not fit target {target.info.name}: {problem}")
    return LoadedDrafter(drafter.eval(), str(path), True)


# -- an exported drafter -------------------------------------------------------------------------------------
def detect_format(config: dict[str, Any], path: Path) -> str:
    """``sglang`` or ``speculators`` (:func:`serving.drafters.export_format`), else an error naming ``path``."""
    try:
        fmt = export_format(config)
    except DrafterLoadError as e:
        raise ExportError(f"{path}: {e}") from e
    if fmt is None:
        raise ExportError(f"{path}: neither a speculators eagle3 config nor architectures [{SGLANG_ARCH!r}]")
    return fmt


def _window_from(layer: dict[str, Any], path: Path) -> int | None:
    """The drafter window an export's layer config declares (None: full attention), as vLLM would apply it."""
    types = layer.get("layer_types")
    if not types:
        return None
    if len(types) != 1 or types[0] not in ("sliding_attention", "full_attention"):
        raise ExportError(
            f"{path}: layer_types {types} is not one 'sliding_attention' or 'full_attention' entry for the "
            "drafter's single layer"
        )
    if types[0] == "full_attention":
        return None
    window = layer.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ExportError(f"{path}: layer_types says sliding_attention but sliding_window is {window!r}")
    return window


def _drafter_config_from(
    config: dict[str, Any], fmt: str, sidecar: dict[str, Any], path: Path
) -> DrafterConfig:
    if fmt == "speculators":
        if config.get("norm_before_residual") is not False:  # vLLM reads a missing key as True
            raise ExportError(
                f"{path}: norm_before_residual is {config.get('norm_before_residual')!r}; the eyas "
                "drafter keeps the un-normed hidden as residual (needs an explicit false)"
            )
        layer = dict(config["transformer_layer_config"])
        aux = [int(i) - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
        draft_vocab = config["draft_vocab_size"]
        target_hidden = config.get("target_hidden_size")
    else:
        layer = config
        aux = [int(i) for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", [])]
        draft_vocab = config.get("draft_vocab_size")
        target_hidden = config.get("target_hidden_size")
        if draft_vocab is None:
            raise ExportError(f"{path}: no draft_vocab_size (SGLang would then borrow the target's lm_head)")
        top = config.get("eagle_aux_hidden_state_layer_ids")
        if top and aux and [int(i) for i in top] != [i + 1 for i in aux]:
            log.warning(
                "%s: top-level eagle_aux_hidden_state_layer_ids %s is not eagle_config's %s + 1; vLLM reads the "
                "top-level key (input of layer i) and would capture different layers than SGLang",
                path,
                top,
                aux,
            )
    if not aux:
        raise ExportError(f"{path}: the config names no aux layer ids")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ExportError(
            f"{path}: num_hidden_layers={layer['num_hidden_layers']}; eyas drafters have 1 layer"
        )
    rope = layer.get("rope_parameters")
    if not isinstance(rope, dict) or not rope:
        rope = dict(layer.get("rope_scaling") or {})
        rope["rope_theta"] = float(layer.get("rope_theta", 10000.0))
    rope = clean_rope(rope)
    heads = int(layer["num_attention_heads"])
    # as vLLM reads them: top-level keys (eagle_config's norm_before_fc first, NVIDIA's checkpoints put it there)
    options = {k: bool(config.get(k, False)) for k in EAGLE31_KEYS}
    options["norm_before_fc"] = bool(
        (config.get("eagle_config") or {}).get("norm_before_fc", options["norm_before_fc"])
    )
    if config.get("parallel_drafting") or config.get("speculators_model_type") == "peagle":
        options.update(parallel_drafting=True, mask_token_id=config.get("mask_token_id"))
    try:
        return DrafterConfig(
            hidden_size=int(layer["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
            intermediate_size=int(layer["intermediate_size"]),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(draft_vocab),
            aux_layer_ids=aux,
            max_position_embeddings=int(layer["max_position_embeddings"]),
            rope_parameters=rope,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            hidden_act=str(layer.get("hidden_act", "silu")),
            attention_bias=bool(layer.get("attention_bias", False)),
            embed_scale=float(sidecar.get("embed_scale", 1.0)),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
            **options,
            attention_window=_window_from(layer, path),
        )
    except KeyError as e:
        raise ExportError(f"{path}: config.json lacks {e.args[0]!r}") from e
    except ValueError as e:
        raise ExportError(f"{path}: {e}") from e


def load_exported(
    path: str | os.PathLike,
    embedding=None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Eagle3Drafter:
    """Load an exported drafter: an EAGLE-3 export (SGLang or speculators format) into :class:`Eagle3Drafter`, a
    DFlash export into :class:`DFlashDrafter`.

    ``embedding``: the target's input embedding (a tensor, an ``nn.Embedding`` or a loaded Target); required
    when the export has none. ``dtype``: of the parameters (default float32; the rope table stays fp32).
    """
    d = Path(path)
    cfg_path, w_path = d / "config.json", d / WEIGHTS
    for p in (cfg_path, w_path):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist; {d} is not an exported drafter directory")
    config = read_export_json(cfg_path, CONFIG)
    sidecar = read_sidecar(d)
    fmt = detect_format(config, cfg_path)
    if fmt == "dflash":
        from eyas.serving.export_dflash import load_dflash_export

        if embedding is None:
            raise ExportError(f"{d}: a DFlash export holds no embedding; pass embedding= the target's")
        tensors = read_export_weights(w_path)
        return load_dflash_export(d, config, tensors, _embedding_weight(embedding), dtype, device)
    dcfg = _drafter_config_from(config, fmt, sidecar, cfg_path)
    tensors = read_export_weights(w_path)
    if fmt == "speculators":
        tensors = {from_speculators_name(k): v for k, v in tensors.items()}
    has_embed = EMBED in tensors
    problems = check_tensors(tensors, dcfg, has_embed, where=str(w_path))
    if problems:
        raise ExportError(f"cannot load {d}:\n  - " + "\n  - ".join(problems))
    if not has_embed and embedding is None:
        raise ExportError(
            f"{d} holds no embed_tokens.weight; pass embedding= the target's input embedding "
            "(a Target, an nn.Embedding or its weight tensor)"
        )

    drafter = Eagle3Drafter(dcfg)
    with torch.no_grad():
        state = drafter.state_dict()
        for k, v in tensors.items():
            state[k].copy_(v)
    if not has_embed:
        try:
            drafter.set_embedding(_embedding_weight(embedding).detach().to("cpu", torch.float32))
        except ValueError as e:  # the target's embedding table: another vocabulary or hidden size
            raise ExportError(f"{d}: {e}: the export was made for another target") from None
    target_dtype = dtype or torch.float32
    for p in drafter.parameters():
        p.data = p.data.to(target_dtype)
    return drafter.to(device)


def _embedding_weight(embedding) -> torch.Tensor:
    if isinstance(embedding, torch.Tensor):
        return embedding
    if isinstance(embedding, nn.Embedding):
        return embedding.weight
    if hasattr(embedding, "model") and hasattr(embedding.model, "get_input_embeddings"):
        return embedding.model.get_input_embeddings().weight
    raise ExportError(
        f"embedding must be a tensor, an nn.Embedding or a Target, not {type(embedding).__name__}"
    )


def describe_export(path: str | os.PathLike) -> dict[str, Any]:
    """Format, aux ids (both conventions), sizes and rope of an export, for logs and reports."""
    d = Path(path)
    config = read_export_json(d / CONFIG, CONFIG)
    fmt = detect_format(config, d / "config.json")
    sidecar = read_sidecar(d)
    if fmt == "dflash":
        from eyas.serving.export_dflash import dflash_config_from

        dcfg = dflash_config_from(config, d / "config.json")
    else:
        dcfg = _drafter_config_from(config, fmt, sidecar, d / "config.json")
    size = (d / WEIGHTS).stat().st_size
    return {
        "format": fmt,
        "aux_layers_sglang": dcfg.aux_layer_ids,
        "aux_layers_vllm": [i + 1 for i in dcfg.aux_layer_ids],
        "hidden_size": dcfg.hidden_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "rope": dcfg.rope_parameters,
        "serve": sidecar.get("serve"),
        "weights_mib": round(size / 2**20, 2),
        "target": sidecar.get("target"),
    }
