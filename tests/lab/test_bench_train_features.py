"""bench_train's random features (``bench_train.features=random``) stand in for the target's: the same fields, shapes
and dtypes, so a long row's training step costs what it would on real features, without a target forward."""

from dataclasses import fields

import pytest
import torch

from eyas.lab.bench_train import BenchTrainConfig, random_feature_batches
from eyas.serving.models.target import Target
from eyas.serving.models.tiny import tiny_model
from eyas.train.synthetic import batches_from_sequences, random_sequences
from tests.tokenizers import make_chat_tokenizer


def test_random_features_have_the_targets_shapes_and_dtypes():
    tok = make_chat_tokenizer("chatml")
    target = Target(tiny_model("llama", dtype=torch.bfloat16, vocab_size=len(tok)), tok, name="tiny")
    seqs, masks = random_sequences(2, 40, target.vocab_size, 0.7, seed=0)
    real = batches_from_sequences(target, seqs, masks, batch_size=1, teacher="hidden")
    fake = random_feature_batches(target, seqs, masks)
    assert len(fake) == len(real)
    for r, f in zip(real, fake):
        for fld in fields(r):
            a, b = getattr(r, fld.name), getattr(f, fld.name)
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor), fld.name
                assert (a.shape, a.dtype) == (b.shape, b.dtype), fld.name
            else:
                assert (a is None) == (b is None), fld.name
        assert torch.equal(r.input_ids, f.input_ids) and torch.equal(r.loss_mask, f.loss_mask)
        assert not torch.equal(r.aux, f.aux)  # drawn, not the target's


def test_an_unknown_feature_source_is_refused():
    with pytest.raises(ValueError, match="bench_train.features"):
        BenchTrainConfig(features="store")
