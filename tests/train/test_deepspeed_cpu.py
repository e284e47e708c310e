"""A DeepSpeed op build killed mid-way leaves torch's lock file in the extension's build directory; without eyas's
guard every later DeepSpeed run on the machine waits on it forever (this hung the whole distributed suite once).
Here the build runs in a fresh ``TORCH_EXTENSIONS_DIR`` that holds such a file, in a subprocess with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.train.deepspeed_cpu import clear_dead_build_lock
from tests.launch import needs_deepspeed, run_group


def test_a_dead_builds_lock_file_is_removed_and_nothing_else(tmp_path):
    (tmp_path / "lock").write_text("")
    (tmp_path / "build.ninja").write_text("kept")
    assert clear_dead_build_lock(tmp_path) is True
    assert not (tmp_path / "lock").exists()
    assert (tmp_path / "build.ninja").read_text() == "kept"
    assert clear_dead_build_lock(tmp_path) is False  # nothing to remove the second time


class _FakeBuilder:
    name = "deepspeed_shm_comm"

    def __init__(self, build_dir: Path):
        self.build_dir, self.loads = build_dir, []

    def load(self, verbose=False):
        self.loads.append((self.build_dir / "lock").exists())  # whether torch's lock file was still there


def _fake(monkeypatch, tmp_path) -> _FakeBuilder:
    import eyas.train.deepspeed_cpu as ds

    d = tmp_path / "py_cpu" / "deepspeed_shm_comm"
    d.mkdir(parents=True)
    (d / "lock").write_text("")
    fake = _FakeBuilder(d)
    monkeypatch.setattr(ds, "_shm_builder", lambda: fake)
    monkeypatch.setattr(ds, "extension_build_dir", lambda name: d)
    return fake


def test_the_build_runs_under_the_guard_after_the_dead_lock_is_removed(monkeypatch, tmp_path):
    from eyas.train.deepspeed_cpu import build_cpu_comm_op

    fake = _fake(monkeypatch, tmp_path)
    assert build_cpu_comm_op() is True
    assert fake.loads == [False]  # loaded once, with the dead build's lock file gone


def test_a_file_system_without_locks_still_builds_leaving_torchs_file_alone(monkeypatch, tmp_path):
    import fcntl

    from eyas.train.deepspeed_cpu import build_cpu_comm_op

    fake = _fake(monkeypatch, tmp_path)

    def no_locks(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert build_cpu_comm_op() is True
    # unguarded, eyas cannot tell a dead build's file from a live one's: it leaves it to torch
    assert fake.loads == [True] and (fake.build_dir / "lock").exists()


@needs_deepspeed
@pytest.mark.distributed
def test_deepspeed_cpu_op_builds_past_a_dead_builds_lock_file(tmp_path):
    code = (
        "import torch, sys\n"
        "if torch.cuda.is_available(): sys.exit(3)\n"
        "from eyas.train.deepspeed_cpu import build_cpu_comm_op, extension_build_dir\n"
        "d = extension_build_dir('deepspeed_shm_comm'); d.mkdir(parents=True, exist_ok=True)\n"
        "(d / 'lock').write_text('')  # what a killed build leaves\n"
        "print('built' if build_cpu_comm_op() else 'no-op')\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "print('deepspeed loads it' if build_shm_op() is not None else 'deepspeed skips it')\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1"}
    try:
        r = run_group([sys.executable, "-c", code], env=env, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the build waited on the dead lock file: {(e.stderr or '')[-2000:]}")
    if r.returncode == 3:
        pytest.skip("a GPU machine: DeepSpeed builds no CPU collective op there")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    if "no-op" in r.stdout:
        pytest.skip("this DeepSpeed has no CPU shared-memory op to build")
    assert "built" in r.stdout and "deepspeed loads it" in r.stdout, r.stdout
    built = list(Path(tmp_path / "ext").rglob("deepspeed_shm_comm*.so"))
    assert built and not list(Path(tmp_path / "ext").rglob("deepspeed_shm_comm/lock"))
