"""Data-parallel extraction launched for real on two loopback "nodes" (``accelerate launch --num_machines 2
--machine_rank R -m eyas.data.extract``, one worker each): the store equals a single-process store shard for
shard, byte for byte (manifest included); a run killed on one rank resumes to that same store (on two nodes or
one process); a store refused by rank 0 stops every node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eyas.data.extract import KILL_HOOK_ENV, ExtractConfig, extract, read_samples_jsonl
from eyas.data.store import FeatureStore, Manifest
from eyas.serving.models.target import TargetConfig, load_target
from tests.data.test_store import random_samples
from tests.launch import launch_two_nodes, needs_accelerate

pytestmark = [pytest.mark.distributed, needs_accelerate]

SETTINGS = {"shard_size": 4, "max_batch_tokens": 64}  # 22 samples: 6 shards, the last one of 2 samples
NUM_SAMPLES = 22


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("samples") / "samples.jsonl"
    with p.open("w") as f:
        for s in random_samples(NUM_SAMPLES, seed=5, max_len=20, vocab=200):
            f.write(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
    return p


def _target(tiny_target_dir: Path):
    return load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def single_store(tiny_target_dir, samples_file, tmp_path_factory) -> Path:
    """The reference: the same samples extracted by one process (this one, on one thread like the workers)."""
    out = tmp_path_factory.mktemp("single_store")
    cfg = ExtractConfig(progress=False, **SETTINGS)
    res = extract(read_samples_jsonl(samples_file), _target(tiny_target_dir), out, cfg)
    assert (res.num_shards, res.num_samples) == (6, NUM_SAMPLES)
    return out


def _launch(
    tiny_target_dir: Path,
    samples_file: Path,
    out: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    launcher: str = "cpu_ddp",
    check: bool = True,
    **settings,
) -> list[int]:
    """``python -m eyas.data.extract`` on two loopback nodes (``launcher``: an accelerate config or torchrun);
    the nodes' exit codes (see :func:`launch_two_nodes`)."""
    args = [
        "-m",
        "eyas.data.extract",
        f"target.path={tiny_target_dir}",
        "target.dtype=float32",
        "target.device=cpu",
        f"extract.samples={samples_file}",
        f"extract.out_dir={out}",
        *(f"extract.{k}={v}" for k, v in {**SETTINGS, **settings}.items()),
        "extract.progress=false",
        f"hydra.run.dir={logs}/hydra",
    ]
    return launch_two_nodes(launcher, args, logs, env=env, check=check)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != ".lock"}


def _assert_same_store(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == ["manifest.json", *[f"shard-{k:05d}.safetensors" for k in range(6)]], sorted(fa)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs from the single-process store's"
    FeatureStore(a, verify="full")


def test_two_node_extraction_equals_single_process_store_shard_for_shard(
    tiny_target_dir, samples_file, single_store, tmp_path
):
    out = tmp_path / "store"
    _launch(tiny_target_dir, samples_file, out, tmp_path / "logs")
    _assert_same_store(out, single_store)
    m = Manifest.load(out)
    assert m.complete and sum(s.num_samples for s in m.shards) == NUM_SAMPLES
    # each node extracted its own shards (k % 2 == machine rank): the work was split, not repeated
    for rank, mine in ((0, [0, 2, 4]), (1, [1, 3, 5])):
        log = (tmp_path / "logs" / f"node{rank}.log").read_text()
        assert f"rank {rank}/2: extracted shards {mine}" in log, log[-3000:]


def test_two_node_extraction_killed_on_one_rank_resumes_to_the_same_store(
    tiny_target_dir, samples_file, single_store, tmp_path
):
    out = tmp_path / "store"
    # rank 1 dies half-way through writing shard 3 (its second); rank 0 is then killed by the launcher helper
    codes = _launch(
        tiny_target_dir, samples_file, out, tmp_path / "killed", env={KILL_HOOK_ENV: "3"}, check=False
    )
    assert codes[1] not in (0, -9), codes  # node 1's launcher reports its killed worker
    part = json.loads((out / "manifest.rank00001.json").read_text())
    assert sorted(part["shards"]) == ["1"], part  # shard 1 finished before the kill, shard 3 did not
    assert not Manifest.load(out).complete
    alone = tmp_path / "finished_alone"  # a single process may finish it too (and drops the part files)
    shutil.copytree(out, alone)
    extract(
        read_samples_jsonl(samples_file),
        _target(tiny_target_dir),
        alone,
        ExtractConfig(progress=False, **SETTINGS),
    )
    _assert_same_store(alone, single_store)
    _launch(tiny_target_dir, samples_file, out, tmp_path / "resumed")
    log = (tmp_path / "resumed" / "node1.log").read_text()
    assert "rank 1/2: extracted shards [3, 5], found shards [1] finished" in log, log[-3000:]
    _assert_same_store(out, single_store)


def test_two_torchrun_node_extraction_equals_single_process_store(
    tiny_target_dir, samples_file, single_store, tmp_path
):
    """``torchrun --nnodes 2 --rdzv_endpoint ... -m eyas.data.extract`` (ranks are given by the rendezvous)."""
    out = tmp_path / "store"
    _launch(tiny_target_dir, samples_file, out, tmp_path / "logs", launcher="torchrun")
    _assert_same_store(out, single_store)
    logs = "".join((tmp_path / "logs" / f"node{r}.log").read_text() for r in range(2))
    assert "rank 0/2: extracted shards [0, 2, 4]" in logs and "rank 1/2: extracted shards [1, 3, 5]" in logs


def test_two_node_resume_with_other_settings_is_refused_on_every_node(
    tiny_target_dir, samples_file, single_store, tmp_path
):
    """Rank 0 refuses the store; rank 1 hears it and stops too (exits by itself, not left waiting)."""
    out = tmp_path / "store"
    shutil.copytree(single_store, out)
    before = _files(out)
    codes = _launch(tiny_target_dir, samples_file, out, tmp_path / "logs", check=False, shard_size=5)
    assert 0 not in codes and -9 not in codes, codes
    logs = [(tmp_path / "logs" / f"node{r}.log").read_text() for r in range(2)]
    assert "shard_size: store 4, this run 5" in logs[0], logs[0][-3000:]
    assert "rank 0 could not open the feature store" in logs[1], logs[1][-3000:]
    assert _files(out) == before
