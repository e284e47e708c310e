"""Bootstrap intervals over prompts (eval/intervals.py): they cover the true value at their stated rate, shrink
with more prompts, and a paired difference separates a consistent shift from noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eyas.eval.intervals import (
    Interval,
    mean_interval,
    paired_difference,
    paired_ratio,
    paired_ratio_difference,
    ratio_interval,
)


def test_the_mean_interval_covers_the_known_mean_at_about_its_level():
    """300 synthetic sets of 40 prompts (τ-like values, mean 2.0): the 95% interval holds 2.0 in about 95% of
    them. A percentile bootstrap under-covers a little at small n, so the band is 0.89-0.99 (binomial sd 0.013)."""
    rng = np.random.default_rng(123)
    hits = 0
    trials = 300
    for t in range(trials):
        values = 2.0 + rng.gamma(2.0, 0.5, size=40) - 1.0  # skewed, mean 2.0
        hits += mean_interval(values, seed=t).contains(2.0)
    assert 0.89 <= hits / trials <= 0.99


def test_the_ratio_interval_covers_the_known_ratio_and_is_centred_on_the_ratio_of_sums():
    rng = np.random.default_rng(7)
    hits, trials = 0, 200
    for t in range(trials):
        steps = rng.integers(20, 80, size=30).astype(float)
        emitted = steps * (2.5 + rng.normal(0, 0.4, size=30))  # τ per prompt around 2.5
        ci = ratio_interval(emitted, steps, seed=t)
        assert ci.estimate == pytest.approx(emitted.sum() / steps.sum())
        hits += ci.contains(2.5)
    assert 0.88 <= hits / trials <= 0.99


def test_intervals_shrink_with_more_prompts():
    rng = np.random.default_rng(0)
    values = rng.normal(1.8, 0.5, size=400)
    small, large = mean_interval(values[:25]), mean_interval(values)
    width = lambda c: c.high - c.low  # noqa: E731
    assert width(large) < 0.5 * width(small)  # 16x the prompts: ~1/4 of the width
    assert small.n == 25 and large.n == 400


def test_a_paired_difference_excludes_zero_for_a_consistent_shift_and_includes_it_for_noise():
    """Prompts differ a lot (hard / easy), a drafter adds 0.1 τ on every one of them: paired, the shift is
    resolved although it is small against the spread over prompts; pure noise leaves 0 inside ~95% of the time."""
    rng = np.random.default_rng(1)
    excluded, included, trials = 0, 0, 200
    for t in range(trials):
        base = rng.normal(2.0, 0.6, size=24)  # per-prompt τ of drafter b
        shifted = base + 0.1 + rng.normal(0, 0.05, size=24)
        noisy = base + rng.normal(0, 0.05, size=24)
        excluded += paired_difference(shifted, base, seed=t).excludes(0.0)
        included += paired_difference(noisy, base, seed=t).contains(0.0)
    assert excluded == trials
    assert 0.88 <= included / trials <= 0.99
    # unpaired, the same shift is lost in the spread over prompts: the two sets' own intervals overlap
    assert mean_interval(base + 0.1).low < mean_interval(base).high


def test_paired_ratio_is_a_speedup_and_paired_ratio_difference_a_tau_difference():
    rng = np.random.default_rng(2)
    seconds_b = rng.uniform(4, 9, size=12)  # plain decoding: 128 tokens per prompt, a slow minute or not
    tokens = np.full(12, 128.0)
    seconds_a = seconds_b / 1.3 * rng.uniform(0.98, 1.02, size=12)  # the method: 1.3x on every prompt
    speedup = paired_ratio(tokens, seconds_a, tokens, seconds_b)
    assert speedup.estimate == pytest.approx(
        (tokens.sum() / seconds_a.sum()) / (tokens.sum() / seconds_b.sum())
    )
    assert speedup.contains(1.3) and speedup.excludes(1.0) and speedup.high - speedup.low < 0.05
    steps_a, steps_b = np.full(12, 50.0), np.full(12, 60.0)
    d = paired_ratio_difference(steps_a * 2.2, steps_a, steps_b * 2.0, steps_b)
    assert d.estimate == pytest.approx(0.2)


def test_seeded_undefined_for_one_prompt_and_mismatched_lengths_refused():
    values = [1.0, 2.0, 4.0, 3.0]
    assert mean_interval(values, seed=3) == mean_interval(values, seed=3)
    one = mean_interval([2.0])
    assert one.estimate == 2.0 and math.isnan(one.low) and not one.contains(2.0) and not one.excludes(5.0)
    assert one.format() == "2.00"
    assert Interval(1.5, 1.25, 1.75).format() == "1.50 [1.25, 1.75]"
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1.0, 2.0], [1.0])
