"""The throughput model: tokens/s = τ ÷ step time, with every term of a step priced from its own measurement.

One speculative step emits ``accepted + 1`` tokens (the +1 is the bonus token), so at batch 1

    tokens/s = τ ÷ (draft + verify + bookkeeping)

where τ is the mean number of tokens emitted per step, *draft* is the drafter's work (an EAGLE-3 context forward
over the rows just committed plus K - 1 single-row steps; a prompt-lookup search; nothing for plain decoding),
*verify* is the target's forward over the pending token and the draft (it grows with the context: attention reads
the whole KV cache), and *bookkeeping* is verification and the cache keep between forwards.

Design decisions:
- Costs (:class:`CostCurves`) and acceptance (:class:`AcceptanceCurve`) are separate inputs. Costs come from
  ``eval.profile`` (timed on their own, never from the steps they are compared with); acceptance is a count.
  So the model can price settings that were never run: another K, a cheaper verify, a better drafter.
- Acceptance is kept per draft position as two conditional rates, ``p_i`` = P(position i accepted | positions
  before it accepted and position i drafted) and ``h_i`` = P(position i drafted | positions before it accepted),
  measured from step records. Their running product is the reach ``r_i`` = P(accepted >= i), and
  τ(K) = 1 + Σ_{i<=K} r_i; at the measured K this telescopes to the measured τ exactly. A chain of K' < K is
  priced as the first K' positions: exact in distribution for EAGLE-3 chains (their first K' drafts do not
  depend on K), an estimate for prompt lookup (a shorter draft may come from a more recent match) and, for
  both, up to the different positions a different K lands on. Beyond the measured K nothing was observed:
  pricing it is refused unless ``extrapolate`` is asked for, which repeats the last measured rates and marks
  the result.
- Expected costs are taken over the distributions of tokens drafted and accepted per step (not at their means):
  verify time is not linear in the tokens verified everywhere, and prompt lookup drafts nothing on some steps.
- "A better drafter" is a curve with every ``p_i`` raised by δ (capped at 1); "cheaper verify" scales the
  verify curve. :func:`levers` prices them side by side, so a report shows which lever moves tokens/s.
- Recommendations rank settings on :meth:`CostCurves.monotone` costs (more tokens never cost less), so one
  noisy profile point cannot pick the winner; the predicted-against-measured check uses the raw profile.
- A prediction that misses the measurement by more than the noise says a cost is missing from the model (or
  was added to the loop): :func:`check_mismatch` flags ``|predicted / measured - 1|`` above
  ``max(tolerance, n_sigma × standard error of the repeat ratios)``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from eyas.serving.tree import TreeConfig

DrafterKind = Literal["none", "lookup", "model"]
"""How a method drafts: ``none`` (plain decoding), ``lookup`` (a search with no model: priced by the measured
``propose`` time) or ``model`` (EAGLE-3: priced by drafter forwards)."""
DRAFTER_KINDS = ("none", "lookup", "model")

TIE_RTOL = 1e-12
"""Rates within this relative margin of the best count as tied; a tie goes to the shorter chain."""


def shortest_fastest(rates: Sequence[float]) -> int:
    """Index of the first (shortest-chain) rate within ``TIE_RTOL`` of the best: equal rates reached by different
    sums may differ in the last bit, and the shorter chain wins such a tie."""
    top = max(rates)
    return next(k for k, r in enumerate(rates) if r >= top * (1 - TIE_RTOL))


# -- costs -------------------------------------------------------------------------------------------------------
def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def _interp_grid(grid: dict[int, float], x: float, what: str) -> float:
    """Linear interpolation over an integer-keyed grid; refuses to leave the measured range."""
    keys = sorted(grid)
    if not keys:
        raise ValueError(f"no {what} was measured")
    if x < keys[0] - 1e-9 or x > keys[-1] + 1e-9:
        raise ValueError(f"{what} at {x:g} was not measured (measured: {keys}); profile it")
    return float(np.interp(x, keys, [grid[k] for k in keys]))


@dataclass
class CostCurves:
    """Per-step costs in milliseconds against context length, each timed on its own (see ``eval.profile``)."""

    context_lengths: list[int]
    """Context lengths of the measured points (ascending); other lengths are interpolated, clamped at the ends."""
    verify_ms: dict[int, list[float]]
    """Tokens in the verify forward (pending token + draft) -> target forward time at each context length."""
    bookkeeping_ms: dict[int, list[float]] = field(default_factory=dict)
    """Tokens verified -> verification + cache keep time at each length (empty: not modelled)."""
    draft_rows_ms: dict[int, list[float]] = field(default_factory=dict)
    """EAGLE-3: drafter forward over ``m`` rows (the rows a step committed; a tree expansion) at each length."""
    draft_step_ms: list[float] = field(default_factory=list)
    """EAGLE-3: one single-row chain draft step at each length."""
    propose_ms: list[float] = field(default_factory=list)
    """Drafters without a model (prompt lookup, none): one ``propose`` call at each length."""

    def __post_init__(self) -> None:
        n = len(self.context_lengths)
        if n == 0:
            raise ValueError("cost curves need at least one context length")
        if list(self.context_lengths) != sorted(set(self.context_lengths)):
            raise ValueError(f"context lengths must be ascending and distinct, got {self.context_lengths}")
        if not self.verify_ms:
            raise ValueError("cost curves need verify times (verify_ms)")
        series = [*self.verify_ms.values(), *self.bookkeeping_ms.values(), *self.draft_rows_ms.values()]
        series += [s for s in (self.draft_step_ms, self.propose_ms) if s]
        if any(len(s) != n for s in series):
            raise ValueError(f"every cost series needs one value per context length ({n})")

    # -- lookups ----------------------------------------------------------------------------------------------
    def _at(self, series: Sequence[float], context: float) -> float:
        return float(np.interp(context, self.context_lengths, series))

    def _grid_at(self, table: dict[int, list[float]], context: float) -> dict[int, float]:
        return {k: self._at(v, context) for k, v in table.items()}

    def verify(self, context: float, tokens: float) -> float:
        return _interp_grid(
            self._grid_at(self.verify_ms, context), tokens, "verify time for that many tokens"
        )

    def bookkeeping(self, context: float, tokens: float) -> float:
        if not self.bookkeeping_ms:
            return 0.0
        return _interp_grid(self._grid_at(self.bookkeeping_ms, context), tokens, "bookkeeping time")

    def draft_rows(self, context: float, rows: float) -> float:
        return _interp_grid(
            self._grid_at(self.draft_rows_ms, context), rows, "drafter time for that many rows"
        )

    def draft_step(self, context: float) -> float:
        if not self.draft_step_ms:
            raise ValueError("no single-row draft step time was measured (profile with a drafter)")
        return self._at(self.draft_step_ms, context)

    def propose(self, context: float) -> float:
        return self._at(self.propose_ms, context) if self.propose_ms else 0.0

    # -- transforms -------------------------------------------------------------------------------------------
    def scaled(self, verify: float = 1.0, draft: float = 1.0) -> CostCurves:
        """What-if: every verify time × ``verify``, every drafter time × ``draft``."""

        def mul(table: dict[int, list[float]], f: float) -> dict[int, list[float]]:
            return {k: [f * x for x in v] for k, v in table.items()}

        return CostCurves(
            list(self.context_lengths),
            mul(self.verify_ms, verify),
            mul(self.bookkeeping_ms, 1.0),
            mul(self.draft_rows_ms, draft),
            [draft * x for x in self.draft_step_ms],
            [draft * x for x in self.propose_ms],
        )

    def windowed(self, window: int) -> CostCurves:
        """The costs of the same drafter attending over at most ``window`` tokens (a sliding window,
        ``eyas context``'s ``eagle3-chain-w<n>``): every drafter time read at ``min(context, window)``, verify
        and bookkeeping unchanged (the target still reads the whole context). Below the shortest profiled
        context the drafter time is held at that context's (interpolation clamps), so it never drops under
        a measured cost."""
        if window <= 0:
            raise ValueError(f"a drafter window must be a positive number of tokens, got {window}")

        def clamp(series: Sequence[float]) -> list[float]:
            return [self._at(series, min(c, window)) for c in self.context_lengths]

        return CostCurves(
            list(self.context_lengths),
            {k: list(v) for k, v in self.verify_ms.items()},
            {k: list(v) for k, v in self.bookkeeping_ms.items()},
            {k: clamp(v) for k, v in self.draft_rows_ms.items()},
            clamp(self.draft_step_ms) if self.draft_step_ms else [],
            list(self.propose_ms),
        )

    def monotone(self) -> CostCurves:
        """The same curves with verify and drafter times made non-decreasing in the tokens / rows processed at
        every context length (pool-adjacent-violators): more work never costs less, so a dip is timing noise.
        Used to rank settings, so that noise in one profile point does not pick the recommendation."""

        def fix(table: dict[int, list[float]]) -> dict[int, list[float]]:
            keys = sorted(table)
            cols = [isotonic([table[k][i] for k in keys]) for i in range(len(self.context_lengths))]
            return {k: [cols[i][j] for i in range(len(cols))] for j, k in enumerate(keys)}

        return CostCurves(
            list(self.context_lengths),
            fix(self.verify_ms),
            fix(self.bookkeeping_ms),
            fix(self.draft_rows_ms),
            list(self.draft_step_ms),
            list(self.propose_ms),
        )

    @classmethod
    def mean(cls, curves: Sequence[CostCurves]) -> CostCurves:
        """Pointwise mean of curves measured on the same grid (repeats of a profile)."""
        if not curves:
            raise ValueError("no cost curves to average")
        first = curves[0]
        if any(c.context_lengths != first.context_lengths for c in curves):
            raise ValueError("cost curves to average must share their context lengths")

        def avg_table(name: str) -> dict[int, list[float]]:
            keys = set(getattr(first, name))
            return {
                k: [statistics.fmean(x) for x in zip(*(getattr(c, name)[k] for c in curves))] for k in keys
            }

        def avg_series(name: str) -> list[float]:
            if not getattr(first, name):
                return []
            return [statistics.fmean(x) for x in zip(*(getattr(c, name) for c in curves))]

        return cls(
            list(first.context_lengths),
            avg_table("verify_ms"),
            avg_table("bookkeeping_ms"),
            avg_table("draft_rows_ms"),
            avg_series("draft_step_ms"),
            avg_series("propose_ms"),
        )

    @classmethod
    def concat(cls, curves: Sequence[CostCurves]) -> CostCurves:
        """Curves of distinct context lengths (same widths and rows) -> one curve over all of them."""
        if not curves:
            raise ValueError("no cost curves to concatenate")
        curves = sorted(curves, key=lambda c: c.context_lengths[0])

        def table(name: str) -> dict[int, list[float]]:
            return {k: [x for c in curves for x in getattr(c, name)[k]] for k in getattr(curves[0], name)}

        def series(name: str) -> list[float]:
            return [x for c in curves for x in getattr(c, name)] if getattr(curves[0], name) else []

        return cls(
            [x for c in curves for x in c.context_lengths],
            table("verify_ms"),
            table("bookkeeping_ms"),
            table("draft_rows_ms"),
            series("draft_step_ms"),
            series("propose_ms"),
        )

    @classmethod
    def from_profile(cls, prof, propose_ms: Sequence[float] | None = None) -> CostCurves:
        """From an :class:`eval.profile.StepProfile` (plus measured ``propose`` times of a model-free drafter)."""
        return cls(
            list(prof.context_lengths),
            {int(k): list(v) for k, v in prof.verify_ms.items()},
            {int(k): list(v) for k, v in prof.bookkeeping_ms.items()},
            {int(k): list(v) for k, v in prof.draft_rows_ms.items()},
            list(prof.draft_step_ms),
            list(propose_ms or []),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("verify_ms", "bookkeeping_ms", "draft_rows_ms"):
            d[key] = {str(k): v for k, v in d[key].items()}
        return d


# -- acceptance --------------------------------------------------------------------------------------------------
@dataclass
class AcceptanceCurve:
    """Per-position acceptance of a chain drafter (see the module docstring for ``p``, ``h`` and the reach)."""

    accept: list[float]
    """p_i: P(position i accepted | positions < i accepted and position i drafted), i = 1..K."""
    drafted_given_reach: list[float]
    """h_i: P(position i drafted | positions < i accepted). 1 everywhere for a drafter that always drafts K."""
    drafted_any: list[float]
    """d_i: P(at least i tokens drafted) over all steps (prices the verify width)."""
    steps: int = 0
    """Steps the curve was measured on (0: given, not measured)."""

    def __post_init__(self) -> None:
        k = len(self.accept)
        if len(self.drafted_given_reach) != k or len(self.drafted_any) != k:
            raise ValueError("accept, drafted_given_reach and drafted_any need one entry per draft position")
        for name in ("accept", "drafted_given_reach", "drafted_any"):
            if any(not 0.0 <= x <= 1.0 for x in getattr(self, name)):
                raise ValueError(f"{name} holds probabilities, all in [0, 1]")
        if any(b > a + 1e-12 for a, b in zip(self.drafted_any, self.drafted_any[1:])):
            raise ValueError("drafted_any must not increase with the position (P(drafted >= i))")

    @property
    def measured_k(self) -> int:
        return len(self.accept)

    @classmethod
    def from_rates(
        cls, accept: Sequence[float], drafted: Sequence[float] | None = None, steps: int = 0
    ) -> AcceptanceCurve:
        """Known rates: a drafter that always drafts every position (or, with ``drafted`` = h_i, drafts position
        i with that probability, independently of acceptance)."""
        accept = [float(x) for x in accept]
        h = [1.0] * len(accept) if drafted is None else [float(x) for x in drafted]
        d = np.cumprod(h).tolist()  # P(drafted >= i), taking drafting independent of acceptance
        return cls(accept, h, d, steps)

    @classmethod
    def from_steps(
        cls, accepted: Sequence[int], drafted: Sequence[int], k: int | None = None
    ) -> AcceptanceCurve:
        """Measured from step records: tokens accepted and drafted per step (chain steps)."""
        if len(accepted) != len(drafted):
            raise ValueError("accepted and drafted need one entry per step")
        if not accepted:
            raise ValueError("no steps to measure acceptance from")
        acc, dr = np.asarray(accepted), np.asarray(drafted)
        if (acc > dr).any() or (acc < 0).any():
            raise ValueError("a step cannot accept more tokens than it drafted")
        k = int(dr.max()) if k is None else k
        n = len(acc)
        p, h, d = [], [], []
        last_p, last_h = 0.0, 1.0
        for i in range(1, k + 1):
            reached = int((acc >= i - 1).sum())  # steps whose first i - 1 drafts were all accepted
            tried = int(((acc >= i - 1) & (dr >= i)).sum())  # ... and that drafted position i
            won = int((acc >= i).sum())
            last_h = tried / reached if reached else last_h  # no evidence: carry the last measured rate
            last_p = won / tried if tried else last_p
            h.append(last_h)
            p.append(last_p)
            d.append(float((dr >= i).sum()) / n)
        return cls(p, h, d, n)

    # -- what it implies --------------------------------------------------------------------------------------
    def extended(self, k: int, extrapolate: bool = False) -> tuple[AcceptanceCurve, bool]:
        """The curve over positions 1..k, and whether any position was extrapolated (refused unless asked)."""
        if k <= self.measured_k:
            return (
                AcceptanceCurve(
                    self.accept[:k], self.drafted_given_reach[:k], self.drafted_any[:k], self.steps
                ),
                False,
            )
        if not extrapolate:
            raise ValueError(
                f"K={k} goes beyond the measured draft positions (1..{self.measured_k}): acceptance there was "
                f"never observed. Measure with a chain of at least {k}, or allow extrapolation"
            )
        if self.measured_k == 0:
            raise ValueError("cannot extrapolate a curve with no measured position")
        extra = k - self.measured_k
        return (
            AcceptanceCurve(
                self.accept + [self.accept[-1]] * extra,
                self.drafted_given_reach + [self.drafted_given_reach[-1]] * extra,
                self.drafted_any + [self.drafted_any[-1]] * extra,
                self.steps,
            ),
            True,
        )

    def reach(self) -> list[float]:
        """r_i = P(accepted >= i), i = 1..K."""
        out, run = [], 1.0
        for p, h in zip(self.accept, self.drafted_given_reach):
            run *= p * h
            out.append(run)
        return out

    @property
    def tau(self) -> float:
        """Tokens per step with a chain of every measured position (bonus token included)."""
        return 1.0 + sum(self.reach())

    def accepted_distribution(self) -> list[float]:
        """P(accepted = j), j = 0..K."""
        r = [1.0, *self.reach(), 0.0]
        return [max(r[j] - r[j + 1], 0.0) for j in range(len(r) - 1)]

    def drafted_distribution(self) -> list[float]:
        """P(drafted = j), j = 0..K."""
        d = [1.0, *self.drafted_any, 0.0]
        return [max(d[j] - d[j + 1], 0.0) for j in range(len(d) - 1)]

    def improved(self, delta: float) -> AcceptanceCurve:
        """What-if: a drafter whose acceptance at every position is ``delta`` higher (capped at 1)."""
        return AcceptanceCurve(
            [min(1.0, max(0.0, p + delta)) for p in self.accept],
            list(self.drafted_given_reach),
            list(self.drafted_any),
            self.steps,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reach": self.reach(), "tau": self.tau}


# -- pricing one step --------------------------------------------------------------------------------------------
@dataclass
class StepPrediction:
    """One step's predicted cost and yield at a context length."""

    context: float
    tau: float
    """Tokens per step (bonus included)."""
    draft_ms: float
    verify_ms: float
    bookkeeping_ms: float
    verify_tokens: float
    """Mean tokens per verify forward (1 + mean drafted)."""
    setting: str = ""
    """What was priced (``K=4``, ``tree 4x5/24``, ``none``)."""
    extrapolated: bool = False

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.bookkeeping_ms

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.tau / self.step_ms if self.step_ms > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_ms": self.step_ms, "tokens_per_s": self.tokens_per_s}


def price_step(
    costs: CostCurves,
    context: float,
    drafted: Sequence[float],
    accepted: Sequence[float],
    drafter: DrafterKind,
    tree: TreeConfig | None = None,
    setting: str = "",
    extrapolated: bool = False,
) -> StepPrediction:
    """Expected cost of one step given P(drafted = j) and P(accepted = j) (j = 0, 1, ...).

    Chains: the drafter runs ``drafted - 1`` single-row steps, then re-encodes the ``accepted + 1`` committed rows.
    Trees: ``depth - 1`` expansions of ``topk`` rows, then the committed rows.
    """
    if drafter not in DRAFTER_KINDS:
        raise ValueError(f"drafter must be one of {DRAFTER_KINDS}, not {drafter!r}")
    for name, dist in (("drafted", drafted), ("accepted", accepted)):
        if abs(sum(dist) - 1.0) > 1e-6:
            raise ValueError(f"P({name} = j) must sum to 1, got {sum(dist):.6f}")
    tau = 1.0 + sum(j * p for j, p in enumerate(accepted))
    mean_drafted = sum(j * p for j, p in enumerate(drafted))
    verify = sum(p * costs.verify(context, 1 + j) for j, p in enumerate(drafted) if p > 0)
    book = sum(p * costs.bookkeeping(context, 1 + j) for j, p in enumerate(drafted) if p > 0)
    if drafter == "none":
        draft = 0.0
    elif drafter == "lookup":
        draft = costs.propose(context)
    else:
        draft = sum(p * costs.draft_rows(context, 1 + j) for j, p in enumerate(accepted) if p > 0)
        if tree is None:
            draft += sum(p * max(j - 1, 0) for j, p in enumerate(drafted)) * costs.draft_step(context)
        elif tree.depth > 1:
            draft += (tree.depth - 1) * costs.draft_rows(context, tree.topk)
    return StepPrediction(context, tau, draft, verify, book, 1.0 + mean_drafted, setting, extrapolated)


def predict_chain(
    costs: CostCurves,
    curve: AcceptanceCurve,
    context: float,
    k: int,
    drafter: DrafterKind,
    extrapolate: bool = False,
) -> StepPrediction:
    """tokens/s of a chain of ``k`` drafts (k = 0: plain decoding, no drafter work at all)."""
    if k < 0:
        raise ValueError(f"K must be >= 0 (0 = no speculation), got {k}")
    if k == 0:
        return price_step(costs, context, [1.0], [1.0], "none", setting="K=0 (no drafter)")
    c, extra = curve.extended(k, extrapolate)
    label = f"K={k}" + (" (extrapolated)" if extra else "")
    return price_step(
        costs,
        context,
        c.drafted_distribution(),
        c.accepted_distribution(),
        drafter,
        setting=label,
        extrapolated=extra,
    )


# -- recommendation ----------------------------------------------------------------------------------------------
@dataclass
class ChainSweep:
    """Predicted tokens/s of chains K = 0..k_max at one context length."""

    context: float
    options: list[StepPrediction]
    """Entry K is the chain of K drafts."""
    best_k: int

    @property
    def best(self) -> StepPrediction:
        return self.options[self.best_k]

    def break_even_tau(self, k: int) -> float:
        """τ a chain of ``k`` needs to match plain decoding at its step cost: step(K) / step(0)."""
        return self.options[k].step_ms / self.options[0].step_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "best_k": self.best_k,
            "options": [o.to_dict() for o in self.options],
        }


def sweep_chain(
    costs: CostCurves,
    curve: AcceptanceCurve,
    context: float,
    k_max: int,
    drafter: DrafterKind,
    extrapolate: bool = False,
) -> ChainSweep:
    """Price every chain length 0..k_max and pick the fastest (ties go to the shorter chain)."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    if k_max > curve.measured_k and not extrapolate:
        curve.extended(k_max, False)  # raises with the measured range
    options = [predict_chain(costs, curve, context, k, drafter, extrapolate) for k in range(k_max + 1)]
    return ChainSweep(context, options, shortest_fastest([o.tokens_per_s for o in options]))


@dataclass
class Lever:
    """One way to change tokens/s, priced at the best chain length it allows."""

    name: str
    k: int
    tau: float
    step_ms: float
    tokens_per_s: float
    gain: float
    """tokens/s relative to the as-run setting (1.0 = no change)."""
    extrapolated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def levers(
    costs: CostCurves,
    curve: AcceptanceCurve,
    context: float,
    k_run: int,
    k_max: int,
    drafter: DrafterKind,
    better_acceptance: Sequence[float] = (0.1, 0.2),
    verify_cut: float = 0.25,
    draft_cut: float = 0.5,
    extrapolate: bool = False,
) -> list[Lever]:
    """As run, best K, better drafters (acceptance + δ), cheaper verify, cheaper drafter, every draft accepted."""
    if not 0 <= verify_cut < 1 or not 0 <= draft_cut < 1:
        raise ValueError("verify_cut and draft_cut are fractions in [0, 1)")
    run = predict_chain(costs, curve, context, k_run, drafter, extrapolate)
    base = run.tokens_per_s

    def lever(name: str, sweep: ChainSweep) -> Lever:
        b = sweep.best
        return Lever(
            name, sweep.best_k, b.tau, b.step_ms, b.tokens_per_s, b.tokens_per_s / base, b.extrapolated
        )

    out = [Lever(f"as run (K={k_run})", k_run, run.tau, run.step_ms, base, 1.0, run.extrapolated)]
    out.append(lever("best K", sweep_chain(costs, curve, context, k_max, drafter, extrapolate)))
    for delta in better_acceptance:
        sweep = sweep_chain(costs, curve.improved(delta), context, k_max, drafter, extrapolate)
        out.append(lever(f"drafter: acceptance +{delta:.2f} per position", sweep))
    if verify_cut:
        sweep = sweep_chain(costs.scaled(verify=1 - verify_cut), curve, context, k_max, drafter, extrapolate)
        out.append(lever(f"verify {100 * verify_cut:.0f}% cheaper", sweep))
    if draft_cut and drafter != "none":
        sweep = sweep_chain(costs.scaled(draft=1 - draft_cut), curve, context, k_max, drafter, extrapolate)
        out.append(lever(f"drafter {100 * draft_cut:.0f}% cheaper", sweep))
    perfect = curve.improved(1.0)
    out.append(
        lever(
            "ceiling: every draft accepted", sweep_chain(costs, perfect, context, k_max, drafter, extrapolate)
        )
    )
    return out


# -- predicted against measured ----------------------------------------------------------------------------------
@dataclass
class MismatchCheck:
    """Is the measured tokens/s what the model predicts, within noise?"""

    predicted: float
    measured: float
    ratio: float
    """predicted / measured."""
    repeat_ratios: list[float]
    """The same ratio in independent repeats (rounds of profile + measurement)."""
    noise: float
    """Relative standard deviation of ``repeat_ratios`` (NaN with fewer than two)."""
    threshold: float
    """``max(tolerance, n_sigma × noise / sqrt(repeats))``: the largest ``|ratio - 1|`` accepted as agreement
    (NaN with fewer than two repeats: then nothing is flagged and the verdict says UNCHECKED)."""
    flagged: bool
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_mismatch(
    predicted: float,
    measured: float,
    repeat_ratios: Sequence[float] = (),
    tolerance: float = 0.10,
    n_sigma: float = 3.0,
    noisy_above: float = 0.25,
) -> MismatchCheck:
    """Flag a prediction that misses the measurement beyond noise (see the module docstring).

    ``tolerance`` is the model error accepted even without noise (costs the model does not price, such as the
    loop's own Python between steps); ``noisy_above`` marks runs whose repeats disagree so much that no verdict
    is trustworthy.
    """
    if predicted <= 0 or measured <= 0 or not math.isfinite(predicted) or not math.isfinite(measured):
        raise ValueError(f"predicted and measured tokens/s must be positive, got {predicted} and {measured}")
    if tolerance < 0 or n_sigma < 0:
        raise ValueError("tolerance and n_sigma must be >= 0")
    ratios = [float(r) for r in repeat_ratios]
    ratio = predicted / measured
    off = ratio - 1.0
    if len(ratios) < 2:
        # one repeat says nothing about noise: a verdict either way would be a guess
        return MismatchCheck(
            predicted,
            measured,
            ratio,
            ratios,
            float("nan"),
            float("nan"),
            False,
            f"UNCHECKED: off by {100 * off:+.0f}% but {len(ratios)} repeat gives no noise estimate; "
            "measure more generations (prompts or rounds)",
        )
    noise = statistics.stdev(ratios) / statistics.fmean(ratios)
    threshold = max(tolerance, n_sigma * noise / math.sqrt(len(ratios)))
    flagged = abs(off) > threshold
    if not flagged:
        verdict = f"ok: within {100 * threshold:.0f}%"
    elif off > 0:
        verdict = (
            f"LIKELY BUG: measured is {100 * (1 - 1 / ratio):.0f}% slower than predicted; the loop spends time "
            "the independently timed forwards do not (extra work or syncs per step, a slower code path)"
        )
    else:
        verdict = (
            f"LIKELY BUG: measured is {100 * (1 / ratio - 1):.0f}% faster than predicted; the profile times work "
            "the loop skips (or the profile ran on a busier machine)"
        )
    if noise > noisy_above:
        verdict += (
            f" (repeats disagree by {100 * noise:.0f}%: too noisy to trust; rerun on a quieter machine)"
        )
    return MismatchCheck(predicted, measured, ratio, ratios, noise, threshold, flagged, verdict)
