"""95% intervals for evaluation numbers: a percentile bootstrap over prompts, seeded.

Every τ, tokens/s and speedup an evaluation reports carries one, and two methods (or two drafters) measured on
the same prompts are compared by the interval of their paired difference.

Design decisions:
- The unit resampled is the prompt, never the step: the steps of one prompt share its text and its context, so
  they are not independent, and a set of 12 prompts is 12 observations however many steps it ran.
- Ratios are resampled as ratios of sums, exactly as their point estimates are computed (τ = emitted tokens ÷
  verify steps over the set, tokens/s = tokens ÷ seconds over the set), not as means of per-prompt ratios, so
  the estimate at the centre of an interval is the number the report prints.
- Paired comparisons draw one resample of prompt indices and apply it to both methods, so what the two share
  (a hard prompt, a slow minute of the machine) cancels in their difference; a speedup is such a pair (a method
  and plain decoding on the same prompts, interleaved in one run).
- Seeded (``numpy.random.default_rng(seed)``): the same numbers give the same interval on every machine.
- Fewer than two prompts give no interval (NaN bounds): one prompt says nothing about the spread over prompts,
  and a zero-width interval would claim certainty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

LEVEL = 0.95
"""Coverage of every interval eyas reports."""
RESAMPLES = 2000
"""Bootstrap resamples per interval (the percentiles of 2000 resamples move by ~0.01 of the width between seeds)."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval."""

    estimate: float
    """The statistic on every prompt (the number a report prints)."""
    low: float
    """Lower bound of the ``level`` interval (NaN: fewer than two prompts)."""
    high: float
    """Upper bound (NaN: fewer than two prompts)."""
    level: float = LEVEL
    """Coverage the interval is built for."""
    n: int = 0
    """Prompts it is computed over."""

    @property
    def defined(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def contains(self, x: float) -> bool:
        return self.defined and self.low <= x <= self.high

    def excludes(self, x: float) -> bool:
        """True when ``x`` lies outside a defined interval (an undefined one excludes nothing)."""
        return self.defined and not self.low <= x <= self.high

    def format(self, fmt: str = ".2f", suffix: str = "") -> str:
        """``1.85 [1.71, 1.98]``; the estimate alone when the interval is undefined."""
        if math.isnan(self.estimate):
            return ""
        head = f"{format(self.estimate, fmt)}{suffix}"
        if not self.defined:
            return head
        return f"{head} [{format(self.low, fmt)}, {format(self.high, fmt)}]"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap(
    statistic: Callable[[np.ndarray], np.ndarray],
    n: int,
    *,
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
) -> Interval:
    """The percentile interval of ``statistic`` over prompts: ``statistic(idx)`` takes prompt indices ``idx`` of
    shape [..., n] (a resample per leading row) and returns one value per row; it is evaluated once on every
    prompt (the estimate) and on ``resamples`` draws with replacement."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n < 1:
        return Interval(math.nan, math.nan, math.nan, level, 0)
    estimate = float(statistic(np.arange(n)[None])[0])
    if n < 2:
        return Interval(estimate, math.nan, math.nan, level, n)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [R, n]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.asarray(statistic(idx), dtype=float)  # [R]
    values = values[np.isfinite(values)]
    if values.size == 0:
        return Interval(estimate, math.nan, math.nan, level, n)
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return Interval(estimate, float(low), float(high), level, n)


def _array(xs: Sequence[float], name: str) -> np.ndarray:
    a = np.asarray(xs, dtype=float)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one value per prompt")
    return a


def _same_prompts(*arrays: np.ndarray) -> int:
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError(
            f"paired values must cover the same prompts: lengths {[len(a) for a in arrays]} differ"
        )
    return n


def mean_interval(values: Sequence[float], *, seed: int = 0, level: float = LEVEL) -> Interval:
    """The mean of one value per prompt."""
    v = _array(values, "values")
    return bootstrap(lambda i: v[i].mean(-1), len(v), seed=seed, level=level)


def ratio_interval(
    num: Sequence[float], den: Sequence[float], *, seed: int = 0, level: float = LEVEL
) -> Interval:
    """Σ num ÷ Σ den over prompts (τ: emitted tokens ÷ verify steps; tokens/s: tokens ÷ seconds)."""
    a, b = _array(num, "num"), _array(den, "den")
    _same_prompts(a, b)
    return bootstrap(lambda i: a[i].sum(-1) / b[i].sum(-1), len(a), seed=seed, level=level)


def paired_difference(
    a: Sequence[float], b: Sequence[float], *, seed: int = 0, level: float = LEVEL
) -> Interval:
    """The mean over prompts of ``a - b``, one value of each per prompt (the same prompts, in the same order)."""
    x, y = _array(a, "a"), _array(b, "b")
    _same_prompts(x, y)
    d = x - y
    return bootstrap(lambda i: d[i].mean(-1), len(d), seed=seed, level=level)


def paired_ratio_difference(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    *,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval:
    """(Σ num_a ÷ Σ den_a) - (Σ num_b ÷ Σ den_b) over the same resample of prompts: Δτ of two drafters."""
    na, da, nb, db = (_array(x, "values") for x in (num_a, den_a, num_b, den_b))
    n = _same_prompts(na, da, nb, db)
    return bootstrap(
        lambda i: na[i].sum(-1) / da[i].sum(-1) - nb[i].sum(-1) / db[i].sum(-1), n, seed=seed, level=level
    )


def paired_ratio(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    *,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval:
    """(Σ num_a ÷ Σ den_a) ÷ (Σ num_b ÷ Σ den_b) over the same resample of prompts: a speedup (tokens/s of a
    method over plain decoding's on the same prompts)."""
    na, da, nb, db = (_array(x, "values") for x in (num_a, den_a, num_b, den_b))
    n = _same_prompts(na, da, nb, db)
    return bootstrap(
        lambda i: (na[i].sum(-1) / da[i].sum(-1)) / (nb[i].sum(-1) / db[i].sum(-1)), n, seed=seed, level=level
    )
