"""DeepSpeed on CPU builds its shared-memory collective op (``deepspeed_shm_comm``) the first time a process group
starts, with torch's JIT extension builder. That builder guards its build directory with a plain lock *file*
(``torch.utils.file_baton``): a build killed mid-way (kill -9, a job scheduler's timeout, a machine restart) leaves
the file behind and every later DeepSpeed run on the machine waits on it forever, silently.

:func:`build_cpu_comm_op` builds (or loads) the op before accelerate starts DeepSpeed, under an OS lock (``flock``,
which the kernel releases when its holder dies). A torch lock file found while holding it was left by a build that
is no longer running, so it is removed with a warning naming it; the op is then built once and DeepSpeed's own
``build_shm_op`` finds it already loaded."""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SHM_BUILDER = "ShareMemCommBuilder"


def _shm_builder():
    """DeepSpeed's builder of the shared-memory op on this accelerator, or None where it has none or cannot build
    it (then DeepSpeed skips the op as well)."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    builder = get_accelerator().create_op_builder(SHM_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def extension_build_dir(name: str) -> Path:
    """Where torch's JIT builder builds extension ``name`` (honours ``TORCH_EXTENSIONS_DIR``)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def clear_dead_build_lock(build_dir: Path) -> bool:
    """Remove ``build_dir/lock`` if it is there; called with the build guard held, when no eyas process is
    building, so the file is a dead build's. Returns whether a file was removed."""
    stale = build_dir / "lock"
    if stale.exists():
        log.warning(
            "removing %s, the lock file of a DeepSpeed op build that is no longer running (it would make this run "
            "wait forever); the op is rebuilt now",
            stale,
        )
        stale.unlink(missing_ok=True)
        return True
    return False


def build_cpu_comm_op() -> bool:
    """Build or load DeepSpeed's CPU shared-memory op under an OS lock, clearing a dead build's lock file first.
    Returns whether the op is loaded (False where DeepSpeed has no such op here)."""
    builder = _shm_builder()
    if builder is None:
        return False
    build_dir = extension_build_dir(builder.name)
    build_dir.mkdir(parents=True, exist_ok=True)
    guard = build_dir.parent / f"{builder.name}.eyas-build-lock"
    with open(guard, "a") as fh:  # closing it releases the lock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)  # other processes of this node wait here while one builds
        except OSError as e:  # a file system without locks (some network or FUSE mounts): torch's file stays
            log.warning("cannot lock %s (%s): building DeepSpeed's CPU op without eyas's guard", guard, e)
        else:
            clear_dead_build_lock(build_dir)
        builder.load(verbose=False)
    return True
