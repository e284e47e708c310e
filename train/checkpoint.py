"""Training checkpoints: exact resume, atomic on disk, refused across configs.

A checkpoint is a directory ``<output_dir>/checkpoints/step_00000040/``::

    trainer_state.json      step, config hash + identity, world size, tokens seen (every real token, i.e. not
                            padding, of every optimizer step so far, all processes; resumed runs continue the
                            count), best metric, wandb run id
    drafter.safetensors     trainable drafter weights (no frozen target embedding) incl. d2t / t2d
    drafter_config.json     DrafterConfig.to_dict()
    optimizer.pt            AdamW state (plain data parallel; rank 0)    | ds/  DeepSpeed engine checkpoint
    scheduler.pt            LR scheduler state                           |      (partitioned optimizer state)
    rng_rank{r}.pt          python / numpy / torch (/ cuda) RNG states of rank r (tensors and numbers only)
    data_rank{r}.pt         the data source's state_dict() on rank r (its position: numbers and strings)
    target.json             the target the run trains against (a copy of <output_dir>/target.json, which the
                            setup writes: serving/target_record.py); ``best/`` carries it too, so a checkpoint
                            names its target wherever it is copied (export and eval read it)

Design decisions:
- Atomic: every rank writes into ``.step_XXXXXXXX.tmp`` and fsyncs its files; after a barrier rank 0 writes
  trainer_state.json last, fsyncs the whole directory and renames it (``common.replace_dir``: a re-save of the same
  step swaps the two directories, so ``step_X`` never disappears). A run killed, or a machine losing power, at
  any moment leaves whole checkpoints plus at most one ignored temp dir. ``best/`` is replaced the same way.
  Multi-node runs need ``output_dir`` on a filesystem every node sees.
- Nothing read on resume can run code: every ``.pt`` file is loaded with ``torch.load(weights_only=True)``, which
  rebuilds tensors, numbers, strings and containers only (a pickled object is refused, naming the file). So the
  RNG state is stored as tensors and numbers (numpy's key as an int64 tensor), never as pickled numpy objects.
- Only trainable weights are saved; the frozen embedding is the target's and comes back from the target.
- Resume is refused, with the differing fields named, when the checkpoint's identity (trajectory-relevant
  config, drafter sizes, target, world size) differs from the run's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eyas.common import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_file,
    fsync_tree,
    recover_dir,
    replace_dir,
)
from eyas.serving.models.drafter import WEIGHTS_FILE, save_drafter_weights
from eyas.serving.target_record import TARGET_FILE
from eyas.train.config import diff_identity

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointMismatchError(RuntimeError):
    """The checkpoint was written by a run with another configuration."""


class DamagedCheckpointError(RuntimeError):
    """A file of the checkpoint cannot be read (truncated, overwritten, half copied)."""


def _way_out(path: Path) -> str:
    return (
        f"Resume from the checkpoint before it (train.resume=<its directory>, or delete {path} and keep "
        "train.resume=auto), or start afresh with train.resume=never in an empty train.output_dir"
    )


def _read(path: Path, name: str, reader):
    """``reader(path / name)``, or a :class:`DamagedCheckpointError` naming the checkpoint, the file and the fix."""
    try:
        return reader(path / name)
    except FileNotFoundError as e:
        raise DamagedCheckpointError(f"checkpoint {path} has no {name}. {_way_out(path)}") from e
    except Exception as e:  # noqa: BLE001 - torch / safetensors raise many types for a damaged file
        # weights_only names the object it refused; its text would suggest weights_only=False, so it is not shown
        if isinstance(e, pickle.UnpicklingError):
            found = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(e))
            what = f" ({found.group(1) or found.group(2)})" if found else ""
            raise DamagedCheckpointError(
                f"checkpoint {path}: {name} holds a pickled object{what} where eyas writes only tensors and "
                "numbers; it was refused unread, since loading it could run code: do not trust this checkpoint. "
                f"{_way_out(path)}"
            ) from None
        raise DamagedCheckpointError(
            f"checkpoint {path}: {name} is damaged ({type(e).__name__}: {str(e)[:200]}). {_way_out(path)}"
        ) from e


@dataclass
class TrainerState:
    """``trainer_state.json``."""

    step: int
    config_hash: str
    identity: dict[str, Any]
    world_size: int
    tokens_seen: int = 0
    """Real (non-padding) tokens of every optimizer step so far, over all processes; carried across resumes."""
    best_value: float | None = None
    best_step: int | None = None
    best_metric: str | None = None
    """The ``train.best_metric`` that ``best_value`` is a value of (None: a checkpoint from before it was kept)."""
    wandb_id: str | None = None
    saved_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    @classmethod
    def read(cls, directory: str | os.PathLike) -> TrainerState:
        path = Path(directory) / STATE_FILE
        try:
            d = json.loads(path.read_text())
            return cls(**d)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{directory} is not a training checkpoint (no {STATE_FILE})") from e
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(
                f"{path}: unreadable trainer state ({e}); resume from an older checkpoint"
            ) from e


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the objects it loaded in place."""

    path: Path
    state: TrainerState
    data_state: Any


# -- layout -----------------------------------------------------------------------------------------------------
def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    for old in root.glob(".step_*.old"):  # a re-save interrupted where the filesystem cannot swap directories
        with contextlib.suppress(FileNotFoundError):  # another process put it back first
            recover_dir(root / old.name[1:-4])
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


# -- RNG --------------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and numbers (what ``torch.load(weights_only=True)`` rebuilds)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),  # (version, 625 ints, gauss_next): numbers only
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 values, kept exactly
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
    npy = state["numpy"]
    if isinstance(npy, dict):
        keys = npy["keys"].numpy().astype(np.uint32)
        npy = (npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)  # a tuple: a checkpoint written before the RNG state was kept as tensors
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- weights ----------------------------------------------------------------------------------------------------
def _is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _zero_stage(accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin if _is_deepspeed(accelerator) else None
    return int(plugin.zero_stage) if plugin is not None else 0


def trainable_weights(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Full trainable drafter weights on the CPU on the main process (None elsewhere). Collective under ZeRO-3."""
    drafter = accelerator.unwrap_model(model).drafter
    if _zero_stage(accelerator) == 3:
        import deepspeed

        params = [p for p in drafter.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in drafter.trainable_state_dict().items()}
    else:
        sd = {k: v.detach().cpu().clone() for k, v in drafter.trainable_state_dict().items()}
    return sd if accelerator.is_main_process else None


def save_weights(directory: Path, weights: dict[str, torch.Tensor], drafter_config: dict[str, Any]) -> None:
    save_drafter_weights(directory, weights, drafter_config)


def load_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / WEIGHTS_FILE))


def load_drafter_weights(drafter, directory: str | os.PathLike) -> None:
    """Load trainable weights into an (unwrapped) drafter; the frozen embedding must be the only key missing."""
    directory = Path(directory)
    weights = _read(directory, WEIGHTS_FILE, lambda p: load_file(str(p)))
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"{directory}: drafter weights do not fit this drafter (missing {missing}, unexpected {unexpected})"
        )


# -- save -------------------------------------------------------------------------------------------------------
def save_checkpoint(
    root: str | os.PathLike,
    state: TrainerState,
    *,
    accelerator,
    model,
    optimizer,
    scheduler,
    data_state: Any,
    drafter_config: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint ``state.step`` atomically (collective: every process calls it)."""
    root = Path(root)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".step_{state.step:08d}.tmp"
    rank = accelerator.process_index
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    weights = trainable_weights(accelerator, model)
    if _is_deepspeed(accelerator):
        model.save_checkpoint(str(tmp / "ds"), tag="ds", save_latest=False, exclude_frozen_parameters=True)
        fsync_tree(tmp / "ds")  # every rank its own partitions (on a shared filesystem)
    elif accelerator.is_main_process:
        _save(_optimizer_state(optimizer), tmp / "optimizer.pt")
    _save(rng_state(), tmp / f"rng_rank{rank}.pt")
    _save(data_state, tmp / f"data_rank{rank}.pt")
    if accelerator.is_main_process:
        save_weights(tmp, weights, drafter_config)
        _save(scheduler.state_dict(), tmp / "scheduler.pt")
        copy_run_target(root.parent, tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.saved_at = time.time()
        atomic_write_bytes(tmp / STATE_FILE, json.dumps(asdict(state), indent=1, sort_keys=True).encode())
        fsync_tree(tmp)  # every file on the disk before the directory gets its final name
        replace_dir(tmp, final)  # a re-save of the same step swaps: step_X exists throughout
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved: %s", final)
    accelerator.wait_for_everyone()
    return final


def copy_run_target(run_dir: str | os.PathLike, directory: Path) -> None:
    """The run's target record (``<run_dir>/target.json``) into checkpoint ``directory``, when the run has one."""
    src = Path(run_dir) / TARGET_FILE
    if src.is_file():
        shutil.copyfile(src, directory / TARGET_FILE)


def _optimizer_state(optimizer) -> dict[str, Any]:
    inner = getattr(
        optimizer, "optimizer", optimizer
    )  # accelerate's AcceleratedOptimizer wraps the torch one
    return inner.state_dict()


def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fsync_file(path)


def save_best(
    directory: str | os.PathLike,
    weights: dict[str, torch.Tensor],
    drafter_config: dict[str, Any],
    metrics: dict[str, Any],
) -> None:
    """Replace ``directory`` (the best drafter so far) atomically: weights, config and the metrics that chose it,
    written under a temporary name, fsynced, then swapped in (``directory`` exists at every moment)."""
    directory = Path(directory)
    tmp = directory.with_name("." + directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(tmp, weights, drafter_config)
    atomic_write_json(tmp / "metrics.json", metrics)
    copy_run_target(directory.parent, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, directory)


# -- load -------------------------------------------------------------------------------------------------------
def _torch_load(p: Path) -> Any:
    """A checkpoint ``.pt`` file as tensors, numbers, strings and containers; anything else (a pickled object,
    which could run code) raises, and :func:`_read` names the file."""
    return torch.load(p, map_location="cpu", weights_only=True)


# The numpy RNG state of checkpoints written before it was stored as a tensor: an ndarray of uint32 keys. Only
# these constructors are allowed beyond weights_only's own (they rebuild an array, nothing else).
try:
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
_OLD_RNG_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _np_reconstruct]


def _load_rng(p: Path) -> Any:
    with torch.serialization.safe_globals(_OLD_RNG_GLOBALS):
        return _torch_load(p)


# What DeepSpeed's own checkpoint files pickle besides tensors and containers (seen in a ZeRO-2 optimizer state);
# DeepSpeed loads them with weights_only=False, so eyas scans each file's pickle for the objects it would build
# (without running it) and lets through these and DeepSpeed's enums only.
_DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    }
)


def _deepspeed_enum(name: str) -> bool:
    import enum
    import importlib

    module, _, attr = name.rpartition(".")
    if not module.startswith("deepspeed."):
        return False
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return False
    return isinstance(obj, type) and issubclass(obj, enum.Enum)


def _scan_deepspeed_file(p: Path) -> None:
    """Raise ``pickle.UnpicklingError`` naming the object when ``p`` would build anything but tensors, containers
    and DeepSpeed's known state classes (:func:`_read` turns it into the refusal)."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(p)
    bad = [g for g in names if g not in _DEEPSPEED_GLOBALS and not _deepspeed_enum(g)]
    if bad:
        raise pickle.UnpicklingError(f"unsupported GLOBAL {bad[0]}")


def check_identity(state: TrainerState, config_hash: str, identity: dict[str, Any], path: Path) -> None:
    if state.config_hash == config_hash:
        return
    diffs = diff_identity(state.identity, identity)
    shown = "; ".join(diffs[:12]) + (f"; ... ({len(diffs) - 12} more)" if len(diffs) > 12 else "")
    raise CheckpointMismatchError(
        f"checkpoint {path} was written by a run with another configuration ({shown or 'hash differs'}). "
        "Resume with the same settings, or start a new run in another train.output_dir (or train.resume=never "
        "with an empty output_dir)"
    )


def load_checkpoint(
    path: str | os.PathLike,
    *,
    accelerator,
    model,
    optimizer,
    scheduler,
    config_hash: str,
    identity: dict[str, Any],
) -> LoadedCheckpoint:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the state and this rank's data state."""
    path = Path(path)
    state = TrainerState.read(path)
    check_identity(state, config_hash, identity, path)
    rank = accelerator.process_index
    if state.world_size != accelerator.num_processes:
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by {state.world_size} processes, this run has "
            f"{accelerator.num_processes}: the data position of each process cannot be restored exactly; "
            "resume with the same number of processes"
        )
    if _is_deepspeed(accelerator):
        if not (path / "ds").is_dir():
            raise CheckpointMismatchError(
                f"checkpoint {path} holds no DeepSpeed state; resume without DeepSpeed"
            )
        for f in sorted((path / "ds").rglob("*.pt")):  # DeepSpeed unpickles them with weights_only=False
            _read(path, str(f.relative_to(path)), _scan_deepspeed_file)
        load_path, _ = _read(
            path,
            "ds",
            lambda ds_dir: model.load_checkpoint(
                str(ds_dir),
                tag="ds",
                load_module_strict=False,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            ),
        )
        if load_path is None:  # DeepSpeed logs a missing file and returns (None, None)
            raise DamagedCheckpointError(
                f"checkpoint {path}: ds/ could not be loaded by DeepSpeed. {_way_out(path)}"
            )
    else:
        if not (path / "optimizer.pt").exists():
            raise CheckpointMismatchError(
                f"checkpoint {path} was written under DeepSpeed; resume with DeepSpeed"
            )
        load_drafter_weights(accelerator.unwrap_model(model).drafter, path)
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.load_state_dict(_read(path, "optimizer.pt", _torch_load))
    scheduler.load_state_dict(_read(path, "scheduler.pt", _torch_load))
    set_rng_state(_read(path, f"rng_rank{rank}.pt", _load_rng))
    data_state = _read(path, f"data_rank{rank}.pt", _torch_load)
    log.info("resumed from %s (step %d)", path, state.step)
    return LoadedCheckpoint(path=path, state=state, data_state=data_state)
