"""Analysis: predicted against measured tokens/s per cell, the K sweep and the levers, recommendations."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from eyas.eval.acceptance import (
    AcceptanceResult,
    MethodSpec,
    aggregate,
)
from eyas.eval.diagnose.config import DiagnoseConfig, drafter_kind, method_specs
from eyas.eval.diagnose.measure import Generation, Measurements, costs_from_samples
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.eval.throughput import (
    AcceptanceCurve,
    ChainSweep,
    CostCurves,
    Lever,
    MismatchCheck,
    StepPrediction,
    check_mismatch,
    levers,
    predict_chain,
    price_step,
    sweep_chain,
)
from eyas.serving.loop import GenerationResult


# -- analysis ----------------------------------------------------------------------------------------------------
@dataclass
class CellResult:
    """One (method, prompt set, context length): the decomposition, predicted against measured."""

    method: str
    prompt_set: str
    label: str
    context: int
    """Nominal context length L."""
    mean_context: float
    """Mean context of the steps (what is priced)."""
    generations: int
    steps: int
    tau: float
    acceptance_by_position: list[float]
    """P(accepted >= i) over all steps, i = 1..K."""
    prediction: StepPrediction
    """τ ÷ (draft + verify + bookkeeping): each generation's steps priced with the profile samples bracketing
    it, step-weighted over the cell's generations."""
    measured_tokens_per_s: float
    """Tokens emitted by the steps ÷ wall clock after prefill."""
    measured_step_ms: float
    measured_draft_ms: float
    """The loop's own timings, shown to localise a mismatch; never used in the prediction."""
    measured_verify_ms: float
    measured_loop_ms: float
    """Wall clock per step outside the loop's draft and verify timers."""
    check: MismatchCheck
    curve: AcceptanceCurve | None = None
    """Chains: the per-position acceptance the recommendation prices."""
    drafted_distribution: list[float] = field(default_factory=list)
    """P(drafted = j) over the steps."""
    accepted_distribution: list[float] = field(default_factory=list)
    """P(accepted = j) over the steps."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prediction"] = self.prediction.to_dict()
        d["curve"] = None if self.curve is None else self.curve.to_dict()
        return d


@dataclass
class CellRecommendation:
    """Settings that maximise predicted tokens/s for one (chain method, prompt set, context length)."""

    method: str
    prompt_set: str
    context: int
    sweep: ChainSweep
    levers: list[Lever]
    trees: list[StepPrediction] = field(default_factory=list)
    """Measured tree shapes at the same set and context (their τ measured, never extrapolated)."""
    best: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "prompt_set": self.prompt_set,
            "context": self.context,
            "sweep": self.sweep.to_dict(),
            "levers": [lv.to_dict() for lv in self.levers],
            "trees": [t.to_dict() for t in self.trees],
            "best": self.best,
        }


@dataclass
class ContextProjection:
    """tokens/s of one chain method at one context length of a τ(context) measurement (``eyas context``),
    priced with this run's step costs: with the τ measured at that length, and with this run's own τ held
    constant (what a projection without long-context measurements assumes)."""

    method: str
    length: int
    """Nominal context length of the measurement."""
    context: float
    """Mean context of its steps (where the costs are read)."""
    k: int
    """Chain length it was measured with."""
    measured: StepPrediction
    """τ measured at this length ÷ this run's step cost there."""
    best_k: int
    """The fastest chain length (0..k) at this length with the τ measured there."""
    best: StepPrediction
    constant: StepPrediction | None
    """The same chain with the τ this run measured (its shortest context) ÷ the same step cost."""
    constant_from: int | None
    """The context length of this run whose τ is held constant."""
    beyond_profile: bool
    """The length lies past this run's longest profiled context: step costs are held at that context's."""
    plain: StepPrediction | None = None
    """Plain decoding (K = 0) at the same length and costs."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("measured", "best", "constant", "plain"):
            d[key] = None if getattr(self, key) is None else getattr(self, key).to_dict()
        return d


def project_context(
    path: str, cells: list[CellResult], costs: CostCurves, specs: dict[str, MethodSpec]
) -> list[ContextProjection]:
    """Price every chain point of a τ(context) measurement with ``costs`` (see :class:`ContextProjection`)."""
    from eyas.eval.context_sweep import load_tau_context, split_window

    measured = load_tau_context(path)
    full_costs = costs.monotone()
    top = max(full_costs.context_lengths)
    out = []
    for p in measured.points:
        # a windowed method (eagle3-chain-w512) is this run's drafter attending over its last n tokens: priced
        # with the drafter's costs read at min(context, n), its own τ held constant from the unwindowed method
        base, window = split_window(p.method)
        spec = specs.get(p.method) or specs.get(base)  # base is the method itself when it has no window
        costs = full_costs.windowed(window) if window else full_costs
        if (
            spec is None
            or spec.mode != "chain"
            or spec.kind == "none"
            or not p.accepted
            or not p.chain_length
        ):
            continue  # only chain methods this run also measures can be priced with its costs
        kind = drafter_kind(spec)
        curve = AcceptanceCurve.from_steps(p.accepted, p.drafted, k=p.chain_length)
        sweep = sweep_chain(costs, curve, p.mean_context, p.chain_length, kind)
        own = [c for c in cells if c.method in (p.method, base) and c.curve is not None]
        constant, constant_from = None, None
        if own:
            first = min(c.context for c in own)
            ref = max((c for c in own if c.context == first), key=lambda c: c.steps)
            k = min(p.chain_length, ref.curve.measured_k)
            constant = predict_chain(costs, ref.curve, p.mean_context, k, kind)
            constant_from = ref.context
        out.append(
            ContextProjection(
                method=p.method,
                length=p.length,
                context=p.mean_context,
                k=p.chain_length,
                measured=sweep.options[p.chain_length],
                best_k=sweep.best_k,
                best=sweep.best,
                constant=constant,
                constant_from=constant_from,
                beyond_profile=p.mean_context > top,
                plain=sweep.options[0],
            )
        )
    return out


def fastest_per_length(projections: list[ContextProjection]) -> dict[int, ContextProjection]:
    """Per measured context length, the projection whose best chain length gives the most tokens/s: the
    method (drafter window included) and K to serve in that context band (best K = 0: no speculation)."""
    out: dict[int, ContextProjection] = {}
    for p in projections:
        cur = out.get(p.length)
        if cur is None or p.best.tokens_per_s > cur.best.tokens_per_s:
            out[p.length] = p
    return dict(sorted(out.items()))


@dataclass
class DiagnoseResult:
    config: dict[str, Any]
    target: dict[str, Any]
    drafter: str | None
    costs: CostCurves
    """Target and drafter costs at each context, mean of every profile sample."""
    cells: list[CellResult]
    recommendations: list[CellRecommendation]
    acceptance: AcceptanceResult
    """τ per (prompt set, method), pooled over contexts and rounds (``eval.acceptance`` aggregates)."""
    acceptance_by_context: AcceptanceResult
    """The same per (prompt set @ context, method)."""
    noise: str
    notes: list[str]
    wall_s: float
    context_projections: list[ContextProjection] = field(default_factory=list)
    """tokens/s at the lengths of ``tau_context``, from the τ measured there (empty without it)."""

    @property
    def flagged(self) -> list[CellResult]:
        return [c for c in self.cells if c.check.flagged]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "target": self.target,
            "drafter": self.drafter,
            "costs": self.costs.to_dict(),
            "cells": [c.to_dict() for c in self.cells],
            "recommendations": [r.to_dict() for r in self.recommendations],
            "acceptance": self.acceptance.to_dict(),
            "acceptance_by_context": self.acceptance_by_context.to_dict(),
            "noise": self.noise,
            "notes": self.notes,
            "wall_s": self.wall_s,
            "context_projections": [p.to_dict() for p in self.context_projections],
        }


def _dist(values: list[int]) -> list[float]:
    """Empirical P(value = j), j = 0..max."""
    top = max(values, default=0)
    return [sum(v == j for v in values) / len(values) for j in range(top + 1)]


def predict_steps(costs: CostCurves, steps, spec: MethodSpec) -> StepPrediction:
    """Price measured steps (their counts only: context, drafted, accepted) with independently timed costs."""
    ctx = statistics.fmean(s.context_len for s in steps)
    setting = spec.name if spec.mode == "tree" else f"K={spec.chain_length}"
    return price_step(
        costs,
        ctx,
        _dist([s.num_drafted for s in steps]),
        _dist([s.num_accepted for s in steps]),
        drafter_kind(spec),
        spec.tree if spec.mode == "tree" else None,
        setting,
    )


def combine(predictions: list[StepPrediction], weights: list[int]) -> StepPrediction:
    """Step-weighted mean of per-generation predictions: τ ÷ (mean step) = tokens ÷ predicted time."""
    total = sum(weights)

    def avg(name: str) -> float:
        return sum(w * getattr(p, name) for p, w in zip(predictions, weights)) / total

    first = predictions[0]
    return StepPrediction(
        avg("context"),
        avg("tau"),
        avg("draft_ms"),
        avg("verify_ms"),
        avg("bookkeeping_ms"),
        avg("verify_tokens"),
        first.setting,
        any(p.extrapolated for p in predictions),
    )


def analyse(
    cfg: DiagnoseConfig,
    m: Measurements,
    target_info: dict[str, Any] | None = None,
    drafter_source: str | None = None,
) -> DiagnoseResult:
    """Decomposition, check and recommendation of every cell (see the module docstring)."""
    specs = {s.name: s for s in method_specs(cfg)}
    cells: list[CellResult] = []
    by_cell: dict[tuple[str, str, int], list[Generation]] = defaultdict(list)
    for g in m.generations:
        if g.result.steps:  # a generation that stopped at prefill has no step to price
            by_cell[(g.method, g.prompt_set, g.context)].append(g)
    labels = {s.name: s.label for s in cfg.prompt_sets}
    for (method, prompt_set, length), gens in by_cell.items():
        spec = specs[method]
        steps = [s for g in gens for s in g.result.steps]
        preds = [predict_steps(m.costs(g), g.result.steps, spec) for g in gens]
        pred = combine(preds, [len(g.result.steps) for g in gens])
        emitted = sum(g.emitted for g in gens)
        wall = sum(g.decode_s for g in gens)
        measured = emitted / wall
        ratios = [p.tokens_per_s / (g.emitted / g.decode_s) for p, g in zip(preds, gens)]
        check = check_mismatch(pred.tokens_per_s, measured, ratios, cfg.tolerance, cfg.n_sigma)
        n = len(steps)
        curve = None
        if spec.mode == "chain" and spec.kind != "none":
            curve = AcceptanceCurve.from_steps(
                [s.num_accepted for s in steps], [s.num_drafted for s in steps], k=spec.chain_length
            )
        cells.append(
            CellResult(
                method=method,
                prompt_set=prompt_set,
                label=labels.get(prompt_set, ""),
                context=length,
                mean_context=pred.context,
                generations=len(gens),
                steps=n,
                tau=sum(s.num_emitted for s in steps) / n,
                acceptance_by_position=curve.reach() if curve else [],
                prediction=pred,
                measured_tokens_per_s=measured,
                measured_step_ms=1e3 * wall / n,
                measured_draft_ms=1e3 * sum(s.draft_s for s in steps) / n,
                measured_verify_ms=1e3 * sum(s.verify_s for s in steps) / n,
                measured_loop_ms=1e3 * (wall - sum(s.step_s for s in steps)) / n,
                check=check,
                curve=curve,
                drafted_distribution=_dist([s.num_drafted for s in steps]),
                accepted_distribution=_dist([s.num_accepted for s in steps]),
            )
        )
    order = {name: i for i, name in enumerate(specs)}
    set_order = {s.name: i for i, s in enumerate(cfg.prompt_sets)}
    cells.sort(key=lambda c: (order[c.method], set_order.get(c.prompt_set, 0), c.context))

    recs = recommend(cfg, cells, m, specs)
    noise = (
        "noise = spread of the predicted/measured ratio over a cell's generations, each priced with the profile "
        "samples taken just before and just after it (so both sides see the same machine load); a cell is "
        f"flagged when |ratio - 1| > max({cfg.tolerance:.2f}, {cfg.n_sigma:g} × std / sqrt(generations))"
    )
    notes = []
    if cfg.extrapolate and cfg.recommend_k_max > cfg.chain_length:
        notes.append(
            f"chains longer than the measured K={cfg.chain_length} are EXTRAPOLATED (last measured acceptance "
            "rate repeated); measure with a longer chain to confirm"
        )
    elif cfg.recommend_k_max == cfg.chain_length:
        notes.append(
            f"chains are priced up to the measured K={cfg.chain_length}; longer chains were not "
            "measured and are not recommended (raise chain_length, or set extrapolate=true)"
        )
    if "eagle3-tree" in cfg.methods:
        notes.append(
            "tree shapes are priced with their measured τ only (no tree shape is extrapolated); a tree "
            "expansion is priced as a drafter forward over topk context rows"
        )
    costs = costs_from_samples([p for ps in m.samples.values() for p in ps])
    projections = project_context(cfg.tau_context, cells, costs, specs) if cfg.tau_context else []
    if any(p.beyond_profile for p in projections):
        notes.append(
            f"τ(context) lengths past the longest profiled context ({max(costs.context_lengths)}) are priced "
            "with that context's step costs (add the lengths to `contexts` to time them)"
        )
    return DiagnoseResult(
        config=_config_dict(cfg),
        target=target_info or {},
        drafter=drafter_source,
        costs=costs,
        cells=cells,
        recommendations=recs,
        acceptance=_acceptance(m, cfg, by_context=False),
        acceptance_by_context=_acceptance(m, cfg, by_context=True),
        noise=noise,
        notes=notes,
        wall_s=m.wall_s,
        context_projections=projections,
    )


def recommend(
    cfg: DiagnoseConfig, cells: list[CellResult], m: Measurements, specs: dict[str, MethodSpec]
) -> list[CellRecommendation]:
    """Best chain length (and the levers) for every chain cell, with the measured trees alongside; costs are
    every profile sample at the cell's context, made monotone in the work done."""
    out = []
    for c in cells:
        spec = specs[c.method]
        if c.curve is None:
            continue
        costs = m.mean_costs(c.context, c.method, c.prompt_set).monotone()
        kind = drafter_kind(spec)
        k_max = cfg.recommend_k_max
        sweep = sweep_chain(costs, c.curve, c.mean_context, k_max, kind, cfg.extrapolate)
        lv = levers(
            costs,
            c.curve,
            c.mean_context,
            spec.chain_length,
            k_max,
            kind,
            cfg.better_acceptance,
            cfg.verify_cut,
            cfg.draft_cut,
            cfg.extrapolate,
        )
        trees = [
            price_step(
                costs,
                t.mean_context,
                t.drafted_distribution,
                t.accepted_distribution,
                "model",
                specs[t.method].tree,
                t.method,
            )
            for t in cells
            if specs[t.method].mode == "tree"
            and t.prompt_set == c.prompt_set
            and t.context == c.context
            and spec.kind == "eagle3"
        ]
        best = sweep.best
        text = f"{c.method}: K={sweep.best_k} ({best.tokens_per_s:.1f} tok/s predicted)"
        if trees:
            top = max(trees, key=lambda t: t.tokens_per_s)
            if top.tokens_per_s > best.tokens_per_s:
                text = f"{top.setting} ({top.tokens_per_s:.1f} tok/s predicted, measured τ {top.tau:.2f})"
        if sweep.best_k == 0:
            text += (
                f": speculation does not pay at this acceptance (K=1 needs τ > {sweep.break_even_tau(1):.2f}, "
                f"has {sweep.options[1].tau:.2f}; K={k_max} needs {sweep.break_even_tau(k_max):.2f}, "
                f"has {sweep.options[k_max].tau:.2f})"
            )
        out.append(CellRecommendation(c.method, c.prompt_set, c.context, sweep, lv, trees, text))
    return out


def _acceptance(m: Measurements, cfg: DiagnoseConfig, by_context: bool) -> AcceptanceResult:
    labels = {s.name: s.label for s in cfg.prompt_sets}
    groups: dict[tuple[str, str], list[GenerationResult]] = defaultdict(list)
    for g in m.generations:
        key = f"{g.prompt_set} @ {g.context}" if by_context else g.prompt_set
        groups[(key, g.method)].append(g.result)
    results = [
        aggregate(s, meth, labels.get(s.split(" @ ")[0], ""), runs) for (s, meth), runs in groups.items()
    ]
    return AcceptanceResult(results=results, sampling=asdict(cfg.sampling))


def _config_dict(cfg: DiagnoseConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg), default=str))
