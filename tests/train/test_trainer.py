"""The training loop on a tiny target: learning, SIGKILL + resume == uninterrupted, NaN stop, config-mismatch and
empty-data errors, a store of another target refused, and store-fed loss == online loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eyas.train.checkpoint import CheckpointMismatchError, TrainerState, latest_checkpoint, load_weights
from eyas.train.config import DraftModelConfig, SyntheticDataConfig, TrainConfig
from eyas.train.losses import DistillationModel, VocabMaps, build_teacher
from eyas.train.setup import build_drafter
from eyas.train.sources import ListSource
from eyas.train.synthetic import synthetic_data
from eyas.train.trainer import EmptyDataError, NonFiniteLossError, evaluate, fit
from eyas.train.vocab import build_draft_vocab
from tests.conftest import make_tiny_target

REPO = Path(__file__).resolve().parents[2]


def tiny_setup(num_samples: int = 8, seq_len: int = 24, draft_vocab: int = 256):
    """A tiny target with a sharp next-token distribution (learnable), its synthetic data and a fresh drafter."""
    target = make_tiny_target("llama", seed=3)
    with torch.no_grad():
        target.head.weight.mul_(50.0)
    data = synthetic_data(
        target, SyntheticDataConfig(num_samples=num_samples, eval_samples=4, seq_len=seq_len, shuffle=False)
    )
    vocab = build_draft_vocab(data.vocab_counts, draft_vocab)
    drafter = build_drafter(
        target, DraftModelConfig(draft_vocab_size=draft_vocab, init="random"), vocab, seed=0
    )
    return target, drafter, data


def tiny_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        output_dir=str(out),
        max_steps=8,
        lr=3e-3,
        warmup_steps=1,
        eval_every=0,
        save_every=2,
        log_every=1,
        progress=False,
        wandb={"mode": "disabled"},
    )
    base.update(kw)
    return TrainConfig(**base)


def fit_on_train(cfg: TrainConfig, target, drafter, data):
    """Train on the shuffled training split and evaluate on it too (8 random sequences cannot generalise)."""
    return fit(
        cfg,
        drafter,
        ListSource(data.train, shuffle=True),
        data.train,
        head=target.head,
        target_info=target.info,
    )


class SlowSource(ListSource):
    """A ListSource that sleeps before each batch (keeps the child run alive long enough to be killed)."""

    def __init__(self, batches, delay: float):
        super().__init__(batches, shuffle=False)
        self.delay = delay

    def __iter__(self):
        for b in super().__iter__():
            time.sleep(self.delay)
            yield b


CHILD = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.train.test_trainer import SlowSource, tiny_cfg, tiny_setup
from eyas.train.trainer import fit
torch.set_num_threads(1)  # after the imports: tests/conftest.py sets its own count
target, drafter, data = tiny_setup()
fit(tiny_cfg({out!r}), drafter, SlowSource(data.train, 0.3), data.eval, head=target.head, target_info=target.info)
"""


def test_training_lowers_the_loss_and_raises_acceptance(tmp_path):
    target, drafter, data = tiny_setup()
    cfg = tiny_cfg(tmp_path, max_steps=24, save_every=0)
    maps = VocabMaps.from_draft_ids(drafter.draft_to_target, drafter.config.vocab_size)
    kw = dict(maps=maps, form="auto", oov_rule="teacher", head=target.head)
    stub = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    # 8 random sequences cannot generalise: "held out" here is the training set itself (can it fit the teacher?)
    before = evaluate(stub, DistillationModel(drafter, cfg.step_weights), data.train, kw, cfg.step_weights)
    res = fit_on_train(cfg, target, drafter, data)
    assert res.steps == 24 and res.final_eval is not None
    assert res.final_eval["loss"] < 0.8 * before.loss
    assert res.final_eval["step_acc"][0] > before.step_acc[0] + 0.1
    assert res.final_eval["tau_chain"] > before.acceptance.tau_chain
    assert res.final_eval["tau_served"] > before.acceptance.tau_served
    assert all(torch.isfinite(v).all() for v in load_weights(res.last_checkpoint).values())
    assert (tmp_path / "best" / "drafter.safetensors").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len([x for x in lines if '"kind": "train"' in x]) == 24


def test_a_frozen_lm_head_stays_as_built_and_the_rest_trains(tmp_path):
    target, drafter, data = tiny_setup()
    head0 = drafter.lm_head.weight.detach().clone()
    fc0 = drafter.fc.weight.detach().clone()
    cfg = tiny_cfg(tmp_path, max_steps=4, save_every=0, freeze_lm_head=True)
    res = fit_on_train(cfg, target, drafter, data)
    saved = load_weights(res.last_checkpoint)
    assert torch.equal(saved["lm_head.weight"].float(), head0)
    assert not torch.equal(saved["fc.weight"].float(), fc0)
    assert "freeze_lm_head" in cfg.identity() and "freeze_lm_head" not in tiny_cfg(tmp_path).identity()


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=str(REPO), out=str(killed))],
        env={**os.environ, "WANDB_MODE": "disabled"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while not (killed / "checkpoints" / "step_00000002").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the child never wrote its first checkpoint"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    stopped_at = TrainerState.read(latest_checkpoint(killed / "checkpoints")).step
    assert 2 <= stopped_at < 8, "the child must be killed before it finished"

    target, drafter, data = tiny_setup()
    resumed = fit(
        tiny_cfg(killed),
        drafter,
        ListSource(data.train, shuffle=False),
        data.eval,
        head=target.head,
        target_info=target.info,
    )
    assert resumed.resumed_from is not None and resumed.steps_this_run == 8 - stopped_at
    target, drafter, data = tiny_setup()
    straight = fit(
        tiny_cfg(tmp_path / "straight"),
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
    steps = [
        int(x.split('"step": ')[1].split(",")[0])
        for x in (killed / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in x
    ]
    assert steps == list(range(1, 9))  # the killed run's lines past its checkpoint were dropped


def test_nan_loss_stops_with_step_and_sample_ids_and_keeps_last_good_checkpoint(tmp_path):
    target, drafter, data = tiny_setup()
    batches = list(data.train)
    bad = batches[2]
    bad.aux = bad.aux.clone()
    bad.aux[0, 5] = float("nan")
    with pytest.raises(NonFiniteLossError, match="step 3") as err:
        fit(
            tiny_cfg(tmp_path, save_every=1),
            drafter,
            ListSource(batches, shuffle=False),
            None,
            head=target.head,
            target_info=target.info,
        )
    assert err.value.step == 3 and err.value.sample_ids == bad.sample_ids[0]
    last = latest_checkpoint(tmp_path / "checkpoints")
    assert TrainerState.read(last).step == 2
    assert all(torch.isfinite(v).all() for v in load_weights(last).values())


def test_resume_with_another_config_or_no_data_is_refused(tmp_path):
    target, drafter, data = tiny_setup(num_samples=2)
    fit(
        tiny_cfg(tmp_path, max_steps=2),
        drafter,
        ListSource(data.train),
        None,
        head=target.head,
        target_info=target.info,
    )
    with pytest.raises(CheckpointMismatchError, match=r"lr: 0\.003 -> 0\.002"):
        fit(
            tiny_cfg(tmp_path, max_steps=2, lr=2e-3),
            drafter,
            ListSource(data.train),
            None,
            head=target.head,
            target_info=target.info,
        )
    with pytest.raises(FileExistsError, match="resume=never"):
        fit(
            tiny_cfg(tmp_path, max_steps=2, resume="never"),
            drafter,
            ListSource(data.train),
            None,
            head=target.head,
            target_info=target.info,
        )
    with pytest.raises(EmptyDataError, match="empty"):
        fit(
            tiny_cfg(tmp_path / "empty"),
            drafter,
            ListSource([]),
            None,
            head=target.head,
            target_info=target.info,
        )


def _samples():
    from tests.data.test_store import random_samples

    return random_samples(12, seed=4, max_len=30)


def test_store_data_for_its_target_and_refused_for_another(tmp_path):
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.store import StoreMismatchError
    from eyas.train.setup import run_data

    samples = _samples()
    target = make_tiny_target(seed=1)
    extract(samples, target, tmp_path / "store", ExtractConfig(progress=False))
    cfg = tiny_cfg(
        tmp_path,
        data={
            "source": "store",
            "store_dir": str(tmp_path / "store"),
            "eval_fraction": 0.3,
            "loader": {"batch_rows": 2, "max_tokens": 64},
        },
    )
    rd = run_data(target, cfg, rank=0, world=1)
    train_ids = {i for b in rd.train for row in b.sample_ids for i in row}
    eval_ids = {i for b in rd.eval for row in b.sample_ids for i in row}
    assert train_ids and eval_ids and not train_ids & eval_ids
    expected = sum(s.num_loss_tokens for s in samples if s.id in train_ids)
    assert int(rd.vocab_counts.sum()) == expected  # the vocabulary counts the training split only
    # loss on every token: the training batches carry it, the held-out ones (τ_sim) and the vocabulary do not
    cfg.data.loader["loss_on"] = "all"
    every = run_data(target, cfg, rank=0, world=1)
    assert all(torch.equal(b.loss_mask, b.segment_ids > 0) for b in every.train)
    assert sum(int(b.loss_mask.sum()) for b in every.eval) == sum(int(b.loss_mask.sum()) for b in rd.eval)
    assert torch.equal(every.vocab_counts, rd.vocab_counts)
    other = make_tiny_target(seed=1, hidden_size=32)
    with pytest.raises(StoreMismatchError, match="hidden_size"):
        run_data(other, cfg, rank=0, world=1)


def test_a_length_mix_trains_on_its_shares_and_measures_the_held_out_split_whole(tmp_path):
    """A held-out split without a long sample (a few long conversations among many short ones) still gives τ_sim
    batches: the mix's shares are the training rows', the held-out samples go whole into rows of its longest length
    (the eval loader used to take the mix and refuse to plan an epoch without a long sample)."""
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.types import Sample
    from eyas.train.setup import run_data
    from tests.data.test_store import random_samples

    short = random_samples(24, seed=4, max_len=16)
    rng = torch.Generator().manual_seed(0)
    longs = [
        Sample(f"long{i}", torch.randint(3, 256, (40,), generator=rng).tolist(), [True] * 40) for i in (1, 2)
    ]  # ids the split keeps in training (data.loader.in_eval_split: a hash of the id)
    target = make_tiny_target(seed=1)
    extract(short + longs, target, tmp_path / "store", ExtractConfig(progress=False))
    loader = {"batch_rows": 1, "max_tokens": 16, "packing": "packed", "length_mix": {16: 3, 48: 1}}
    data = {"source": "store", "store_dir": str(tmp_path / "store"), "eval_fraction": 0.25, "loader": loader}
    rd = run_data(target, tiny_cfg(tmp_path, data=data), rank=0, world=1)
    by_id = {s.id: s for s in short + longs}
    eval_ids = {i for b in rd.eval for row in b.sample_ids for i in row}
    train_ids = {i for b in rd.train for row in b.sample_ids for i in row}
    assert eval_ids and not eval_ids & {"long1", "long2"}  # the case: no long sample held out
    assert {"long1", "long2"} <= train_ids  # the training rows take the long share
    assert max(b.input_ids.shape[1] for b in rd.train) > 16
    held = sum(by_id[i].num_tokens for i in eval_ids)
    assert sum(int((b.segment_ids > 0).sum()) for b in rd.eval) == held  # every held-out sample whole


def test_a_flipped_byte_in_a_shard_stops_training_naming_the_shard(tmp_path):
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.store import CorruptShardError
    from eyas.train.setup import run_data

    target = make_tiny_target(seed=1)
    extract(_samples(), target, tmp_path / "store", ExtractConfig(shard_size=3, progress=False))
    shard = tmp_path / "store" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside the tensor data: same size, same header
    shard.write_bytes(bytes(data))
    data_cfg = {"source": "store", "store_dir": str(tmp_path / "store"), "eval_fraction": 0.0}
    data_cfg["loader"] = {"batch_rows": 2, "max_tokens": 64}
    with pytest.raises(CorruptShardError, match=r"shard-00001\.safetensors fails its checksum") as e:
        rd = run_data(target, tiny_cfg(tmp_path, data=data_cfg), rank=0, world=1)  # the vocabulary reads it
        list(rd.train)
    assert "extract.verify_resume=full" in str(e.value)
    skip = run_data(target, tiny_cfg(tmp_path, data={**data_cfg, "verify_checksums": False}), rank=0, world=1)
    assert sum(1 for _ in skip.train) > 0  # the flag skips the check


@pytest.mark.parametrize("preset", ["default", "demo", "smoke"])
def test_hydra_presets_build_typed_configs(preset):
    from hydra import compose, initialize_config_dir

    from eyas.train.__main__ import train_job

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"train={preset}"])
    job = train_job(cfg)
    train_cfg = job.train
    assert isinstance(train_cfg.data.synthetic, SyntheticDataConfig) and train_cfg.betas == (0.9, 0.95)
    # the YAML spells out every option of every config dataclass (nothing silently left to a code default)
    from dataclasses import fields

    from eyas.train.config import DataSourceConfig, WandbConfig

    for cls, node in [
        (TrainConfig, cfg.train),
        (DraftModelConfig, cfg.drafter),
        (WandbConfig, cfg.train.wandb),
        (DataSourceConfig, cfg.train.data),
        (SyntheticDataConfig, cfg.train.data.synthetic),
    ]:
        assert {f.name for f in fields(cls)} == set(node), cls.__name__


@pytest.mark.parametrize("opts", [{}, {"aux_dtype": "float8_e4m3", "distribution": "topk", "topk": 8}])
def test_store_fed_loss_equals_online_loss(tmp_path, opts):
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.loader import FeatureLoader, LoaderConfig
    from eyas.data.online import online_loader
    from eyas.data.store import FeatureStore, StoreOptions

    target = make_tiny_target(seed=2)
    samples = _samples()
    options = StoreOptions(**opts)
    extract(samples, target, tmp_path / "s", ExtractConfig(store=options, progress=False))
    lc = LoaderConfig(batch_rows=1, max_tokens=48, shuffle=False)  # packed: several samples per row
    stored = list(FeatureLoader(FeatureStore(tmp_path / "s", expect_target=target.info), lc))
    online = list(online_loader(samples, target, lc, options))
    assert len(stored) == len(online) > 2
    vocab = build_draft_vocab(torch.ones(target.vocab_size, dtype=torch.long), 128)
    drafter = build_drafter(target, DraftModelConfig(draft_vocab_size=128), vocab, seed=0)
    maps = VocabMaps.from_draft_ids(vocab.draft_to_target, target.vocab_size)
    model = DistillationModel(drafter, [0.8**j for j in range(3)])
    losses = []
    for a, b in zip(stored, online):
        pair = []
        for batch in (a, b):
            t = build_teacher(batch, maps, head=target.head)
            with torch.no_grad():
                out = model(batch.input_ids, batch.aux, batch.position_ids, batch.segment_ids, t, 1.0)
            pair.append(out.loss)
        losses.append(pair)
    s, o = torch.stack([p[0] for p in losses]), torch.stack([p[1] for p in losses])
    assert bool((s > 0).all())
    torch.testing.assert_close(s, o, rtol=1e-6, atol=1e-6)
