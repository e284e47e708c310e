"""Feature store: quantization bounds, shard file round trips, bit-exact store round trips, refusals that name names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest
import torch

from eyas.data.extract import ExtractConfig, codec_for, compute_features, extract
from eyas.data.quant import (
    FP8_MAX,
    bf16_round_up,
    dequantize_fp8,
    dequantize_int4,
    quantize_fp8,
    quantize_int4,
)
from eyas.data.store import (
    CorruptShardError,
    FeatureCodec,
    FeatureStore,
    IncompleteStoreError,
    Manifest,
    MissingShardError,
    ShardFile,
    StoreMismatchError,
    StoreOptions,
    bytes_per_token,
    sha256_file,
    verify_store,
    write_safetensors,
)
from eyas.data.types import Sample
from tests.conftest import make_tiny_target

OPTIONS = {
    "bf16-hidden": StoreOptions(),
    "bf16-topk": StoreOptions(distribution="topk", topk=8),
    "fp8-hidden": StoreOptions(aux_dtype="float8_e4m3"),
    "fp8-topk": StoreOptions(aux_dtype="float8_e4m3", distribution="topk", topk=8),
    "int4-topk": StoreOptions(aux_dtype="int4", int4_group_size=16, distribution="topk", topk=8),
}


def random_samples(
    n: int, seed: int = 0, max_len: int = 48, vocab: int = 256, prefix: str = "s"
) -> list[Sample]:
    """Samples of random ids (3..vocab-1) and random loss masks, lengths 1..max_len."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(1, max_len + 1)
        out.append(
            Sample(
                id=f"{prefix}{i}",
                input_ids=[rng.randrange(3, vocab) for _ in range(k)],
                loss_mask=[rng.random() < 0.6 for _ in range(k)],
            )
        )
    return out


def small_store(
    tmp_path, options: StoreOptions = OPTIONS["bf16-hidden"], n: int = 20, shard_size: int = 7, target=None
):
    target = target or make_tiny_target()
    samples = random_samples(n)
    cfg = ExtractConfig(store=options, shard_size=shard_size, max_batch_tokens=96, progress=False)
    res = extract(samples, target, tmp_path / "store", cfg)
    return target, samples, cfg, res


# -- quantization ---------------------------------------------------------------------------------------------------
def _activations(n: int = 64, d: int = 3 * 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 2, n)[:, None]  # rows over 5 decades
    x[3, 17] = 900.0  # an outlier
    x[5] = 0.0  # an all-zero row
    return x


def test_bf16_round_up_is_the_smallest_bf16_not_below():
    x = torch.rand(10_000, dtype=torch.float64).float() * 1000 + 1e-6
    y = bf16_round_up(x)
    assert (y.float() >= x).all()
    prev = (y.view(torch.int16) - 1).view(torch.bfloat16).float()  # the bf16 value just below
    assert (prev < x).all()


def test_fp8_error_within_format_bound():
    x = _activations()
    q, s = quantize_fp8(x, num_groups=3)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 3) and s.dtype == torch.bfloat16
    xd = dequantize_fp8(q, s)
    scale = s.float().repeat_interleave(64, dim=1)  # [n, D]: each value's scale
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    err = (xd - x).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max()}"
    assert (q.float().abs() <= FP8_MAX).all()
    assert (xd[5] == 0).all()
    # the bound is tight: e4m3 rounding really reaches ~2^-4 relative error somewhere
    rel = (err / x.abs().clamp_min(1e-30))[x.abs() > scale * 2.0**-6]
    assert rel.max() > 2.0**-5


def test_int4_error_within_format_bound_and_packing_exact():
    x = _activations()
    packed, s = quantize_int4(x, group_size=16)
    assert packed.shape == (64, 96) and packed.dtype == torch.uint8 and s.shape == (64, 12)
    xd = dequantize_int4(packed, s)
    scale = s.float().repeat_interleave(16, dim=1)
    assert ((xd - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert (xd[5] == 0).all()
    # values on the code grid survive exactly (packing/unpacking loses nothing)
    codes = torch.randint(-7, 8, (4, 32), generator=torch.Generator().manual_seed(1)).float()
    codes[:, ::16] = 7.0  # every group reaches the code range, so its scale is exactly the grid's
    grid_scale = torch.tensor([[0.5, 2.0], [1.0, 0.25], [4.0, 1.0], [0.125, 8.0]]).repeat_interleave(
        16, dim=1
    )
    grid = codes * grid_scale
    p2, s2 = quantize_int4(grid, group_size=16)
    torch.testing.assert_close(s2.float().repeat_interleave(16, dim=1), grid_scale, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_int4(p2, s2), grid, rtol=0, atol=0)


# -- shard files ----------------------------------------------------------------------------------------------------
def test_safetensors_writer_round_trips_and_is_readable_by_safetensors(tmp_path):
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {
        "offsets": torch.tensor([0, 3, 7], dtype=torch.int64),
        "f32": torch.randn(7, 5, generator=g),
        "i32": torch.randint(-5, 5, (7, 3), generator=g, dtype=torch.int32),
        "bf16": torch.randn(7, 6, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(7, 6, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    meta = {"eyas": json.dumps({"shard": 0, "sample_ids": ["a", "b"]})}
    w1 = write_safetensors(tmp_path / "a.safetensors", tensors, meta)
    w2 = write_safetensors(tmp_path / "b.safetensors", dict(reversed(list(tensors.items()))), meta)
    assert w1 == w2, "the bytes must not depend on dict order"
    assert w1.sha256 == sha256_file(tmp_path / "a.safetensors")
    assert w1.bytes == (tmp_path / "a.safetensors").stat().st_size
    f = ShardFile(tmp_path / "a.safetensors")
    assert f.metadata == meta
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as ref:
        assert set(ref.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
            assert torch.equal(ref.get_tensor(name).view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("name", list(OPTIONS))
def test_store_round_trip_is_bit_exact(tmp_path, name):
    """What the store gives back equals, bit for bit, the features computed in memory for the same samples."""
    target, samples, cfg, res = small_store(tmp_path, OPTIONS[name])
    store = FeatureStore(res.out_dir, expect_target=target.info, verify="full")
    assert store.num_samples == len(samples) and store.sample_ids == [s.id for s in samples]
    assert res.num_shards == 3 and res.num_tokens == sum(s.num_tokens for s in samples)
    codec = codec_for(target, cfg.store)
    for k in range(res.num_shards):
        chunk = samples[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        block = compute_features(target, chunk, codec, max_batch_tokens=cfg.max_batch_tokens)
        shard = ShardFile(res.out_dir / store.manifest.shards[k].file)
        assert set(shard.header) == set(block.tensors)
        for tname, t in block.tensors.items():
            assert torch.equal(shard.tensor(tname).view(torch.uint8), t.contiguous().view(torch.uint8)), tname
    for i in (0, 8, len(samples) - 1):
        rows = store.rows(i)
        assert rows.id == samples[i].id
        assert rows.input_ids.tolist() == samples[i].input_ids
        assert rows.loss_mask.bool().tolist() == samples[i].loss_mask
        assert set(rows.features) == set(codec.feature_names)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_bytes_per_token_matches_the_files(tmp_path, name):
    _, samples, _, res = small_store(tmp_path, OPTIONS[name])
    bpt = res.bytes_per_token
    manifest = json.loads((res.out_dir / "manifest.json").read_text())
    assert manifest["bytes_per_token"]["total"] == bpt.total
    tensor_bytes = 0
    for entry in manifest["shards"]:
        f = ShardFile(res.out_dir / entry["file"])
        tensor_bytes += f.data_bytes
    offsets_bytes = 8 * (len(samples) + res.num_shards)
    assert tensor_bytes == bpt.total * res.num_tokens + offsets_bytes


def test_bytes_per_token_at_the_embedded_size():
    """H=576, 3 aux layers: each option's bytes follow from its element sizes."""
    h, a = 576, 3
    tok = 4 + 1
    cases = [
        (StoreOptions(), a * h * 2 + h * 2),
        (StoreOptions(distribution="topk", topk=32), a * h * 2 + 32 * (4 + 4)),
        (StoreOptions(aux_dtype="float8_e4m3"), a * h + a * 2 + h * 2),
        (
            StoreOptions(aux_dtype="int4", int4_group_size=64, distribution="topk", topk=32),
            a * h // 2 + a * h // 64 * 2 + 32 * 8,
        ),
    ]
    for opt, expected in cases:
        b = bytes_per_token(h, a, opt)
        assert b.total == expected + tok, opt
        assert b.anchor == 4 * h * 2
    assert bytes_per_token(h, a, StoreOptions()).ratio_to_anchor == pytest.approx(
        (4 * h * 2 + tok) / (4 * h * 2)
    )


def test_topk_is_the_full_distributions_topk_and_stores_no_tail_mass():
    g = torch.Generator().manual_seed(0)
    vocab, k = 1000, 16
    logits = torch.randn(50, vocab, generator=g, dtype=torch.float64) * 3.0
    codec = FeatureCodec(
        StoreOptions(distribution="topk", topk=k), hidden_size=vocab, num_aux=1, vocab_size=vocab
    )
    enc = codec.encode_topk(logits.float(), head=lambda h: h)
    ref = torch.log_softmax(logits.float().double(), dim=-1)  # exact log-softmax of what the head returned
    ref_lp, ref_ids = torch.topk(ref, k, dim=-1)
    assert torch.equal(enc["topk_ids"].long(), ref_ids)
    # fp32 storage: a few fp32 ulps of the log-probability
    torch.testing.assert_close(enc["topk_logprobs"].double(), ref_lp, rtol=4 * 2.0**-23, atol=1e-6)
    # the tail mass is 1 - sum(exp(topk_logprobs)), which the teacher does not use: no bytes are spent on it
    assert set(enc) == {"topk_logprobs", "topk_ids"} and "tail_mass" not in codec.specs
    assert codec.bytes_per_token().distribution == k * (4 + 4)


# -- refusals -------------------------------------------------------------------------------------------------------
def test_checksum_failure_names_the_shard(tmp_path):
    _, _, _, res = small_store(tmp_path)
    path = res.out_dir / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the tensor data: same size, same header
    path.write_bytes(bytes(data))
    FeatureStore(res.out_dir)  # the cheap check cannot see it
    with pytest.raises(CorruptShardError, match="shard-00001.safetensors") as e:
        FeatureStore(res.out_dir, verify="full")
    assert e.value.shards == ["shard-00001.safetensors"]
    report = verify_store(res.out_dir, raise_errors=False)
    assert report.corrupt == ["shard-00001.safetensors"] and not report.missing and not report.ok


def test_truncated_shard_is_refused_on_open(tmp_path):
    _, _, _, res = small_store(tmp_path)
    path = res.out_dir / "shard-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptShardError, match=r"shard-00002\.safetensors: \d+ bytes, manifest says \d+"):
        FeatureStore(res.out_dir)


def test_missing_shards_are_listed(tmp_path):
    _, _, _, res = small_store(tmp_path)
    (res.out_dir / "shard-00000.safetensors").unlink()
    (res.out_dir / "shard-00002.safetensors").unlink()
    with pytest.raises(MissingShardError, match="shard-00000.safetensors, shard-00002.safetensors"):
        FeatureStore(res.out_dir)


def test_store_of_another_target_or_tokenizer_is_refused(tmp_path):
    target, _, _, res = small_store(tmp_path)
    other = dataclasses.replace(target.info, name="tiny-qwen3")
    with pytest.raises(StoreMismatchError, match="'tiny-llama'.*'tiny-qwen3'"):
        FeatureStore(res.out_dir, expect_target=other)
    other_tok = dataclasses.replace(target.info, tokenizer_hash="0123456789abcdef")
    with pytest.raises(
        StoreMismatchError, match=f"tokenizer {target.info.tokenizer_hash}.*tokenizer 0123456789abcdef"
    ):
        FeatureStore(res.out_dir, expect_target=other_tok)
    FeatureStore(res.out_dir, expect_target=target.info)


def test_incomplete_store_is_refused_unless_asked(tmp_path):
    _, _, _, res = small_store(tmp_path)
    m = Manifest.load(res.out_dir)
    m.complete = False
    m.save(res.out_dir)
    with pytest.raises(IncompleteStoreError, match="incomplete"):
        FeatureStore(res.out_dir)
    assert FeatureStore(res.out_dir, allow_incomplete=True).num_samples == 20


def test_manifest_lists_what_a_reader_needs(tmp_path):
    target, samples, cfg, res = small_store(tmp_path, OPTIONS["int4-topk"])
    m = json.loads((res.out_dir / "manifest.json").read_text())
    assert (
        m["target"]["name"] == target.info.name
        and m["target"]["tokenizer_hash"] == target.info.tokenizer_hash
    )
    assert (
        m["aux_layers"] == list(target.info.aux_layers) and m["hidden_size"] == 64 and m["vocab_size"] == 256
    )
    assert m["options"] == {"aux_dtype": "int4", "int4_group_size": 16, "distribution": "topk", "topk": 8}
    assert m["tensors"]["aux_int4"] == {"dtype": "U8", "shape": ["N", 96]}
    assert m["totals"]["num_samples"] == len(samples) and m["complete"] is True
    for entry in m["shards"]:
        digest = hashlib.sha256((res.out_dir / entry["file"]).read_bytes()).hexdigest()
        assert digest == entry["sha256"]
