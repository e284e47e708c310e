"""Extraction job: killed + resumed == uninterrupted (bit for bit), features equal the target's own forward,
resumes that would mix settings or inputs are refused, damaged shards are redone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from eyas.data.extract import (
    KILL_HOOK_ENV,
    ExtractConfig,
    codec_for,
    compute_features,
    extract,
    plan_microbatches,
    read_samples_jsonl,
)
from eyas.data.extract_ranks import part_name
from eyas.data.store import FeatureStore, Manifest, StoreConfigError, StoreMismatchError, StoreOptions
from eyas.data.types import Sample
from tests.conftest import make_tiny_target
from tests.data.test_store import random_samples

ROOT = Path(__file__).resolve().parents[2]
KILL_CFG = dict(shard_size=6, max_batch_tokens=64)


def kill_job(out_dir: str) -> None:
    """The job the kill test runs in a subprocess (and in-process): 20 samples, 4 shards, top-k + fp8."""
    cfg = ExtractConfig(
        store=StoreOptions(aux_dtype="float8_e4m3", distribution="topk", topk=8), progress=False, **KILL_CFG
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic in every process, and fast on a busy machine
    try:
        extract(random_samples(20, seed=1, max_len=24), make_tiny_target(seed=3), out_dir, cfg)
    finally:
        torch.set_num_threads(threads)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != ".lock"}


def test_killed_extraction_resumes_to_an_identical_store(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    env = {**os.environ, KILL_HOOK_ENV: "2", "PYTHONPATH": str(ROOT)}
    code = f"import sys; from tests.data.test_extract import kill_job; kill_job({str(killed)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    m = Manifest.load(killed)
    assert [s.file for s in m.shards] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ] and not m.complete
    assert (killed / "shard-00002.safetensors.tmp").exists(), "the kill should leave a partial temp file"
    assert not (killed / "shard-00002.safetensors").exists(), "a partial shard must never be exposed"
    with pytest.raises(Exception, match="incomplete"):
        FeatureStore(killed)

    kill_job(str(killed))  # resume
    kill_job(str(clean))  # uninterrupted
    a, b = _files(killed), _files(clean)
    assert sorted(a) == ["manifest.json", *[f"shard-0000{k}.safetensors" for k in range(4)]]
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between the resumed and the uninterrupted run"
    FeatureStore(killed, verify="full")


def test_rerun_of_a_complete_store_writes_nothing(tmp_path):
    target = make_tiny_target()
    samples = random_samples(12)
    cfg = ExtractConfig(shard_size=5, progress=False)
    first = extract(samples, target, tmp_path, cfg)
    before = _files(tmp_path)
    again = extract(samples, target, tmp_path, cfg)
    assert (first.shards_written, again.shards_written, again.shards_skipped) == (3, 0, 3)
    assert _files(tmp_path) == before


def test_damaged_shard_is_reextracted_identically(tmp_path):
    target = make_tiny_target()
    samples = random_samples(12)
    cfg = ExtractConfig(shard_size=5, progress=False)
    extract(samples, target, tmp_path, cfg)
    before = _files(tmp_path)
    (tmp_path / "shard-00001.safetensors").unlink()
    p = tmp_path / "shard-00002.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    res = extract(samples, target, tmp_path, cfg)
    assert res.shards_written == 2
    assert _files(tmp_path) == before


def test_one_process_finishes_a_killed_data_parallel_store_from_its_part_files(tmp_path):
    """One process is the data-parallel job with one rank: it keeps the shards that the ranks of a killed run
    finished (listed in their part files, not yet in the manifest), writes only the others, and leaves the store
    an uninterrupted run writes."""
    target = make_tiny_target()
    samples = random_samples(12)
    cfg = ExtractConfig(shard_size=3, progress=False)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    extract(samples, target, clean, cfg)
    shutil.copytree(clean, killed)
    m = Manifest.load(killed)
    # two ranks killed: rank 0 finished shard 0 and died writing shard 2, rank 1 finished shards 1 and 3
    for rank, mine in ((0, [0]), (1, [1, 3])):
        part = {"shards": {str(k): asdict(m.shards[k]) for k in mine}}
        (killed / part_name(rank)).write_text(json.dumps(part))
    (killed / "shard-00002.safetensors").unlink()
    m.shards, m.complete = [], False  # rank 0 writes the manifest's list only at the end
    m.save(killed)
    res = extract(samples, target, killed, cfg)
    assert (res.shards_written, res.shards_skipped) == (1, 3)
    assert _files(killed) == _files(clean)  # part files gone, manifest complete, same bytes


def test_features_equal_the_targets_own_forward(tmp_path):
    """Micro-batching with padding changes nothing: stored rows == a forward of each sample alone (bf16-rounded)."""
    target = make_tiny_target(seed=2)
    samples = random_samples(9, seed=4)
    store_dir = tmp_path / "s"
    extract(samples, target, store_dir, ExtractConfig(shard_size=4, max_batch_tokens=100, progress=False))
    topk_dir = tmp_path / "t"
    extract(
        samples,
        target,
        topk_dir,
        ExtractConfig(store=StoreOptions(distribution="topk", topk=5), shard_size=4, progress=False),
    )
    store, topk = FeatureStore(store_dir), FeatureStore(topk_dir)
    for i, s in enumerate(samples):
        ref = target.forward(torch.tensor([s.input_ids]), logits="all")
        rows = store.rows(i).features
        # bf16 storage of fp32 values computed in differently shaped batches: within one bf16 rounding
        torch.testing.assert_close(rows["aux"].float(), ref.aux[0], rtol=2.0**-8, atol=1e-6)
        torch.testing.assert_close(rows["hidden"].float(), ref.hidden[0], rtol=2.0**-8, atol=1e-6)
        lp, ids = torch.topk(torch.log_softmax(ref.logits[0].double(), -1), 5, dim=-1)
        t = topk.rows(i).features
        assert torch.equal(t["topk_ids"].long(), ids), s.id
        torch.testing.assert_close(t["topk_logprobs"].double(), lp, rtol=0, atol=1e-5)
        assert "tail_mass" not in t  # a function of the top-k; not stored


def test_microbatch_plan_respects_the_padded_budget():
    lengths = [5, 40, 0, 17, 40, 3, 90, 12, 12, 1]
    plan = plan_microbatches(lengths, max_tokens=80, max_rows=3)
    flat = [i for mb in plan for i in mb]
    assert sorted(flat) == [i for i, n in enumerate(lengths) if n > 0]
    for mb in plan:
        longest = max(lengths[i] for i in mb)
        assert lengths[mb[0]] == longest
        assert len(mb) <= 3 and (len(mb) == 1 or len(mb) * longest <= 80)
    assert plan[0] == [6]  # longer than the budget: alone


def test_resume_with_other_settings_is_refused_and_changes_nothing(tmp_path):
    target = make_tiny_target()
    samples = random_samples(10)
    extract(samples, target, tmp_path, ExtractConfig(shard_size=4, progress=False))
    before = _files(tmp_path)
    with pytest.raises(StoreConfigError, match=r"aux_dtype.*'bfloat16'.*'int4'"):
        extract(
            samples,
            target,
            tmp_path,
            ExtractConfig(
                store=StoreOptions(aux_dtype="int4", int4_group_size=16), shard_size=4, progress=False
            ),
        )
    with pytest.raises(StoreConfigError, match="shard_size: store 4, this run 5"):
        extract(samples, target, tmp_path, ExtractConfig(shard_size=5, progress=False))
    with pytest.raises(StoreMismatchError, match="'tiny-llama'.*'tiny-qwen2'"):
        extract(samples, make_tiny_target("qwen2"), tmp_path, ExtractConfig(shard_size=4, progress=False))
    assert _files(tmp_path) == before


def test_resume_with_changed_input_is_refused(tmp_path):
    target = make_tiny_target()
    samples = random_samples(10)
    extract(samples, target, tmp_path, ExtractConfig(shard_size=4, progress=False))
    changed = list(samples)
    changed[5] = Sample(id=changed[5].id, input_ids=[7] * 3, loss_mask=[True] * 3)
    with pytest.raises(StoreConfigError, match="shard 1"):
        extract(changed, target, tmp_path, ExtractConfig(shard_size=4, progress=False))
    with pytest.raises(StoreConfigError, match="holds 3 shards but the input now fills only 2"):
        extract(samples[:8], target, tmp_path, ExtractConfig(shard_size=4, progress=False))


def test_non_store_directory_and_bad_ids_are_refused(tmp_path):
    target = make_tiny_target()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreConfigError, match="not empty and holds no manifest.json"):
        extract(random_samples(3), target, tmp_path, ExtractConfig(progress=False))
    bad = [Sample(id="oov", input_ids=[1, 2, 999], loss_mask=[False, True, True])]
    with pytest.raises(ValueError, match="'oov'.*outside the target's vocabulary"):
        compute_features(target, bad, codec_for(target, StoreOptions()))


def test_non_finite_states_name_the_samples(tmp_path):
    target = make_tiny_target()
    samples = random_samples(4)
    poison = next(t for t in range(3, 256) if all(t not in s.input_ids for s in samples))
    with torch.no_grad():
        target.model.model.embed_tokens.weight[poison] = float("nan")  # poisons the states of its sample only
    bad = Sample(id="poisoned", input_ids=[5, poison, 9], loss_mask=[False, True, True])
    with pytest.raises(FloatingPointError, match=r"\['poisoned'\]"):
        extract([*samples, bad], target, tmp_path, ExtractConfig(shard_size=2, progress=False))
    assert [s.file for s in Manifest.load(tmp_path).shards] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]


def test_samples_jsonl_malformed_record_names_file_and_line(tmp_path):
    p = tmp_path / "samples.jsonl"
    good = {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]}
    p.write_text(json.dumps(good) + "\n" + json.dumps({"id": "b", "input_ids": [1, 2]}) + "\n")
    it = read_samples_jsonl(p)
    assert next(it).loss_mask == [False, True]
    with pytest.raises(ValueError, match=rf"{p}:2: malformed sample record"):
        next(it)


def test_hydra_config_builds_the_extract_job():
    from hydra import compose, initialize_config_dir

    from eyas.common import ConfigError, load_job
    from eyas.data.extract import ExtractJob

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["extract.samples=x.jsonl", "extract.store.distribution=topk"])
        bad = compose("config", overrides=["extract.shard_size=many"])
    job = load_job(cfg, ExtractJob)
    assert job.extract.samples == "x.jsonl"
    ec = job.extract.settings()
    assert (
        type(ec) is ExtractConfig and ec.store == StoreOptions(distribution="topk") and ec.shard_size == 1024
    )
    with pytest.raises(ConfigError, match=r"^extract.shard_size: expected int, got 'many'$"):
        load_job(bad, ExtractJob)


@pytest.mark.slow
def test_embedded_target_chat_samples(tmp_path, embedded_target_fp32):
    """Real chat text through the embedded tokenizer's template: stored hidden → head reproduces the stored top-1."""
    target = embedded_target_fp32
    tok = target.tokenizer
    chats = [
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3, 4, 5"}],
    ]
    samples = []
    for i, chat in enumerate(chats):
        prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(chat, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        assert ids[: len(p_ids)] == p_ids
        samples.append(
            Sample(id=f"chat{i}", input_ids=ids, loss_mask=[j >= len(p_ids) for j in range(len(ids))])
        )
    hid = extract(samples, target, tmp_path / "h", ExtractConfig(progress=False))
    top = extract(
        samples,
        target,
        tmp_path / "t",
        ExtractConfig(store=StoreOptions(distribution="topk", topk=4), progress=False),
    )
    assert hid.bytes_per_token.total == 3 * 576 * 2 + 576 * 2 + 5
    h, t = (
        FeatureStore(hid.out_dir, expect_target=target.info),
        FeatureStore(top.out_dir, expect_target=target.info),
    )
    for i in range(len(samples)):
        logits = target.head(h.rows(i).features["hidden"].float())
        top1 = t.rows(i).features["topk_ids"][:, 0].long()
        agree = (logits.argmax(-1) == top1).float().mean()
        assert agree >= 0.9, (
            f"{samples[i].id}: only {agree:.0%} of bf16-hidden argmaxes match the stored top-1"
        )
