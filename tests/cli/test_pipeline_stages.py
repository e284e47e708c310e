"""The pipeline's extract-stage reports: store size per option and the speed check against a bare forward."""

from __future__ import annotations

import random

from eyas.data.extract import ExtractConfig
from eyas.data.extract_speed import extraction_speed_check
from eyas.data.store import StoreOptions
from eyas.data.types import Sample
from eyas.pipeline import store_sizes
from tests.conftest import make_tiny_target


def _samples(n: int, vocab: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        k = rng.randint(8, 40)
        out.append(Sample(f"s{i}", [rng.randrange(vocab) for _ in range(k)], [j > 2 for j in range(k)]))
    return out


def test_store_sizes_cover_every_option_and_order_by_precision():
    target = make_tiny_target("llama")
    sizes = store_sizes(target)
    h, n_aux = target.info.hidden_size, len(target.info.aux_layers)
    anchor = 4 * h * 2
    assert {b.anchor for b in sizes.values()} == {anchor}
    # bf16 aux + bf16 final hidden = the anchor, plus the token id and loss mask bytes
    assert sizes["bf16+hidden"].total == (n_aux + 1) * h * 2 + sizes["bf16+hidden"].tokens
    assert sizes["int4+top32"].total < sizes["fp8+top32"].total < sizes["bf16+top32"].total
    assert sizes["fp8+hidden"].total < sizes["bf16+hidden"].total


def test_speed_check_times_the_same_tokens_both_ways(tmp_path):
    target = make_tiny_target("llama")
    samples = _samples(12, target.info.vocab_size)
    cfg = ExtractConfig(store=StoreOptions(distribution="topk", topk=4), shard_size=4, progress=False)
    check = extraction_speed_check(samples, target, cfg, max_tokens=100, repeats=1)
    lengths = [s.num_tokens for s in samples]
    first = next(i for i in range(len(lengths)) if sum(lengths[: i + 1]) >= 100)
    assert check["check_tokens"] == sum(lengths[: first + 1])
    assert min(check["bare_forward_tokens_per_s"], check["bare_base_tokens_per_s"]) > 0
    assert check["check_extract_tokens_per_s"] > 0
    ratio = check["bare_forward_tokens_per_s"] / check["check_extract_tokens_per_s"]
    assert abs(check["extract_time_vs_bare_forward"] - ratio) < 0.01 * ratio + 1e-3


def test_two_stores_of_one_target_train_in_separate_runs(tmp_path):
    """The recipe study trains the same variant on the target's answers and on the corpus's: two stores of one
    target, one manifest identity. Their runs must not share a directory (the trainer would refuse to resume the
    other's checkpoint); the same store and settings must find their run again."""
    from eyas.data.extract import extract
    from eyas.data.store import FeatureStore
    from eyas.pipeline import train_key
    from eyas.train.config import DraftModelConfig, TrainConfig

    target = make_tiny_target("llama")
    cfg = ExtractConfig(store=StoreOptions(distribution="topk", topk=4), shard_size=4, progress=False)
    samples = _samples(8, target.info.vocab_size)
    extract(samples, target, tmp_path / "a", cfg)
    extract(samples[:4] + _samples(12, target.info.vocab_size)[8:], target, tmp_path / "b", cfg)
    extract(samples, target, tmp_path / "a2", cfg)
    a, b, a2 = (FeatureStore(tmp_path / n, expect_target=target.info) for n in ("a", "b", "a2"))
    assert a.manifest.identity() == b.manifest.identity()  # what the key held alone before
    d, t = DraftModelConfig(), TrainConfig()
    assert train_key(a, d, t) != train_key(b, d, t)
    assert train_key(a, d, t) == train_key(a2, d, t)  # same data, same settings: the run resumes
    assert train_key(a, d, t) != train_key(a, d, TrainConfig(lr=3e-3))


def test_train_key_resolves_the_optimizer_as_the_launch_does(tmp_path, monkeypatch):
    """``train.optimizer=auto`` is Muon in a plain launch and AdamW under DeepSpeed, and the trainer's resume check
    compares the resolved name: the two launches of one config must not share a run directory, while ``auto`` and
    the optimizer it resolves to, named outright, must."""
    from eyas.data.extract import extract
    from eyas.data.store import FeatureStore
    from eyas.pipeline import train_key
    from eyas.train.config import DraftModelConfig, TrainConfig

    target = make_tiny_target("llama")
    cfg = ExtractConfig(store=StoreOptions(distribution="topk", topk=4), shard_size=4, progress=False)
    extract(_samples(4, target.info.vocab_size), target, tmp_path / "s", cfg)
    store = FeatureStore(tmp_path / "s", expect_target=target.info)
    d = DraftModelConfig()
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    plain = train_key(store, d, TrainConfig(optimizer="auto"))
    assert plain == train_key(store, d, TrainConfig(optimizer="muon"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    under_ds = train_key(store, d, TrainConfig(optimizer="auto"))
    assert under_ds != plain
    assert under_ds == train_key(store, d, TrainConfig(optimizer="adamw"))


def test_the_export_is_served_at_the_evaluated_k_labelled_with_its_hardware_and_split(tmp_path, monkeypatch):
    """The pipeline records the evaluation's K in the export's serve entry with the machine whose step times chose
    it (a 2-core CPU's K is no GPU's) and the calibration prompts it was chosen on."""
    import json
    from pathlib import Path

    import eyas.eval.stage as stage
    from eyas.eval.acceptance import AcceptanceResult
    from eyas.eval.recommend import ChainLengthRecommendation
    from eyas.eval.stage import EvalResult, EvalStageConfig
    from eyas.pipeline import stage_eval
    from eyas.serving.export import export
    from eyas.serving.load import random_drafter

    target = make_tiny_target("llama")
    export(random_drafter(target, 64, seed=3), target, tmp_path / "export")
    hw = {"cpu": "AMD EPYC", "threads": 2, "torch": "2.9.0"}
    rec = ChainLengthRecommendation("eagle3-chain", 6, 2, [1.0] * 7, chosen_on={"reasoning": 4}, hardware=hw)
    result = EvalResult(AcceptanceResult([], {}), None, tmp_path / "report.md", 1.0, None, rec)
    monkeypatch.setattr(stage, "run", lambda *a, **k: result)
    ecfg = EvalStageConfig(prompt_sets=[{"name": "reasoning", "source": "x", "n": 2}])
    stage_eval(tmp_path / "export", ecfg, target, tmp_path, {}, "cmd")
    serve = json.loads(Path(tmp_path / "export" / "eyas_export.json").read_text())["serve"]
    assert serve["num_speculative_tokens"] == 2
    assert serve["profiled_on"] == hw
    assert serve["chosen_on"] == {"split": "calibration", "prompts": {"reasoning": 4}}
