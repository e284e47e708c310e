"""Long context: rows up to the target's window and the mixture of row lengths (data.loader), long real prefixes
(data.long_context), and τ against context length (eval.context)."""

from __future__ import annotations

import numpy as np
import pytest

from eyas.data.loader import FeatureLoader, LoaderConfig, plan_epoch, resolve_max_tokens

from .conftest import make_tiny_target
from .test_store import random_samples


def _tokens(plan, lengths, limit):
    return [sum(min(int(lengths[i]), limit) for row in batch for i in row) for batch in plan]


def test_length_mix_sends_each_sample_to_the_shortest_row_that_holds_it_and_keeps_the_shares():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(20, 64, 300), rng.integers(65, 256, 60), [900, 1000]])
    cand = np.arange(len(lengths))
    mix = {64: 3, 256: 1}
    cfg = LoaderConfig(batch_rows=4, length_mix=mix, seed=3)
    assert cfg.length_mix == {64: 0.75, 256: 0.25} and cfg.row_limit == 256
    plan = plan_epoch(lengths, cand, cfg, epoch=0)
    assert plan == plan_epoch(
        lengths, cand, cfg, epoch=0
    )  # a pure function of (seed, epoch, samples, config)
    assert plan != plan_epoch(lengths, cand, cfg, epoch=1)
    per_cap = {64: 0, 256: 0}
    done = []
    for batch in plan:
        lens = [min(int(lengths[i]), 256) for row in batch for i in row]
        cap = 64 if max(lens) <= 64 else 256
        assert all((n <= 64) == (cap == 64) for n in lens), "a batch mixes row lengths"
        assert all(sum(min(int(lengths[i]), 256) for i in row) <= cap for row in batch)
        per_cap[cap] += sum(lens)
        done.append(dict(per_cap))
    total = sum(per_cap.values())
    assert total >= int(np.minimum(lengths, 256).sum())  # the epoch's tokens, split by the weights
    assert per_cap[256] / total == pytest.approx(0.25, abs=0.02)
    # every prefix of the epoch keeps the shares to within one batch (the largest-deficit interleave)
    biggest = max(_tokens(plan, lengths, 256))
    for seen in done:
        assert abs(seen[256] - 0.25 * (seen[64] + seen[256])) <= biggest


def test_length_mix_refuses_an_empty_length_and_bad_weights():
    lengths = np.array([10, 20, 30])
    with pytest.raises(ValueError, match="no sample is 512 tokens or shorter and longer than 64"):
        plan_epoch(lengths, np.arange(3), LoaderConfig(length_mix={64: 1, 512: 1}), 0)
    with pytest.raises(ValueError, match="positive"):
        LoaderConfig(length_mix={64: -1})
    with pytest.raises(ValueError, match="map row lengths"):
        LoaderConfig(length_mix={"long": 1})


def test_window_rows():
    assert resolve_max_tokens({"max_tokens": "window", "batch_rows": 2}, 8192) == {
        "max_tokens": 8192,
        "batch_rows": 2,
    }
    with pytest.raises(ValueError, match="exceed the target's context window"):
        resolve_max_tokens({"max_tokens": 16384}, 8192)
    with pytest.raises(ValueError, match="exceed the target's context window"):
        resolve_max_tokens({"length_mix": {512: 1, 16384: 1}}, 8192)


def test_length_mix_batches_from_a_store(tmp_path):
    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.store import FeatureStore

    target = make_tiny_target(seed=5)
    samples = random_samples(30, seed=7, max_len=40)
    extract(samples, target, tmp_path, ExtractConfig(shard_size=16, max_batch_tokens=128, progress=False))
    store = FeatureStore(tmp_path, expect_target=target.info)
    cfg = LoaderConfig(batch_rows=2, length_mix={16: 1, 48: 1}, pad_to_multiple=8, min_loss_tokens=0)
    by_id = {s.id: s for s in samples}
    shapes = set()
    for batch in FeatureLoader(store, cfg):
        t = batch.input_ids.shape[1]
        longest = max(by_id[i].num_tokens for row in batch.sample_ids for i in row)
        shapes.add(16 if longest <= 16 else 48)
        assert t <= (16 if longest <= 16 else 48)  # short batches are not padded to the long rows
        for r, ids in enumerate(batch.sample_ids):
            assert int(batch.segment_ids[r].max()) == len(ids)
    assert shapes == {16, 48}
