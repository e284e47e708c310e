"""A damaged DeepSpeed checkpoint (``ds/``) is named with the checkpoint, the file and the way out, as the
plain data-parallel checkpoint files are (tests/train/test_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.train.checkpoint import latest_checkpoint
from tests.train.test_distributed import _accelerate_run, _launch, _overrides

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("damaged", ["model_states", "optim_states"])
def test_a_truncated_deepspeed_checkpoint_file_is_named_with_the_way_out(tiny_target_dir, tmp_path, damaged):
    _launch("zero2_cpu", 1, _overrides(tiny_target_dir, tmp_path, 1))
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    (f,) = [p for p in (ckpt / "ds").rglob("*.pt") if damaged in p.name]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = _accelerate_run("zero2_cpu", 1, [*_overrides(tiny_target_dir, tmp_path, 1), "train.resume=auto"])
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    # one line naming the damaged file and the way out (eyas.command prints data errors without the class name)
    assert "is damaged" in out and str(ckpt) in out and "train.resume=never" in out, out[-3000:]
    assert Path(ckpt).exists()  # nothing was deleted on the way out
