"""The worked examples (examples/*.sh): every command they run composes with Hydra into its stage's typed config,
in the full (GPU) mode and in the smoke mode, so a renamed key or a wrong type fails here. The smoke mode itself
(`make example-smoke`: the same commands through vLLM's CPU build on the embedded target) takes longer than a test
may: its three engine starts alone are minutes on a 2-core CPU."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["prepare", "extract", "train", "export", "eval"]


def _commands(script: str, **env: str) -> list[tuple[str, list[str]]]:
    """(stage, Hydra overrides) of every command ``script`` prints in DRY_RUN mode."""
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / script)],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    cmds = []
    for line in out.splitlines():
        if not line.startswith("+ "):
            continue
        argv = shlex.split(line[2:])
        if "-m" in argv:  # accelerate launch ... -m eyas.train <overrides>
            i = argv.index("-m")
            stage, overrides = argv[i + 1].rsplit(".", 1)[-1], argv[i + 2 :]
        else:  # eyas <stage> <overrides>
            assert Path(argv[0]).name == "eyas", line
            stage, overrides = argv[1], argv[2:]
        cmds.append((stage, overrides))
    return cmds


def _job(stage: str, overrides: list[str]):
    """The job the stage's command builds from ``overrides`` (checked as the command checks them, not run)."""
    import importlib

    from eyas.command import dry_run

    module = {
        "prepare": "eyas.data.prepare",
        "extract": "eyas.data.extract",
        "train": "eyas.train.__main__",
        "export": "eyas.serving.export",
        "eval": "eyas.eval.__main__",
    }[stage]
    return dry_run(
        importlib.import_module(module).COMMAND, [o for o in overrides if not o.startswith("hydra.")]
    )


@pytest.mark.parametrize(
    ("script", "env"),
    [
        ("qwen3_8b.sh", {}),
        ("qwen3_8b.sh", {"SMOKE": "1"}),
        ("deepseek_v3.sh", {}),
        (
            "deepseek_v3.sh",
            {"REGEN_URLS": "http://node0:8000,http://node1:8000", "EVAL_URL": "http://node0:8001"},
        ),
        ("deepseek_v3.sh", {"SMOKE": "1"}),
    ],
)
def test_every_command_of_the_example_composes_into_its_stage_config(script, env):
    cmds = _commands(script, **env)
    assert [stage for stage, _ in cmds] == STAGES
    jobs = {stage: _job(stage, overrides) for stage, overrides in cmds}
    smoke = env.get("SMOKE") == "1"
    target = (
        "embedded" if smoke else ("Qwen/Qwen3-8B" if script.startswith("qwen") else "deepseek-ai/DeepSeek-V3")
    )
    for stage in ("prepare", "extract", "train"):
        assert jobs[stage].target.path == target, stage
    for stage in (
        "export",
        "eval",
    ):  # the target comes from the checkpoint: no target= on their command lines
        assert not any(o.startswith("target") for o in dict(cmds)[stage]), stage
    prep, ext, train, ev = (
        jobs["prepare"].prepare,
        jobs["extract"].extract,
        jobs["train"].train,
        jobs["eval"].eval,
    )
    assert prep.regenerate and prep.regen.engine == "server" and prep.regen.request_mode == "tokens"
    assert prep.regen.server_urls == [u for u in env.get("REGEN_URLS", "").split(",") if u]
    assert ext.backend == "vllm" and ext.store.aux_dtype == "int4" and ext.store.distribution == "topk"
    assert ext.samples == str(Path(prep.out_dir) / "train" / "samples.jsonl")
    assert train.data.store_dir == ext.out_dir and train.ttt_steps == 4 and train.threads in (None, 1)
    assert jobs["export"].export.checkpoint == str(Path(train.output_dir) / "best")
    assert ev.export_dir == jobs["export"].export.out_dir and ev.engine == "vllm"
    assert ev.server_url == env.get("EVAL_URL")
    if smoke:  # tiny sizes on the CPU
        assert (
            prep.regen.max_new_tokens <= 64
            and train.max_steps <= 10
            and sum(p.n for p in ev.prompt_sets) <= 4
        )
