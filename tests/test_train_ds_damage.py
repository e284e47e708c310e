"""A damaged DeepSpeed checkpoint (``ds/``) is named with the checkpoint, the file and the way out, as the
plain data-parallel checkpoint files are (tests/test_train_checkpoint.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.train.checkpoint import latest_checkpoint

from .test_train_distributed import REPO, _free_port, _launch, _overrides

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("damaged", ["model_states", "optim_states"])
def test_a_truncated_deepspeed_checkpoint_file_is_named_with_the_way_out(tiny_target_dir, tmp_path, damaged):
    _launch("zero2_cpu", 1, _overrides(tiny_target_dir, tmp_path, 1))
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    (f,) = [p for p in (ckpt / "ds").rglob("*.pt") if damaged in p.name]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "conf/accelerate/zero2_cpu.yaml",
        "--num_processes",
        "1",
        "--num_cpu_threads_per_process",
        "1",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "eyas.train",
        *_overrides(tiny_target_dir, tmp_path, 1),
        "train.resume=auto",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "DamagedCheckpointError" in out and str(ckpt) in out and "train.resume=never" in out, out[-3000:]
    assert Path(ckpt).exists()  # nothing was deleted on the way out
