"""Held-out prefixes come from the held-out split of the mixture the drafter was trained on."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, replace

from eyas.data.corpora import load_corpus_config, split_of
from eyas.data.long_prefixes import corpus_of, split_conversations, turn_pairs


def test_prefixes_come_from_the_training_mixtures_own_held_out_split(tmp_path):
    """A user's `corpus.seed=1` moves the mixture's split; the standalone ShareGPT split (seed 0) does not follow."""
    mix = load_corpus_config("demo")
    mix = replace(mix, seed=1)
    held = list(itertools.islice(split_conversations(mix, "eval"), 12))
    assert len(held) == 12 and all(c.source == "sharegpt" for c in held)  # generated sources are not chat
    assert all(split_of(c.id, 1, mix.eval_fraction) == "eval" for c in held)
    standalone = list(itertools.islice(split_conversations("sharegpt", "eval"), 40))
    assert any(split_of(c.id, 1, mix.eval_fraction) == "train" for c in standalone)  # what the fix avoids
    pairs = turn_pairs(mix, limit=12, split="eval")
    held_users = {m["content"] for c in held for m in c.messages if m["role"] == "user"}
    assert pairs and {p[0]["content"] for p in pairs} <= held_users
    # the prepare directory names the mixture as it was prepared, seed included
    (tmp_path / "corpus.json").write_text(json.dumps({"config": asdict(mix), "stats": []}))
    assert corpus_of(str(tmp_path)) == mix
    assert turn_pairs(str(tmp_path), limit=12, split="eval") == pairs


def test_the_context_sweep_defaults_to_the_demo_and_bench_mixtures_split():
    from eyas.eval.context_sweep import ContextConfig

    default = corpus_of(ContextConfig().prefix_corpus)
    for name in ("demo", "bench"):
        mix = load_corpus_config(name)
        assert (mix.seed, mix.eval_fraction) == (default.seed, default.eval_fraction), name
