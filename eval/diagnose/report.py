"""The report: ``report.md``, ``results.json``, plots and the console summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eyas.eval.diagnose.analysis import DiagnoseResult
from eyas.eval.profile import StepProfile
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.eval.throughput import (
    CostCurves,
)


# -- report ------------------------------------------------------------------------------------------------------
def decomposition_rows(result: DiagnoseResult) -> list[dict[str, Any]]:
    rows = []
    for c in result.cells:
        p = c.prediction
        rows.append(
            {
                "method": c.method,
                "set": c.prompt_set,
                "label": c.label,
                "L": c.context,
                "ctx": c.mean_context,
                "tau": c.tau,
                "draft": p.draft_ms,
                "verify": p.verify_ms,
                "book": p.bookkeeping_ms,
                "step": p.step_ms,
                "pred": p.tokens_per_s,
                "meas": c.measured_tokens_per_s,
                "ratio": c.check.ratio,
                "noise": c.check.noise,
                "threshold": c.check.threshold,
                "flagged": c.check.flagged,
                "verdict": c.check.verdict,
            }
        )
    return rows


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.0f}%"


def decomposition_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| method | set | L (mean) | τ | draft ms | verify ms | bookkeeping ms | step ms | predicted tok/s "
        "| measured tok/s | pred/meas | noise | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in decomposition_rows(result):
        lines.append(
            f"| {r['method']} | {r['set']} ({r['label']}) | {r['L']} ({r['ctx']:.0f}) | {r['tau']:.2f} "
            f"| {r['draft']:.1f} | {r['verify']:.1f} | {r['book']:.2f} | {r['step']:.1f} | {r['pred']:.2f} "
            f"| {r['meas']:.2f} | {r['ratio']:.3f} | {_pct(r['noise'])} | {r['verdict']} |"
        )
    return "\n".join(lines)


def measured_breakdown_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| method | set | L | loop draft ms | loop verify ms | loop outside timers ms | wall per step ms "
        "| profile step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result.cells:
        lines.append(
            f"| {c.method} | {c.prompt_set} | {c.context} | {c.measured_draft_ms:.1f} | {c.measured_verify_ms:.1f} "
            f"| {c.measured_loop_ms:.2f} | {c.measured_step_ms:.1f} | {c.prediction.step_ms:.1f} |"
        )
    return "\n".join(lines)


def recommendation_markdown(result: DiagnoseResult) -> str:
    md = []
    for rec in result.recommendations:
        md += [
            f"### {rec.method} / {rec.prompt_set} @ {rec.context} tokens",
            "",
            f"**Recommended: {rec.best}**",
            "",
        ]
        md += [
            "| K | τ | draft ms | verify ms | step ms | predicted tok/s | τ needed to beat K=0 |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = rec.sweep.options[0].step_ms
        for k, o in enumerate(rec.sweep.options):
            mark = " **best**" if k == rec.sweep.best_k else ""
            ext = " (extrapolated)" if o.extrapolated else ""
            md.append(
                f"| {k}{ext}{mark} | {o.tau:.2f} | {o.draft_ms:.1f} | {o.verify_ms:.1f} | {o.step_ms:.1f} "
                f"| {o.tokens_per_s:.2f} | {rec.sweep.break_even_tau(k) if k else 1.0:.2f} |"
            )
        for t in rec.trees:
            md.append(
                f"| {t.setting} | {t.tau:.2f} | {t.draft_ms:.1f} | {t.verify_ms:.1f} | {t.step_ms:.1f} "
                f"| {t.tokens_per_s:.2f} | {t.step_ms / base:.2f} |"
            )
        md += [
            "",
            "| lever | best K | τ | step ms | predicted tok/s | vs as run |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for lv in rec.levers:
            ext = " (extrapolated)" if lv.extrapolated else ""
            md.append(
                f"| {lv.name}{ext} | {lv.k} | {lv.tau:.2f} | {lv.step_ms:.1f} | {lv.tokens_per_s:.2f} "
                f"| {lv.gain:.2f}× |"
            )
        md.append("")
    return "\n".join(md)


def context_choice_markdown(result: DiagnoseResult) -> str:
    """Per context length, the method (its drafter window included) and K predicted fastest."""
    from eyas.eval.diagnose.analysis import fastest_per_length

    lines = [
        "| context length | serve | K | predicted tok/s | plain decoding tok/s |",
        "|---:|---|---:|---:|---:|",
    ]
    for length, p in fastest_per_length(result.context_projections).items():
        serve = "plain decoding" if p.best_k == 0 else p.method
        plain = "—" if p.plain is None else f"{p.plain.tokens_per_s:.2f}"
        lines.append(f"| {length} | {serve} | {p.best_k} | {p.best.tokens_per_s:.2f} | {plain} |")
    return "\n".join(lines)


def context_projection_markdown(result: DiagnoseResult) -> str:
    lines = [
        "| method | L (mean) | K | τ measured at L | step ms | predicted tok/s | best K (tok/s) "
        "| τ held constant (from L) | its tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result.context_projections:
        held = "—" if p.constant is None else f"{p.constant.tau:.2f} ({p.constant_from})"
        held_rate = "—" if p.constant is None else f"{p.constant.tokens_per_s:.2f}"
        mark = " (step cost held)" if p.beyond_profile else ""
        lines.append(
            f"| {p.method} | {p.length} ({p.context:.0f}){mark} | {p.k} | {p.measured.tau:.2f} "
            f"| {p.measured.step_ms:.1f} | {p.measured.tokens_per_s:.2f} | {p.best_k} ({p.best.tokens_per_s:.2f}) "
            f"| {held} | {held_rate} |"
        )
    return "\n".join(lines)


def step_profile(costs: CostCurves) -> StepProfile:
    """The mean costs as an ``eval.profile.StepProfile`` (for ``eval.report.plot_step_time``)."""
    one_row = costs.draft_rows_ms.get(1, [0.0] * len(costs.context_lengths)) if costs.draft_step_ms else []
    return StepProfile(
        costs.context_lengths,
        costs.verify_ms,
        draft_context_ms=list(one_row),
        draft_step_ms=list(costs.draft_step_ms),
        accepted_rows=1,
        draft_rows_ms=costs.draft_rows_ms,
        bookkeeping_ms=costs.bookkeeping_ms,
    )


def write_report(result: DiagnoseResult, out_dir: str | Path, command: str | None = None) -> Path:
    """``report.md``, ``results.json`` and the plots into ``out_dir``; returns the report's path."""
    from eyas.eval import report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "step time against context": report.plot_step_time(
            step_profile(result.costs), out / "step_time.png", result.config.get("chain_length")
        ),
        "predicted against measured tokens/s": report.plot_predicted_vs_measured(
            decomposition_rows(result), out / "predicted_vs_measured.png"
        ),
        "τ per prompt set": report.plot_tau(result.acceptance, out / "tau.png"),
        "τ per prompt set and context": report.plot_tau(
            result.acceptance_by_context, out / "tau_by_context.png"
        ),
        "acceptance per draft position": report.plot_acceptance_by_position(
            result.acceptance, out / "acceptance_by_position.png"
        ),
    }
    if result.recommendations:
        series = {
            f"{r.method} / {r.prompt_set} @ {r.context}": [o.tokens_per_s for o in r.sweep.options]
            for r in result.recommendations
        }
        plots["predicted tokens/s against K"] = report.plot_k_sweep(series, out / "k_sweep.png")
    (out / "results.json").write_text(json.dumps(result.to_dict(), indent=1, default=float))
    flagged = result.flagged
    unchecked = [c for c in result.cells if c.check.verdict.startswith("UNCHECKED")]
    md = ["# eyas diagnose: where the tokens/s go", ""]
    if command:
        md += ["Reproduce with:", "", f"    {command}", ""]
    md += [
        f"Target: {result.target.get('name', '?')}; drafter: {result.drafter or 'none'}; "
        f"measured in {result.wall_s / 60:.1f} min."
        + (
            f" KV cache per token: {result.target['kv_bytes_per_token'] / 1024:.1f} KiB (eval.plan), read by every "
            f"verify forward for every token of context."
            if result.target.get("kv_bytes_per_token")
            else ""
        ),
        "",
        "tokens/s = τ ÷ (draft + verify + bookkeeping), at batch 1. τ is counted from the measured steps; every "
        "time on the left of *measured* comes from `eval.profile`, timed on its own, never from those steps.",
        "",
        f"**{len(flagged)} of {len(result.cells)} cells flagged"
        + (f", {len(unchecked)} unchecked (one generation: no noise estimate)" if unchecked else "")
        + f".** {result.noise}.",
        "",
        "## Decomposition",
        "",
        decomposition_markdown(result),
        "",
        "## The loop's own timers (for localising a mismatch; not used by the prediction)",
        "",
        measured_breakdown_markdown(result),
        "",
        "## τ per prompt set",
        "",
        "(tokens/s in these two tables is end to end, prefill included, as `eval.acceptance` reports it.)",
        "",
        report.markdown_table(result.acceptance),
        "",
        "## τ per prompt set and context",
        "",
        report.markdown_table(result.acceptance_by_context),
        "",
        "## Step time against context (ms, mean of every profile sample)",
        "",
        _costs_markdown(result.costs, result.target.get("kv_bytes_per_token")),
        "",
        "## Recommendations",
        "",
        recommendation_markdown(result),
    ]
    if result.context_projections:
        md += [
            f"## tokens/s against context from measured τ(context) (`{result.config.get('tau_context')}`)",
            "",
            "Each length's τ and acceptance per position were measured there (`eyas context`); the step costs are "
            "this run's. The last columns hold this run's own τ constant instead, as a projection without "
            "long-context measurements would.",
            "",
            context_projection_markdown(result),
            "",
            "What to serve in each context band (the fastest method and K above, drafter windows included):",
            "",
            context_choice_markdown(result),
            "",
        ]
    if result.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    for name, p in plots.items():
        md += [f"## {name}", "", f"![{name}]({p.name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _costs_markdown(costs: CostCurves, kv_bytes_per_token: int | None = None) -> str:
    widths = sorted(costs.verify_ms)
    head = ["context"] + (["KV read per verify (MiB)"] if kv_bytes_per_token else [])
    head += [f"verify {n}" for n in widths]
    if costs.draft_step_ms:
        head += ["draft step", "draft 1 row"]
    if costs.bookkeeping_ms:
        head += [f"bookkeeping {widths[-1]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for i, length in enumerate(costs.context_lengths):
        row = [str(length)] + ([f"{length * kv_bytes_per_token / 2**20:.1f}"] if kv_bytes_per_token else [])
        row += [f"{costs.verify_ms[n][i]:.1f}" for n in widths]
        if costs.draft_step_ms:
            row += [
                f"{costs.draft_step_ms[i]:.2f}",
                f"{costs.draft_rows_ms.get(1, [float('nan')] * (i + 1))[i]:.2f}",
            ]
        if costs.bookkeeping_ms:
            row += [f"{costs.bookkeeping_ms[widths[-1]][i]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_summary(result: DiagnoseResult, report_path: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="tokens/s = τ ÷ (draft + verify + bookkeeping)   [ms; predicted from the profile]")
    for col in (
        "method",
        "set",
        "L",
        "τ",
        "draft",
        "verify",
        "book",
        "pred tok/s",
        "meas tok/s",
        "pred/meas",
        "noise",
        "flag",
    ):
        t.add_column(col, justify="left" if col in ("method", "set") else "right")
    for r in decomposition_rows(result):
        t.add_row(
            r["method"],
            f"{r['set']} ({r['label']})",
            f"{r['L']}",
            f"{r['tau']:.2f}",
            f"{r['draft']:.1f}",
            f"{r['verify']:.1f}",
            f"{r['book']:.2f}",
            f"{r['pred']:.2f}",
            f"{r['meas']:.2f}",
            f"{r['ratio']:.3f}",
            _pct(r["noise"]),
            "LIKELY BUG" if r["flagged"] else r["verdict"].split(":")[0],
        )
    console = Console(width=max(Console().width, 180))
    console.print(t)
    for rec in result.recommendations:
        console.print(f"[bold]{rec.prompt_set} @ {rec.context}[/bold] → {rec.best}")
        console.print(
            "   levers: "
            + "; ".join(f"{lv.name}: {lv.tokens_per_s:.1f} tok/s ({lv.gain:.2f}×)" for lv in rec.levers)
        )
    for c in result.flagged:
        console.print(f"[red]{c.method} / {c.prompt_set} @ {c.context}: {c.check.verdict}[/red]")
    console.print(result.noise)
    if report_path:
        console.print(f"report: {report_path}")
