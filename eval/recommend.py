"""The chain length to serve: the K that maximises predicted tokens/s, from an evaluation's own measurements.

An evaluation runs the EAGLE-3 chain at one K (``eval.chain_length``, 6 by default) and profiles the step costs
(``eval.profile``). Its per-position acceptance prices every shorter chain exactly in distribution (an EAGLE-3
chain's first K' drafts do not depend on K; see ``eval.throughput``), so the K worth serving is read off the same
run: :func:`recommend_chain_length`.

Design decisions:
- One K for the drafter, chosen by the mean over prompt sets of the predicted speedup over plain decoding (each
  set at its own mean context), so no set's absolute speed dominates; each set's own best K is reported beside it.
- Costs are the profile's, made monotone (``CostCurves.monotone``) as in ``diagnose``; K is never extrapolated
  past the measured chain length. Ties go to the shorter chain (less verify width, less to go wrong).
- K = 0 (plain decoding is predicted fastest) is a valid answer and is reported as such, never rounded up.
- Chosen on one split, reported on another: the evaluation runs the chain on calibration prompts disjoint from
  the reported ones (``eval.calibration_prompts``) and records which (``chosen_on``); and the K is the profiled
  machine's (``hardware``), which the export's ``serve`` entry repeats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from eyas.eval.acceptance import AcceptanceResult
from eyas.eval.profile import StepProfile
from eyas.eval.throughput import AcceptanceCurve, CostCurves, shortest_fastest, sweep_chain


@dataclass
class SetChainLength:
    """One prompt set: its best K and the predicted tokens/s at every K = 0..measured K."""

    prompt_set: str
    context: float
    best_k: int
    tokens_per_s: list[float]
    """Entry K: predicted tokens/s of a chain of K drafts (K = 0: plain decoding)."""
    tau: list[float]
    """Entry K: τ of a chain of K drafts (the measured per-position acceptance, cut at K)."""


@dataclass
class ChainLengthRecommendation:
    method: str
    measured_k: int
    best_k: int
    """The K with the highest mean predicted speedup over the prompt sets."""
    mean_speedup: list[float]
    """Entry K: mean over sets of predicted tokens/s at K ÷ at K = 0."""
    sets: list[SetChainLength] = field(default_factory=list)
    chosen_on: dict[str, int] = field(default_factory=dict)
    """Prompt set -> the calibration prompts the K was chosen on (disjoint from the reported prompts; empty:
    the acceptance it was given, whatever that was)."""
    hardware: dict[str, Any] = field(default_factory=dict)
    """Where the step profile that priced it was timed (``StepProfile.machine``)."""

    def provenance(self) -> str:
        """One line: which prompts chose the K and which machine's step costs priced it."""
        split = (
            "the calibration split ("
            + ", ".join(f"{s}: {n} prompts" for s, n in self.chosen_on.items())
            + ", none of them reported)"
            if self.chosen_on
            else "the acceptance it was given"
        )
        hw = ", ".join(f"{k} {v}" for k, v in self.hardware.items()) or "an unrecorded machine"
        return f"chosen on {split}, priced with step times of {hw}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        ks = range(self.measured_k + 1)
        lines = [
            f"Predicted from the acceptance per position and the step profile ({self.method}; K = 0 is plain "
            f"decoding). **Serve K = {self.best_k}** (measured at K = {self.measured_k}); {self.provenance()}. "
            "The K is this machine's: on other hardware, evaluate there.",
            "",
            "| set | best K | " + " | ".join(f"K={k}" for k in ks) + " |",
            "|---|---:|" + "---:|" * len(ks),
        ]
        for s in self.sets:
            cells = [f"{t:.1f} tok/s (τ {tau:.2f})" for t, tau in zip(s.tokens_per_s, s.tau)]
            lines.append(f"| {s.prompt_set} | {s.best_k} | " + " | ".join(cells) + " |")
        lines.append(
            "| mean speedup | "
            + f"{self.best_k} | "
            + " | ".join(f"{x:.2f}×" for x in self.mean_speedup)
            + " |"
        )
        return "\n".join(lines)


def recommend_chain_length(
    acc: AcceptanceResult, prof: StepProfile | None, method: str = "eagle3-chain"
) -> ChainLengthRecommendation | None:
    """The K to serve ``method`` with (see the module docstring); None without a profile, chain steps, or the
    drafter costs a price needs (``profile.draft_rows``)."""
    if prof is None or not prof.draft_step_ms or not prof.draft_rows_ms:
        return None
    costs = CostCurves.from_profile(prof).monotone()
    sets: list[SetChainLength] = []
    for r in acc.results:
        if r.method != method or not r.step_records:
            continue
        accepted = [s[3] for s in r.step_records]
        drafted = [s[4] for s in r.step_records]
        k = max(drafted)
        if k < 1:
            continue
        curve = AcceptanceCurve.from_steps(accepted, drafted, k=k)
        sweep = sweep_chain(costs, curve, r.mean_context, k, "model")
        sets.append(
            SetChainLength(
                prompt_set=r.prompt_set,
                context=r.mean_context,
                best_k=sweep.best_k,
                tokens_per_s=[o.tokens_per_s for o in sweep.options],
                tau=[o.tau for o in sweep.options],
            )
        )
    if not sets:
        return None
    measured_k = min(len(s.tokens_per_s) for s in sets) - 1
    mean = [
        sum(s.tokens_per_s[k] / s.tokens_per_s[0] for s in sets) / len(sets) for k in range(measured_k + 1)
    ]
    return ChainLengthRecommendation(
        method, measured_k, shortest_fastest(mean), mean, sets, hardware=dict(prof.machine)
    )
