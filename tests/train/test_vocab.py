"""Draft vocabulary: most frequent loss-masked tokens, deterministic ties, coverage, errors, round trip."""

from __future__ import annotations

import pytest
import torch

from eyas.data.types import Sample
from eyas.train.vocab import DraftVocab, build_draft_vocab, count_loss_tokens


def test_counts_only_loss_masked_tokens_and_picks_the_most_frequent():
    samples = [
        Sample(
            "a", [5, 5, 5, 1, 2, 9], [True, True, True, False, False, True]
        ),  # 5 x3, 9 x1 counted; 1, 2 not
        Sample("b", [7, 7, 1, 1, 1, 1], [True, True, False, False, False, False]),  # 7 x2
        Sample("c", [3, 9, 4], [True, False, True]),  # 3 x1, 4 x1
    ]
    counts = count_loss_tokens(samples, vocab_size=12)
    assert counts[[5, 7, 9, 3, 4, 1, 2]].tolist() == [3, 2, 1, 1, 1, 0, 0]
    v = build_draft_vocab(counts, 4)
    # 5 and 7 by count, then the tie among 3, 4, 9 (count 1) goes to the smaller ids 3 and 4
    assert v.draft_to_target.tolist() == [3, 4, 5, 7]
    assert v.loss_tokens == 8 and v.covered_tokens == 7 and v.coverage == pytest.approx(7 / 8)
    assert v.distinct_seen == 5
    t2d = v.target_to_draft()
    assert t2d[[3, 4, 5, 7, 9]].tolist() == [0, 1, 2, 3, -1]


def test_unseen_tokens_fill_by_id_and_input_forms_agree():
    ids = torch.tensor([[2, 2, 6, 0]])
    mask = torch.tensor([[True, True, True, False]])
    counts = count_loss_tokens([(ids, mask)], vocab_size=8)
    assert torch.equal(counts, count_loss_tokens([Sample("x", [2, 2, 6, 0], [True, True, True, False])], 8))
    v = build_draft_vocab(counts, 5)
    assert v.draft_to_target.tolist() == [0, 1, 2, 3, 6]  # 2, 6 seen; 0, 1, 3 fill in id order
    assert v.coverage == 1.0


def test_errors_name_the_problem(tmp_path):
    counts = torch.ones(10, dtype=torch.long)
    with pytest.raises(ValueError, match="only 10"):
        build_draft_vocab(counts, 11)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_loss_tokens([Sample("x", [3, 12], [True, True])], vocab_size=10)
    v = build_draft_vocab(counts, 4)
    v.save(tmp_path / "v.json")
    back = DraftVocab.load(tmp_path / "v.json", target_vocab_size=10)
    assert torch.equal(back.draft_to_target, v.draft_to_target) and back.stats() == v.stats()
    with pytest.raises(ValueError, match="rebuild it for this target"):
        DraftVocab.load(tmp_path / "v.json", target_vocab_size=11)
