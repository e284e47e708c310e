"""What keeps a training run's output directory whole: one trainer per directory, and a checkpoint on SIGTERM /
SIGINT instead of losing the steps since the last one.

Design decisions:
- The lock is a ``filelock`` lock on ``<output_dir>/.train.lock``, as extraction locks its store
  (``data.extract.acquire_store_lock``), taken by the main process only (the other processes write into the
  directory the main process owns) and tried once, without waiting: a second ``eyas train`` into the directory
  stops at once, before it loads anything, with one line naming the directory and the process that holds it
  (``.train.lock.holder``: pid, host, start time; written after the lock is taken, since a waiting process
  truncates the lock file itself). The kernel drops the lock when its process dies, however it dies, so a
  killed run leaves nothing to clean up. Within one process the lock is re-entrant (``is_singleton``), so the
  stage entry point can take it before minutes of loading and the trainer again around its loop.
- The signal handler only records the signal; the training loop reads it after each optimizer step, all
  processes agree on it (any process signalled stops them all, at the same step), and they save a checkpoint
  there and raise :class:`TrainingInterrupted`. A second signal restores the previous handler and delivers
  itself again: the way out when the save itself hangs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from eyas.common import InputError

log = logging.getLogger(__name__)

LOCK_FILE = ".train.lock"
HOLDER_FILE = ".train.lock.holder"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class OutputDirBusyError(InputError):
    """Another trainer holds the output directory's lock."""


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT stopped training after a checkpoint was saved; rerunning the command resumes from it."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        name = signal.Signals(signum).name
        super().__init__(
            f"training stopped by {name} at step {step}; checkpoint {checkpoint} saved: run the same command "
            "again to resume from it"
        )
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal."""
        return 128 + self.signum


def _holder(out_dir: Path) -> str:
    try:
        h = json.loads((out_dir / HOLDER_FILE).read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
        return f"pid {h['pid']} on {h['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that left no holder record"


class OutputDirLock:
    """The writer lock of a training output directory, held from construction until :meth:`release`."""

    def __init__(self, out_dir: str | os.PathLike, accelerator: Any = None):
        self.out_dir = Path(out_dir)
        main = accelerator is None or accelerator.is_main_process
        self._lock = FileLock(str(self.out_dir / LOCK_FILE), is_singleton=True) if main else None
        error = ""
        if self._lock is not None:
            first = not self._lock.is_locked
            try:
                self._lock.acquire(timeout=0)
            except Timeout:
                self._lock = None
                error = (
                    f"train.output_dir={self.out_dir} is in use by another trainer ({_holder(self.out_dir)}; "
                    f"lock {self.out_dir / LOCK_FILE}): wait for it to finish, stop it, or pick another "
                    "train.output_dir"
                )
            else:
                if first:
                    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
                    (self.out_dir / HOLDER_FILE).write_text(json.dumps(record) + "\n")
        error = _from_main(accelerator, error)
        if error:
            raise OutputDirBusyError(error)

    def release(self) -> None:
        """Idempotent; the lock goes when its last holder in this process releases it."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _from_main(accelerator: Any, value: str) -> str:
    """The main process's ``value`` on every process (the lock's outcome: every process stops, or none)."""
    if accelerator is None or accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


class StopSignals:
    """While entered, SIGTERM and SIGINT are recorded in :attr:`signum` instead of ending the process (see the
    module docstring). Off the main thread, where Python cannot install handlers, it records nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: let it do what it would have done
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning(
            "%s received: saving a checkpoint after this step (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __exit__(self, *exc: Any) -> None:
        self._restore()
