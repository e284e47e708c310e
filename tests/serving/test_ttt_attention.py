"""The block-wise TTT attention (serving.ttt_attention) against the dense-mask reference: values and gradients of
the attention alone (each of its three paths: whole row, blocks, checkpointed blocks) and of the whole drafter
unroll, on packed rows with padding and grouped heads; which path a row's size takes; and what the unroll keeps
for the backward grows linearly with the row length."""

from __future__ import annotations

import pytest
import torch

import eyas.serving.models.drafter as drafter_module
import eyas.serving.models.ttt_attention as ttt_module
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.ttt_attention import dense_ttt_attention, segment_starts, ttt_attention

B, HEADS, KV, D = 2, 4, 2, 8

# (DENSE_MAX_SCORES, CHECKPOINT_MIN_SCORES) that send every row down one path
PATHS = {"whole": (1 << 62, 1 << 62), "blocks": (-1, 1 << 62), "checkpointed": (-1, -1)}


def _take(monkeypatch, path: str) -> dict[str, int]:
    """Send every row down ``path``; returns call counts of the dense form and of checkpointing."""
    dense_max, ckpt_min = PATHS[path]
    monkeypatch.setattr(ttt_module, "DENSE_MAX_SCORES", dense_max)
    monkeypatch.setattr(ttt_module, "CHECKPOINT_MIN_SCORES", ckpt_min)
    return _spy(monkeypatch)


def _spy(monkeypatch) -> dict[str, int]:
    calls = {"dense": 0, "checkpoint": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(ttt_module, "dense_ttt_attention", counted("dense", ttt_module.dense_ttt_attention))
    monkeypatch.setattr(ttt_module, "checkpoint", counted("checkpoint", ttt_module.checkpoint))
    return calls


def _segments(t: int) -> torch.Tensor:
    """Row 0: samples of 9 and t-15 tokens, then 6 pads; row 1: one sample of t-3 tokens, 3 pads."""
    seg = torch.zeros(B, t, dtype=torch.long)
    seg[0, :9], seg[0, 9 : t - 6], seg[1, : t - 3] = 1, 2, 1
    return seg


def test_segment_starts():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert segment_starts(seg).tolist() == [[0, 0, 2, 2, 2, 5, 6], [0] * 7]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("block", [4, 7, 64])
def test_block_attention_equals_dense_in_values_and_gradients(block, path, monkeypatch):
    calls = _take(monkeypatch, path)
    t = 29
    g = torch.Generator().manual_seed(block)
    seg = _segments(t)

    def rand(heads):
        return torch.randn(B, heads, t, D, generator=g).requires_grad_()

    q, k0, v0 = rand(HEADS), rand(KV), rand(KV)
    keys, values = [rand(KV) for _ in range(3)], [rand(KV) for _ in range(3)]
    for j in range(4):  # step 0 (no diagonal) to step 3
        inputs = [q, k0, v0, *keys[:j], *values[:j]]
        got = ttt_attention(q, k0, v0, keys[:j], values[:j], seg, 0.3, block=block)
        ref = dense_ttt_attention(q, k0, v0, keys[:j], values[:j], seg, 0.3)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        w = torch.randn(got.shape, generator=g)
        g_got = torch.autograd.grad((got * w).sum(), inputs)
        g_ref = torch.autograd.grad((ref * w).sum(), inputs)
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (calls["dense"] > 0) == (path == "whole"), calls  # steps 1..3 of a whole row are the dense form
    assert (calls["checkpoint"] > 0) == (path == "checkpointed"), calls


def test_row_size_picks_the_path(monkeypatch):
    """Defaults: whole-row up to DENSE_MAX_SCORES scores, blocks above it, checkpointed above CHECKPOINT_MIN_SCORES."""
    calls = _spy(monkeypatch)

    def run(t: int) -> dict[str, int]:
        calls.update(dense=0, checkpoint=0)
        q, k0, v0, k1, v1 = (torch.zeros(1, 1, t, 2, requires_grad=True) for _ in range(5))
        ttt_attention(q, k0, v0, [k1], [v1], torch.ones(1, t, dtype=torch.long), 1.0)
        return dict(calls)

    side = int(ttt_module.DENSE_MAX_SCORES**0.5)  # rows of t tokens have t * t scores at B = heads = 1
    assert run(side) == {"dense": 1, "checkpoint": 0}
    assert run(side + 1) == {"dense": 0, "checkpoint": 0}
    big = int(ttt_module.CHECKPOINT_MIN_SCORES**0.5) + 1
    assert run(big)["checkpoint"] > 0 and calls["dense"] == 0


def _naive(q, k0, v0, keys, values, seg, scale, window):
    """The windowed rule row by row, written from its definition: at step j row t (position t + j) sees step-0
    keys s of its own sample with s <= t and t + j - s < window, and its own step-i key iff j - i < window."""
    j = len(keys)
    out = torch.zeros_like(q)
    g = q.shape[1] // k0.shape[1]
    for b in range(q.shape[0]):
        for t in range(q.shape[2]):
            if seg[b, t] == 0:  # padding sees its own step-0 key (no row fully masked)
                cols = [t]
            else:
                cols = [s for s in range(t + 1) if seg[b, s] == seg[b, t] and t + j - s < window]
            ks = [k0[b, :, s] for s in cols] + [
                keys[i - 1][b, :, t] for i in range(1, j + 1) if j - i < window
            ]
            vs = [v0[b, :, s] for s in cols] + [
                values[i - 1][b, :, t] for i in range(1, j + 1) if j - i < window
            ]
            k, v = torch.stack(ks, 1).repeat_interleave(g, 0), torch.stack(vs, 1).repeat_interleave(g, 0)
            p = torch.softmax((q[b, :, t, None] * k).sum(-1) * scale, dim=-1)  # [h, n]
            out[b, :, t] = (p[..., None] * v).sum(1)
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("block,window", [(4, 3), (7, 6), (64, 11)])
def test_windowed_attention_equals_dense_and_the_rule(block, window, path, monkeypatch):
    """With a sliding window: blocks == the dense reference in values and gradients, and both == the rule
    written row by row; steps up to 3 with windows of 3 (narrower than the unroll) to 11."""
    _take(monkeypatch, path)
    t = 29
    g = torch.Generator().manual_seed(block + window)
    seg = _segments(t)

    def rand(heads):
        return torch.randn(B, heads, t, D, generator=g).requires_grad_()

    q, k0, v0 = rand(HEADS), rand(KV), rand(KV)
    keys, values = [rand(KV) for _ in range(3)], [rand(KV) for _ in range(3)]
    for j in range(4):
        inputs = [q, k0, v0, *keys[:j], *values[:j]]
        args = (q, k0, v0, keys[:j], values[:j], seg, 0.3)
        got = ttt_attention(*args, block=block, window=window)
        ref = dense_ttt_attention(*args, window=window)
        with torch.no_grad():
            torch.testing.assert_close(ref, _naive(*args, window), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(ref, dense_ttt_attention(*args))  # the window hides something
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        w = torch.randn(got.shape, generator=g)
        g_got = torch.autograd.grad((got * w).sum(), inputs)
        g_ref = torch.autograd.grad((ref * w).sum(), inputs)
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_windowed_blocks_read_at_most_window_plus_block_keys(monkeypatch):
    """The cost bound: each block call reads <= window + block step-0 keys (plus its diagonal), whatever T."""
    _take(monkeypatch, "blocks")
    seen = []
    real = ttt_module.F.scaled_dot_product_attention
    monkeypatch.setattr(
        ttt_module.F,
        "scaled_dot_product_attention",
        lambda q, k, *a, **kw: seen.append(k.shape[2]) or real(q, k, *a, **kw),
    )
    t, block, window = 200, 8, 16
    x = torch.randn(1, 2, t, 4)
    ttt_attention(
        x, x, x, [x, x], [x, x], torch.ones(1, t, dtype=torch.long), 1.0, block=block, window=window
    )
    assert max(seen) <= window + block + 2 * block, seen
    seen.clear()
    ttt_attention(x, x, x, [x, x], [x, x], torch.ones(1, t, dtype=torch.long), 1.0, block=block)
    assert max(seen) == t + 2 * block  # full attention: the last block reads every earlier key


def test_window_longer_than_the_row_is_full_attention_exactly(monkeypatch):
    _take(monkeypatch, "blocks")
    t = 29
    g = torch.Generator().manual_seed(1)
    q, k0, v0, k1, v1 = (torch.randn(B, h, t, D, generator=g) for h in (HEADS, KV, KV, KV, KV))
    seg = _segments(t)
    for j in range(2):
        args = (q, k0, v0, [k1][:j], [v1][:j], seg, 0.3)
        assert torch.equal(ttt_attention(*args, block=4, window=t + 5), ttt_attention(*args, block=4))


def _drafter(window: int | None = None) -> Eagle3Drafter:
    cfg = DrafterConfig(
        hidden_size=16,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=D,
        intermediate_size=32,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[0, 1, 2],
        max_position_embeddings=256,
        attention_window=window,
    )
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.set_embedding(torch.randn(50, 16))
    return d


def _dense(q, k0, v0, keys, values, segment_ids, scale, starts=None, window=None):
    return dense_ttt_attention(q, k0, v0, keys, values, segment_ids, scale, window=window)


def _unroll(d: Eagle3Drafter, t: int, steps: int = 4):
    g = torch.Generator().manual_seed(t)
    seg = _segments(t)
    pos = torch.zeros(B, t, dtype=torch.long)
    for b in range(B):
        for s in seg[b].unique().tolist():
            at = seg[b] == s
            pos[b, at] = torch.arange(int(at.sum()))
    ids = torch.randint(0, 50, (B, t), generator=g) * (seg > 0)
    aux = torch.randn(B, t, 48, generator=g)
    out = d.forward_ttt(ids, aux, steps, pos, seg)
    logits = [d.logits(h) for h in out.hidden]
    w = [torch.randn(z.shape, generator=g) for z in logits]
    loss = sum((z * wi * v[..., None]).sum() for z, wi, v in zip(logits, w, out.valid))
    d.zero_grad()
    loss.backward()
    return out, {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("path", list(PATHS))
def test_forward_ttt_equals_dense_mask_unroll(path, window, monkeypatch):
    _take(monkeypatch, path)
    d = _drafter(window)
    got, g_got = _unroll(d, 45)
    monkeypatch.setattr(drafter_module, "ttt_attention", _dense)
    ref, g_ref = _unroll(d, 45)
    for a, b in zip(got.hidden, ref.hidden):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g_got[n], g_ref[n], rtol=1e-4, atol=1e-4, msg=n)  # gradients up to ~80


def _saved_bytes(d: Eagle3Drafter, t: int) -> int:
    """Bytes the autograd graph of one unroll keeps for its backward (each storage once: views share it)."""
    storages: dict[int, int] = {}

    def pack(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        d.forward_ttt(torch.zeros(1, t, dtype=torch.long), torch.randn(1, t, 48), 3)
    return sum(storages.values())


def test_unroll_memory_is_linear_in_row_length(monkeypatch):
    _take(
        monkeypatch, "checkpointed"
    )  # what long rows take (short ones keep their scores: CHECKPOINT_MIN_SCORES)
    d = _drafter()
    small, large = _saved_bytes(d, 256), _saved_bytes(d, 1024)
    assert large / small < 4.5, (small, large)  # 4x the tokens: linear, not 16x
    monkeypatch.setattr(drafter_module, "ttt_attention", _dense)
    assert _saved_bytes(d, 1024) / _saved_bytes(d, 256) > 10  # the dense mask is quadratic
