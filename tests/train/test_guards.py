"""One trainer per output directory, and a checkpoint on SIGTERM / SIGINT, on real training subprocesses:
a second ``python -m eyas.train`` into a directory in use stops at once with one line naming the directory and
the process holding it; a signalled run saves the step it reached, says so in one line, exits 128 + the signal,
and resumes to the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from eyas.train.checkpoint import TrainerState, latest_checkpoint, load_weights
from eyas.train.sources import ListSource
from eyas.train.trainer import fit
from tests.train.test_trainer import tiny_cfg, tiny_setup

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}

CHILD = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.train.test_trainer import SlowSource, tiny_cfg, tiny_setup
from eyas.train.trainer import fit
torch.set_num_threads(1)  # after the imports: tests/conftest.py sets its own count
target, drafter, data = tiny_setup()
fit(tiny_cfg({out!r}, save_every=0), drafter, SlowSource(data.train, 0.3), data.eval, head=target.head,
    target_info=target.info)
"""


def _train_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("kind") == "train":
            steps.append(rec["step"])
    return steps


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    deadline = time.time() + 180
    while not _train_steps(out) or _train_steps(out)[-1] < step:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"the run never reached step {step}"
        time.sleep(0.05)


def test_sigterm_saves_the_step_reached_and_resumes_to_the_uninterrupted_weights(tmp_path):
    sig = signal.SIGTERM
    out = tmp_path / "signalled"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=str(REPO), out=str(out))],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_step(proc, out, 2)
        os.kill(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert f"training stopped by {sig.name} at step" in err, err[-3000:]
    reached = _train_steps(out)[-1]
    assert 2 <= reached < 8, "the child must be stopped before it finished"
    # save_every=0: without the signal there would be no checkpoint before step 8
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and TrainerState.read(ckpt).step == reached
    assert f"at step {reached};" in err

    target, drafter, data = tiny_setup()
    cfg = tiny_cfg(out, save_every=0)
    resumed = fit(
        cfg,
        drafter,
        ListSource(data.train, shuffle=False),
        data.eval,
        head=target.head,
        target_info=target.info,
    )
    assert resumed.resumed_from == str(ckpt) and resumed.steps_this_run == 8 - reached
    target, drafter, data = tiny_setup()
    straight = fit(
        tiny_cfg(tmp_path / "straight", save_every=0),
        drafter,
        ListSource(data.train, shuffle=False),
        data.eval,
        head=target.head,
        target_info=target.info,
    )
    a, b = load_weights(resumed.last_checkpoint), load_weights(straight.last_checkpoint)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert _train_steps(out) == list(range(1, 9))


def _train_command(tiny_target_dir: Path, out: Path, hydra_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eyas.train",
        f"target.path={tiny_target_dir}",
        "target.dtype=float32",
        "train=smoke",
        "drafter.draft_vocab_size=64",
        f"train.output_dir={out}",
        "train.wandb.mode=disabled",
        "train.max_steps=1000000",  # runs until signalled
        "train.save_every=0",
        "train.threads=1",
        f"hydra.run.dir={hydra_dir}",
    ]


def test_a_second_trainer_into_a_busy_dir_stops_at_once_and_ctrl_c_ends_the_first_with_a_checkpoint(
    tiny_target_dir, tmp_path
):
    """The command line: the second ``eyas train`` fails before loading anything; Ctrl-C (SIGINT) on the first
    saves, prints one line and exits 130."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        _train_command(tiny_target_dir, out, tmp_path / "h1"),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_step(first, out, 1)
        second = subprocess.run(
            _train_command(tiny_target_dir, out, tmp_path / "h2"),
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = second.stderr.strip().splitlines()[-1]
        assert second.returncode == 2, second.stderr[-3000:]
        assert line.startswith("error: ") and str(out) in line and f"pid {first.pid} " in line, line
        assert first.poll() is None  # the first trainer runs on, undisturbed
        os.kill(first.pid, signal.SIGINT)
        assert first.wait(timeout=120) == 128 + signal.SIGINT
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    last = first.stderr.read().strip().splitlines()[-1]
    m = re.fullmatch(r"stopped: training stopped by SIGINT at step (\d+); checkpoint (\S+) saved: .*", last)
    assert m, last
    step, ckpt = int(m.group(1)), Path(m.group(2))
    assert ckpt == latest_checkpoint(out / "checkpoints") and TrainerState.read(ckpt).step == step
    assert _train_steps(out) == list(range(1, step + 1))  # one trainer's lines, in order
