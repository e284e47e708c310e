"""Real multi-process runs through ``accelerate launch -m eyas.train``: 2-process gloo DDP, DeepSpeed ZeRO-3 (2 processes)
and ZeRO-2 (1 process) each reach the weights of the single-process run with the same global batch; so do DDP,
ZeRO-2 and ZeRO-3 launched as two loopback "nodes" (two ``accelerate launch --num_machines 2 --machine_rank R``
processes of one worker each, see tests/launch.py). ``train.optimizer=auto`` is Muon under plain data parallel and
AdamW under DeepSpeed, so the DDP runs are held to a single-process Muon run and the DeepSpeed runs to an AdamW one.

Tolerances (fp32 weights after 4 optimizer steps, max absolute difference): DDP 1e-6 (its all-reduce sums two
micro-batch gradients in another order than one process's accumulation); DeepSpeed 1e-5 (its fp32 flat
buffers and reduce-scatter change the summation order again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.train.checkpoint import latest_checkpoint, load_weights
from tests.launch import free_port, launch_two_nodes, needs_accelerate, needs_deepspeed, run_group

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, needs_accelerate]
DDP_ATOL, DEEPSPEED_ATOL = 1e-6, 1e-5


def _overrides(tiny_target_dir: Path, out: Path, grad_accum: int) -> list[str]:
    return [
        f"target.path={tiny_target_dir}",
        "target.dtype=float32",
        "train=smoke",
        "drafter.draft_vocab_size=64",
        f"train.output_dir={out}",
        "train.wandb.mode=disabled",
        "train.max_steps=4",
        "train.save_every=4",
        f"train.grad_accum={grad_accum}",
        "train.data.synthetic.num_samples=8",
        "train.data.synthetic.shuffle=false",
        f"hydra.run.dir={out}/hydra",  # keep Hydra's run directory out of the repository
    ]


def _accelerate_run(config: str, processes: int, overrides: list[str]) -> subprocess.CompletedProcess:
    """``accelerate launch -m eyas.train`` with ``conf/accelerate/<config>.yaml`` on this machine; its result."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for attempt in range(2):  # another job on this machine may take the free port between probe and bind
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            f"conf/accelerate/{config}.yaml",
            "--num_processes",
            str(processes),
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            str(free_port()),
            "-m",
            "eyas.train",
            *overrides,
        ]
        r = run_group(cmd, env=env, timeout=300)
        if r.returncode == 0 or "address already in use" not in (r.stdout + r.stderr).lower() or attempt:
            break
    return r


def _launch(config: str, processes: int, overrides: list[str]) -> None:
    r = _accelerate_run(config, processes, overrides)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_weights(latest_checkpoint(out / "checkpoints"))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.isfinite(a[k].float()).all(), k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def _single_run(tiny_target_dir: Path, out: Path, optimizer: str) -> dict[str, torch.Tensor]:
    """One process, two micro-batches per step (in this process, through the Hydra configs)."""
    from hydra import compose, initialize_config_dir

    from eyas.train.__main__ import train_job
    from eyas.train.setup import run

    n = torch.get_num_threads()
    overrides = [*_overrides(tiny_target_dir, out, 2), "train.threads=1", f"train.optimizer={optimizer}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    try:
        res = run(train_job(cfg))
    finally:
        torch.set_num_threads(n)
    assert res.steps == 4
    return _weights(out)


@pytest.fixture(scope="module")
def single(tiny_target_dir, tmp_path_factory):
    """The reference for plain data parallel, where train.optimizer=auto means Muon."""
    return _single_run(tiny_target_dir, tmp_path_factory.mktemp("single"), "muon")


@pytest.fixture(scope="module")
def single_adamw(tiny_target_dir, tmp_path_factory):
    """The reference for DeepSpeed, where train.optimizer=auto means AdamW."""
    return _single_run(tiny_target_dir, tmp_path_factory.mktemp("single_adamw"), "adamw")


def test_ddp_two_processes_equal_single_process_same_global_batch(tiny_target_dir, single, tmp_path):
    _launch("cpu_ddp", 2, _overrides(tiny_target_dir, tmp_path, 1))
    _assert_same(_weights(tmp_path), single, atol=DDP_ATOL)
    train_lines = [x for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in x]
    assert len(train_lines) == 4 and '"tokens": 64' in train_lines[0]  # both processes' tokens counted


@needs_deepspeed
def test_deepspeed_zero3_two_processes_equal_single_process(tiny_target_dir, single_adamw, tmp_path):
    _launch("zero3_cpu", 2, _overrides(tiny_target_dir, tmp_path, 1))
    assert (latest_checkpoint(tmp_path / "checkpoints") / "ds").is_dir()
    _assert_same(_weights(tmp_path), single_adamw, atol=DEEPSPEED_ATOL)


@needs_deepspeed
def test_deepspeed_zero2_one_process_with_accumulation_equals_single_process(
    tiny_target_dir, single_adamw, tmp_path
):
    _launch("zero2_cpu", 1, _overrides(tiny_target_dir, tmp_path, 2))
    _assert_same(_weights(tmp_path), single_adamw, atol=DEEPSPEED_ATOL)


# -- two loopback nodes: one worker per machine rank ---------------------------------------------------------------
def _two_node_train(config: str, tiny_target_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Train on two loopback nodes (one worker each, one micro-batch per step: the single run's global batch)."""
    launch_two_nodes(config, ["-m", "eyas.train", *_overrides(tiny_target_dir, out, 1)], out / "logs")
    ckpt = latest_checkpoint(out / "checkpoints")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2, state
    assert (ckpt / "ds").is_dir() == config.startswith("zero"), "DeepSpeed runs save their engine checkpoint"
    return _weights(out)


def test_ddp_two_nodes_equal_single_process_same_global_batch(tiny_target_dir, single, tmp_path):
    _assert_same(_two_node_train("cpu_ddp", tiny_target_dir, tmp_path), single, atol=DDP_ATOL)


@needs_deepspeed
def test_deepspeed_zero2_two_nodes_equal_single_process(tiny_target_dir, single_adamw, tmp_path):
    _assert_same(_two_node_train("zero2_cpu", tiny_target_dir, tmp_path), single_adamw, atol=DEEPSPEED_ATOL)


@needs_deepspeed
def test_deepspeed_zero3_two_nodes_equal_single_process(tiny_target_dir, single_adamw, tmp_path):
    _assert_same(_two_node_train("zero3_cpu", tiny_target_dir, tmp_path), single_adamw, atol=DEEPSPEED_ATOL)


def test_ddp_two_torchrun_nodes_equal_single_process(tiny_target_dir, single, tmp_path):
    """The same without accelerate's launcher: ``torchrun --nnodes 2 --rdzv_endpoint ...`` (the README's command)."""
    _assert_same(_two_node_train("torchrun", tiny_target_dir, tmp_path), single, atol=DDP_ATOL)
