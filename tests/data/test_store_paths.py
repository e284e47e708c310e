"""A store's manifest cannot point eyas at a file outside the store: shard k is ``shard-<k>.safetensors`` inside
the store directory, and a manifest listing anything else is refused, naming the manifest, before any file is
opened, by readers and by a resumed extraction alike."""

from __future__ import annotations

import json

import pytest

from eyas.data.extract import ExtractConfig, extract
from eyas.data.store import MANIFEST, FeatureStore, StoreError

from ..conftest import make_tiny_target
from .test_store import random_samples


@pytest.mark.parametrize(
    "name", ["../victim.safetensors", "/tmp/victim.safetensors", "shard-00000.safetensors"]
)
def test_a_manifest_naming_a_file_outside_the_store_is_refused(tmp_path, name):
    target = make_tiny_target()
    samples = random_samples(6, seed=1, max_len=12, vocab=64)
    store = tmp_path / "store"
    extract(samples, target, store, ExtractConfig(shard_size=3, progress=False))
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes((store / "shard-00001.safetensors").read_bytes())
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][1]["file"] = name  # shard 1 listed under another name (shard 0's, or a path outside)
    (store / MANIFEST).write_text(json.dumps(manifest))
    for call in (
        lambda: FeatureStore(store, verify="full"),
        lambda: extract(samples, target, store, ExtractConfig(shard_size=3, progress=False)),
    ):
        with pytest.raises(StoreError) as e:
            call()
        msg = str(e.value)
        assert str(store / MANIFEST) in msg and f"shard 1 is listed as {name!r}" in msg
    assert victim.exists()
