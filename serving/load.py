"""A drafter from a directory: which format a directory holds, and loading it onto a target.

Design decisions:
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eyas.serving.models.drafter import (
    CONFIG_FILE,
    DrafterConfig,
    Eagle3Drafter,
    is_drafter_checkpoint,
    load_trained_drafter,
)
from eyas.serving.models.target import Target, aux_layer_problem
from eyas.serving.target_record import EXPORT_SIDECAR

SGLANG_ARCH = "LlamaForCausalLMEagle3"
FORMATS = ("sglang", "speculators", "trainer")


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
    from eyas.serving.export import describe_export

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
            from eyas.serving.export import load_exported

            drafter = load_exported(path, embedding=target, dtype=target.dtype, device=target.device)
    except ValueError as e:  # damaged files and foreign embeddings name the file; say which target too
        where = "" if str(path) in str(e) else f"drafter {path}: "
        raise DrafterLoadError(f"{where}{e} (target {target.info.name})") from None
    problem = aux_layer_problem(drafter.config.aux_layer_ids, len(target.layers))
    if problem:
        raise DrafterLoadError(f"drafter {path} does not fit target {target.info.name}: {problem}")
    return LoadedDrafter(drafter.eval(), str(path), True)
