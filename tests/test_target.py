"""The target runner: aux capture equals transformers' output_hidden_states; the slot cache equals a full forward."""

from __future__ import annotations

import pytest
import torch

from eyas.serving.tiny import ARCHS

from .conftest import make_tiny_target


@pytest.mark.parametrize("arch", ARCHS)
def test_aux_capture_matches_output_hidden_states(arch):
    target = make_tiny_target(arch, num_layers=8)
    ids = torch.randint(3, 256, (2, 19))
    out = target.forward(ids)
    ref = target.model(ids, output_hidden_states=True)
    # SGLang id i = output of decoder layer i = transformers hidden_states[i + 1]
    expected = torch.cat([ref.hidden_states[i + 1] for i in target.aux_layers], dim=-1)
    assert target.aux_layers == (1, 3, 4)
    torch.testing.assert_close(out.aux, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_cache_incremental_equals_full_forward(arch):
    """Prefill + one-token steps through the slot cache give the logits of one uncached forward."""
    target = make_tiny_target(arch)
    ids = torch.randint(3, 256, (2, 24))  # longer than gemma3's tiny sliding window (16)
    full = target.forward(ids).logits
    cache = target.new_cache(64)
    n = 10
    cache.prepare(torch.arange(n))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(2, 1, n, n)
    parts = [target.forward(ids[:, :n], cache=cache, attention_mask=mask).logits]
    cache.commit(n)
    for t in range(n, ids.shape[1]):
        cache.prepare(torch.tensor([t]))
        parts.append(
            target.forward(
                ids[:, t : t + 1], cache=cache, attention_mask=torch.ones(2, 1, 1, t + 1, dtype=torch.bool)
            ).logits
        )
        cache.commit(1)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_aux_layer_out_of_range_is_named():
    from eyas.serving.target import target_from_model
    from eyas.serving.tiny import tiny_model

    from .conftest import _TinyTokenizer

    with pytest.raises(ValueError, match=r"aux layer ids \[9\]"):
        target_from_model(tiny_model("llama"), _TinyTokenizer(256), aux_layers=[0, 1, 9])


def test_default_aux_layers_follow_sglang():
    from eyas.serving.target import default_aux_layers

    assert default_aux_layers(30) == [1, 14, 26]
    assert default_aux_layers(61) == [1, 29, 57]  # DeepSeek-V3


def test_commit_keeps_written_rows_or_a_tree_path_and_refuses_unwritten_ones():
    from eyas.serving.kv_cache import SlotCache

    cache = SlotCache(num_layers=1, max_len=16)
    keys = torch.arange(6, dtype=torch.float32).reshape(1, 1, 6, 1)  # row i holds the value i
    cache.prepare(torch.arange(6), 6)
    cache.update(keys, keys, 0)
    cache.commit(2)
    assert cache.length == 2
    cache.commit(path=torch.tensor([1, 3]))  # nodes 1 and 3 after the committed prefix: rows 3 and 5
    assert cache.length == 4
    assert cache.layers[0].keys[0, 0, :4, 0].tolist() == [0.0, 1.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="cannot commit 3 rows at 4"):
        cache.commit(3)
