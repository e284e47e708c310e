"""Two loopback "nodes" for the multi-node tests: two ``accelerate launch`` processes, one per machine rank, each
starting one worker, meeting at 127.0.0.1 on a free port (what a 2-node SLURM job runs, on one machine)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed: multi-process launches need `pip install accelerate`",
)
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: the ZeRO launches need `pip install deepspeed`",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and any worker it left (its own process group: nothing else is touched). The group
    id stays reserved while a member lives, so this reaches only what the launcher started."""
    with contextlib.suppress(ProcessLookupError):  # the launcher and all its workers are gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_group(cmd: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in the repository, in its own process group: past
    ``timeout`` the launcher *and its workers* are killed (``subprocess.run`` kills only the launcher and would
    leave a worker running on after the test) and ``subprocess.TimeoutExpired`` is raised as usual."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _node_command(config: str, rank: int, port: int) -> list[str]:
    """The launcher of machine ``rank``: ``accelerate launch`` with ``conf/accelerate/{config}.yaml``, or
    ``torchrun`` (``config="torchrun"``: c10d rendezvous at the endpoint; ranks by arrival)."""
    if config == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(rank),
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_id",
            f"eyas-test-{port}",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
        ]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"conf/accelerate/{config}.yaml",
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--num_processes",
        "2",
        "--num_cpu_threads_per_process",
        "1",
    ]


def launch_two_nodes(
    config: str,
    module_args: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    check: bool = True,
) -> list[int]:
    """Run ``accelerate launch --config_file conf/accelerate/{config}.yaml --num_machines 2 --machine_rank R
    --main_process_ip 127.0.0.1 --main_process_port P --num_processes 2 ...module_args`` for R = 0 and 1 at
    once (``config="torchrun"``: ``torchrun --nnodes 2 --node_rank R --rdzv_endpoint 127.0.0.1:P ...``); fail
    with both logs unless both exit 0 within ``timeout`` seconds. Once one node fails (or time runs out) both
    process groups are killed, so a rank left waiting in a collective never outlives the test. The nodes'
    output goes to ``log_dir/node{R}.log``; ``env`` adds to the environment of both. ``check=False``: return
    the launchers' exit codes instead of failing (-9: killed here, as a node left waiting or out of time)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(2):  # another job on this machine may take the free port between probe and bind
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = [(log_dir / f"node{rank}.log").open("w") for rank in range(2)]
        procs = [
            subprocess.Popen(
                [*_node_command(config, rank, port), *module_args],
                cwd=REPO,
                env=env,
                stdout=logs[rank],
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed as one, with its workers
            )
            for rank in range(2)
        ]
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if any(p.poll() not in (None, 0) for p in procs):
                    failed_at = failed_at or now
                if now > deadline or (failed_at is not None and now > failed_at + 10):
                    break  # timed out, or the other node is left waiting for the failed one
                time.sleep(0.2)
        finally:
            for p in procs:
                _kill(p)
        codes = [p.returncode for p in procs]
        text = []
        for rank, f in enumerate(logs):
            f.close()
            tail = (log_dir / f"node{rank}.log").read_text()[-4000:]
            text.append(f"--- machine_rank {rank} (exit {codes[rank]}) ---\n{tail}")
        report = "\n".join(text)
        if codes == [0, 0]:
            return codes
        if attempt or "address already in use" not in report.lower():
            break
    if not check:
        return codes
    timed_out = f" (timed out after {timeout:.0f} s)" if time.monotonic() > deadline else ""
    pytest.fail(f"two-node launch of {module_args[:2]} failed{timed_out}:\n{report}")
