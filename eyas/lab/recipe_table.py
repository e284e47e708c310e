"""The recipe study's results and its table (``eyas recipe``, :mod:`eyas.lab.recipe`).

Per variant and chain length K: held-out τ with its 95% interval over prompts, the paired Δτ against the baseline
variant (and the relative change, in %), and τ against prompt lookup's on the same prompts (paired ratio and Δτ).

Design decisions:
- A result keeps each prompt's counts (:class:`eval.acceptance.PromptRecord`, with the prompt's fingerprint), so
  the JSON files hold everything the table needs: a rerun recomputes it without training or evaluating again.
- Every interval is :mod:`eval.intervals`' bootstrap over prompts; differences and ratios are paired (one
  resample of prompts for both sides) through :func:`eval.acceptance.compare` and
  :func:`eval.intervals.paired_ratio`. The relative change is the paired ratio of τ minus one, so its interval is
  the ratio's.
- Two results are compared only on the same prompts, in the same order: ``compare`` refuses results whose prompt
  fingerprints differ, and so does the table (a stale result, another prompt set), naming the variant.
- A variant is paired with the baseline trained with the same seed; without one, its Δ cells stay empty.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from eyas.eval.acceptance import PromptRecord, SetMethodResult, compare
from eyas.eval.intervals import Interval, paired_ratio, ratio_interval

LOOKUP = "prompt-lookup"
"""The reference row: prompt lookup at the same K, on the same prompts and numerics."""


@dataclass
class ChainEval:
    """One drafter (or prompt lookup) at one chain length on the study's prompts."""

    chain_length: int
    """K: draft tokens per step."""
    method: str
    """``eagle3-chain`` or ``prompt-lookup``."""
    prompt_set: str
    """The prompt set's name (``recipe.prompts.name``)."""
    tau: float
    """Emitted tokens per verify step over the set."""
    acceptance_by_position: list[float]
    """Entry i: the fraction of steps that drafted depth i + 1 and accepted it."""
    per_prompt: list[PromptRecord]
    """Each prompt's counts and fingerprint, in the set's order: what the intervals resample."""
    report: str = ""
    """The evaluation's report (empty for prompt lookup, measured by the study itself)."""

    @classmethod
    def of(cls, r: SetMethodResult, chain_length: int, report: str = "") -> ChainEval:
        return cls(
            chain_length=chain_length,
            method=r.method,
            prompt_set=r.prompt_set,
            tau=r.tau,
            acceptance_by_position=list(r.acceptance_by_position),
            per_prompt=list(r.per_prompt),
            report=report,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChainEval:
        return cls(**{**d, "per_prompt": [PromptRecord(**p) for p in d["per_prompt"]]})

    def set_result(self) -> SetMethodResult:
        """The result :func:`eval.acceptance.compare` pairs (τ's counts; no timings across runs are compared)."""
        n = len(self.per_prompt)
        return SetMethodResult(
            prompt_set=self.prompt_set,
            method=self.method,
            label="",
            prompts=n,
            tokens=sum(p.tokens for p in self.per_prompt),
            steps=sum(p.steps for p in self.per_prompt),
            tau=self.tau,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_s=math.nan,
            decode_tokens_per_s=math.nan,
            mean_draft_ms=math.nan,
            mean_verify_ms=math.nan,
            mean_context=math.nan,
            per_prompt=self.per_prompt,
        )

    def tau_interval(self) -> Interval:
        return ratio_interval([p.emitted for p in self.per_prompt], [p.steps for p in self.per_prompt])


@dataclass
class VariantResult:
    """One variant trained with one seed and evaluated at every chain length (``<name>.seed<seed>.json``)."""

    variant: str
    seed: int
    steps: int
    """Optimizer steps the training reached."""
    train_tokens: int | None
    """Tokens the training stepped over (its ``metrics.jsonl``): equal across variants = the same tokens."""
    train_tokens_per_s: float | None
    """``train_tokens`` ÷ the seconds of the training steps (data wait and compute; held-out evaluations and
    checkpoints excluded): this machine's, under its load."""
    tau_sim: float | None
    """The trainer's held-out simulated chain τ (``tau_chain`` at ``train.eval_chain_length``)."""
    tau_served_sim: float | None
    """The same from the rows served chains start from (``tau_served``)."""
    train_dir: str
    weights: str
    """The checkpoint evaluated and its step: an evaluation is reused only for the same weights."""
    evals: list[ChainEval] = field(default_factory=list)

    def at(self, chain_length: int) -> ChainEval | None:
        return next((e for e in self.evals if e.chain_length == chain_length), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VariantResult:
        return cls(**{**d, "evals": [ChainEval.from_dict(e) for e in d.get("evals", [])]})


@dataclass
class ChainCell:
    """One variant at one chain length, as the table shows it."""

    tau: Interval
    """τ with its 95% interval over prompts."""
    delta: Interval | None = None
    """τ - τ(baseline), paired on the same prompts (None: the baseline itself, or no baseline of this seed)."""
    relative: Interval | None = None
    """τ ÷ τ(baseline) - 1, in %, paired."""
    vs_lookup: Interval | None = None
    """τ - τ(prompt lookup), paired."""
    lookup_ratio: Interval | None = None
    """τ ÷ τ(prompt lookup), paired (issue 40's bar: ≥ 1.3)."""


@dataclass
class TableRow:
    result: VariantResult
    cells: dict[int, ChainCell]
    """Chain length -> the cell (absent: not evaluated at that K)."""


def _same_prompts(a: ChainEval, b: ChainEval, what: str) -> None:
    try:
        compare(a.set_result(), b.set_result())
    except ValueError as e:
        raise ValueError(
            f"recipe: {what} at K={a.chain_length} was evaluated on other prompts ({e}); evaluate them again on "
            "the same prompts (recipe.reevaluate=true)"
        ) from None


def _ratio(a: ChainEval, b: ChainEval) -> Interval:
    pa, pb = a.per_prompt, b.per_prompt
    return paired_ratio(
        [p.emitted for p in pa], [p.steps for p in pa], [p.emitted for p in pb], [p.steps for p in pb]
    )


def _percent(r: Interval) -> Interval:
    return Interval(100 * (r.estimate - 1), 100 * (r.low - 1), 100 * (r.high - 1), r.level, r.n)


def chain_cell(ev: ChainEval, base: ChainEval | None, lookup: ChainEval | None, what: str) -> ChainCell:
    """``ev`` against the baseline's evaluation ``base`` (None: it is the baseline, or there is none) and prompt
    lookup's ``lookup`` at the same K; raises where either was measured on other prompts."""
    cell = ChainCell(ev.tau_interval())
    if base is not None:
        _same_prompts(ev, base, f"{what} against the baseline")
        cell.delta = compare(ev.set_result(), base.set_result()).delta_tau
        cell.relative = _percent(_ratio(ev, base))
    if lookup is not None:
        _same_prompts(ev, lookup, f"{what} against prompt lookup")
        cell.vs_lookup = compare(ev.set_result(), lookup.set_result()).delta_tau
        cell.lookup_ratio = _ratio(ev, lookup)
    return cell


def table_rows(
    results: list[VariantResult], lookup: dict[int, ChainEval], baseline: str, chain_lengths: list[int]
) -> list[TableRow]:
    """Every result's cells at ``chain_lengths``, the baseline variant's first (paired by seed)."""
    bases = {r.seed: r for r in results if r.variant == baseline}
    ordered = sorted(results, key=lambda r: r.variant != baseline)  # stable: the study's order otherwise
    rows = []
    for r in ordered:
        base = bases.get(r.seed)
        cells = {}
        for k in chain_lengths:
            ev = r.at(k)
            if ev is None:
                continue
            b = base.at(k) if base is not None and base is not r else None
            cells[k] = chain_cell(ev, b, lookup.get(k), f"variant {r.variant} (seed {r.seed})")
        rows.append(TableRow(r, cells))
    return rows


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _signed(i: Interval | None, fmt: str = "+.3f", suffix: str = "") -> str:
    return "—" if i is None else i.format(fmt, suffix)


def format_table(
    rows: list[TableRow], lookup: dict[int, ChainEval], baseline: str, chain_lengths: list[int]
) -> str:
    """The Markdown table: per K, τ [95%], Δτ against the baseline [95%] (relative change in % [95%]) and τ ÷
    prompt lookup's [95%]; prompt lookup's own row last."""
    head = ["variant", "seed", "steps", "train tokens", "train tok/s", "τ_sim", "τ_sim served"]
    for k in chain_lengths:
        head += [f"τ, chain K={k}", f"Δτ vs {baseline}, K={k} (%)", f"τ ÷ lookup's, K={k}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row.result
        out = [
            r.variant,
            str(r.seed),
            str(r.steps),
            _f(r.train_tokens, ","),
            _f(r.train_tokens_per_s, ".0f"),
            _f(r.tau_sim, ".3f"),
            _f(r.tau_served_sim, ".3f"),
        ]
        for k in chain_lengths:
            c = row.cells.get(k)
            if c is None:
                out += ["—", "—", "—"]
                continue
            delta = "baseline" if r.variant == baseline else _signed(c.delta)
            if c.relative is not None:
                delta += f" ({_signed(c.relative, '+.1f', '%')})"
            out += [c.tau.format(".3f"), delta, _signed(c.lookup_ratio, ".2f", "×")]
        lines.append("| " + " | ".join(out) + " |")
    ref = [f"{LOOKUP} (reference)", "—", "—", "—", "—", "—", "—"]
    for k in chain_lengths:
        ev = lookup.get(k)
        ref += [ev.tau_interval().format(".3f") if ev else "—", "—", "1×" if ev else "—"]
    lines.append("| " + " | ".join(ref) + " |")
    return "\n".join(lines)


def table_json(rows: list[TableRow]) -> list[dict[str, Any]]:
    """The table's numbers with their intervals (``recipe.json``'s ``table``)."""

    def iv(i: Interval | None) -> dict[str, Any] | None:
        return None if i is None else i.to_dict()

    return [
        {
            "variant": row.result.variant,
            "seed": row.result.seed,
            "chains": {
                str(k): {
                    "tau": iv(c.tau),
                    "delta_tau_vs_baseline": iv(c.delta),
                    "relative_change_pct": iv(c.relative),
                    "delta_tau_vs_lookup": iv(c.vs_lookup),
                    "ratio_to_lookup": iv(c.lookup_ratio),
                }
                for k, c in row.cells.items()
            },
        }
        for row in rows
    ]
