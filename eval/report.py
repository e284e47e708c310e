"""Reports: a markdown page with PNG plots, a JSON of every number, and a short terminal table.

Design decisions:
- Plots are what a person would rather look at than read: τ per prompt set and method, acceptance per draft
  position, step time against context length, tokens/s with the speedup over plain decoding.
- Everything the plots show is also in ``results.json`` (the report never holds a number the JSON lacks).
- Every τ, tokens/s and speedup is printed with its 95% interval over prompts (``1.85 [1.71, 1.98]``,
  :mod:`eval.intervals`), and methods compared with each other are compared paired on the same prompts.
- matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from eyas.eval.acceptance import REFERENCE, AcceptanceResult, SetMethodResult  # noqa: E402
from eyas.eval.engine_eval import AgreementRule, EngineSetResult, check_agreement  # noqa: E402
from eyas.eval.intervals import Interval  # noqa: E402
from eyas.eval.profile import StepProfile  # noqa: E402
from eyas.eval.throughput import shortest_fastest  # noqa: E402


def _save(fig, ax, path: Path, xlabel: str | None, ylabel: str, title: str, legend: int | None = 8) -> Path:
    """Label, (legend,) lay out, write and close one plot."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend is not None:
        ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _grouped_bars(ax, sets: list[str], methods: list[str], value, interval=None) -> None:
    """Bars of ``value(set, method)``, with error bars at ``interval(set, method)`` (an Interval or None)."""
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        ys = [value(s, m) for s in sets]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(sets))]
        cis = [interval(s, m) if interval else None for s in sets]
        err = [
            [y - c.low if c is not None and c.defined else 0.0 for y, c in zip(ys, cis)],
            [c.high - y if c is not None and c.defined else 0.0 for y, c in zip(ys, cis)],
        ]
        bars = ax.bar(xs, ys, width, label=m, yerr=err if interval else None, capsize=2)
        for b, y in zip(bars, ys):
            if y == y:  # not NaN
                ax.annotate(
                    f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7
                )
    ax.set_xticks(range(len(sets)), sets)
    ax.legend(fontsize=8)


def _plot_per_set(acc: AcceptanceResult, path: Path, attr: str, ylabel: str, title: str) -> Path:
    """Grouped bars of ``attr`` of every (prompt set, method) result, with its 95% interval (``<attr>_ci``)."""
    sets = list(dict.fromkeys(r.prompt_set for r in acc.results))
    methods = list(dict.fromkeys(r.method for r in acc.results))
    fig, ax = plt.subplots(figsize=(7, 4))
    _grouped_bars(
        ax,
        sets,
        methods,
        lambda s, m: getattr(acc.get(s, m), attr, float("nan")),
        lambda s, m: getattr(acc.get(s, m), f"{attr}_ci", None),
    )
    return _save(fig, ax, path, None, ylabel, f"{title} (bars: 95% interval over prompts)", legend=None)


def plot_tau(acc: AcceptanceResult, path: Path) -> Path:
    return _plot_per_set(acc, path, "tau", "acceptance length τ (tokens / verify step)", "τ per prompt set")


def plot_throughput(acc: AcceptanceResult, path: Path) -> Path:
    return _plot_per_set(acc, path, "tokens_per_s", "tokens / s (end to end)", "Throughput per prompt set")


def plot_acceptance_by_position(acc: AcceptanceResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in acc.results:
        if r.acceptance_by_position and r.method != "none":
            xs = list(range(1, len(r.acceptance_by_position) + 1))
            ax.plot(xs, r.acceptance_by_position, marker="o", label=f"{r.prompt_set} / {r.method}")
    xlabel, ylabel = "draft position", "P(accepted ≥ position)"
    ax.set_ylim(0, 1.02)
    return _save(fig, ax, path, xlabel, ylabel, "Acceptance per draft position", legend=7)


def plot_step_time(prof: StepProfile, path: Path, chain_length: int | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, ms in sorted(prof.verify_ms.items()):
        ax.plot(prof.context_lengths, ms, marker="o", label=f"verify, {n} token{'s' if n > 1 else ''}")
    if prof.draft_step_ms:
        ax.plot(prof.context_lengths, prof.draft_step_ms, marker="s", ls="--", label="draft, one step")
        if chain_length:
            total = [prof.draft_ms(i, chain_length) for i in range(len(prof.context_lengths))]
            ax.plot(prof.context_lengths, total, marker="s", ls=":", label=f"draft, chain of {chain_length}")
    ax.set_xscale("log", base=2)
    return _save(fig, ax, path, "context length (tokens)", "ms", "Step time against context length")


def _with_ci(value: float, ci: Interval | None, fmt: str, suffix: str = "") -> str:
    """``value`` with its interval (``1.85 [1.71, 1.98]``); empty for NaN."""
    if value != value:
        return ""
    if ci is not None and ci.defined:
        return ci.format(fmt, suffix)
    return f"{format(value, fmt)}{suffix}"


def result_cells(r: SetMethodResult, times: str = "×") -> dict[str, str]:
    """A result's τ, tokens/s and speedup cells, each with its 95% interval, and its greedy match."""
    return {
        "tau": _with_ci(r.tau, r.tau_ci, ".2f"),
        "tokens_per_s": _with_ci(r.tokens_per_s, r.tokens_per_s_ci, ".1f"),
        "speedup": _with_ci(r.speedup, r.speedup_ci, ".2f", times),
        "match": "" if r.match_rate != r.match_rate else f"{r.match_rate:.0%}",
    }


def results_table(acc: AcceptanceResult, title: str = "eyas: acceptance and throughput") -> Table:
    t = Table(title=title, caption="[..]: 95% interval over the set's prompts")
    for col in ("set", "method", "τ", "accept@1..", "tok/s", "speedup", "greedy match"):
        t.add_column(col, justify="right" if col not in ("set", "method") else "left")
    for r in acc.results:
        pos = " ".join(f"{a:.2f}" for a in r.acceptance_by_position[:6])
        c = result_cells(r, "x")
        t.add_row(r.prompt_set, r.method, c["tau"], pos, c["tokens_per_s"], c["speedup"], c["match"])
    return t


ENGINE_COLUMNS = (
    "set",
    "engine",
    "τ engine",
    "τ bundled",
    "Δτ",
    "accept@1.. engine",
    "tok/s engine",
    "tok/s bundled",
    "TTFT ms engine",
    "TTFT ms bundled",
    "τ engine / bundled, judged prompts",
    "agreement",
)


def engine_rows(engine: list[EngineSetResult], acc: AcceptanceResult, method: str = "eagle3-chain") -> list:
    """One row per prompt set: the engine's numbers beside the bundled loop's ``method`` on the same prompts,
    and the agreement verdict (:func:`eval.engine.check_agreement`)."""

    def f(x: float, fmt: str) -> str:
        return "" if x != x else format(x, fmt)

    rows = []
    for e in engine:
        b = acc.get(e.prompt_set, method) or acc.get(e.prompt_set, "dflash-chain")
        nan = float("nan")
        verdict = judged = ""
        if b:
            ag = check_agreement(e, b)
            verdict = f"{ag.verdict} (judged on {ag.basis}; same output on {ag.same_outputs}/{ag.prompts})"
            judged = f"{f(ag.tau_engine, '.2f')} / {f(ag.tau_bundled, '.2f')}"
        rows.append(
            [
                e.prompt_set,
                e.engine,
                _with_ci(e.tau, e.tau_ci, ".2f"),
                _with_ci(b.tau, b.tau_ci, ".2f") if b else "",
                f(e.tau - b.tau if b else nan, "+.2f"),
                " ".join(f"{a:.2f}" for a in e.acceptance_by_position[:8]),
                _with_ci(e.tokens_per_s, e.tokens_per_s_ci, ".1f"),
                _with_ci(b.tokens_per_s, b.tokens_per_s_ci, ".1f") if b else "",
                f(e.mean_ttft_ms, ".0f"),
                f(b.mean_ttft_ms if b else nan, ".0f"),
                judged,
                verdict,
            ]
        )
    return rows


def engine_agreements(engine: list[EngineSetResult], acc: AcceptanceResult) -> list[dict[str, Any]]:
    """The agreement verdict and its reasons per set (for ``results.json``)."""
    out = []
    for e in engine:
        b = acc.get(e.prompt_set, "eagle3-chain") or acc.get(e.prompt_set, "dflash-chain")
        if b is not None:
            out.append(check_agreement(e, b).to_dict())
    return out


def print_engine_table(engine: list[EngineSetResult], acc: AcceptanceResult) -> None:
    t = Table(title="serving engine against the bundled loop (eagle3-chain), same prompts")
    for col in ENGINE_COLUMNS:
        t.add_column(
            col, justify="left" if col in ("set", "engine", "accept@1.. engine", "agreement") else "right"
        )
    for row in engine_rows(engine, acc):
        t.add_row(*row)
    Console(width=max(160, Console().width)).print(t)


def engine_markdown_table(engine: list[EngineSetResult], acc: AcceptanceResult) -> str:
    lines = ["| " + " | ".join(ENGINE_COLUMNS) + " |", "|" + "---|" * len(ENGINE_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in engine_rows(engine, acc)]
    return "\n".join(lines)


_RULE = AgreementRule()
ENGINE_NOTE = (
    "τ engine: tokens per verify step inside the engine, the prefill's token not counted, as in the bundled loop "
    "(vLLM: 1 + Δaccepted / Δdrafts of its /metrics counters around each prompt; SGLang: (completion tokens - 1) "
    "/ spec_verify_ct). accept@i: share of drafts whose first i tokens were accepted. tok/s: completion tokens "
    "over request wall time, one request at a time, prefill included; TTFT: first streamed token (bundled: "
    "prefill and the first token's choice). [..]: 95% interval over the set's prompts. agreement: the engine's "
    f"τ within {_RULE.tau_rtol:.0%} of the bundled loop's and its acceptance at every position within "
    f"{_RULE.position_atol}; inconclusive where the bundled τ is below {_RULE.min_bundled_tau} (an export served "
    "wrong runs at τ ≈ 1, which so weak a drafter cannot be told from). Judged on the prompts whose output the "
    f"engine and the bundled loop decoded to the very same tokens when at least {_RULE.min_same_outputs} did (there "
    "both verified the same sequence, so a gap is the drafter's serving, not two kernels' greedy drift), else on "
    "all the set's prompts; the judged prompts' τ on both sides stands beside the verdict, counted as vLLM counts "
    "(1 + accepted drafts per verify step)."
)

GREEDY_MATCH_NOTE = (
    f"greedy match = share of prompts whose output is token for token plain decoding's on the same numerics "
    f"(`{REFERENCE}` where plain decoding, `none`, is timed on faster numerics than the speculative methods, else "
    "`none`). With row-exact attention (the CPU default: bf16, see the numerics line under Run facts) every chain, "
    "prompt lookup and plain decoding score each position bit for bit as a one-token forward does, so their match "
    "must be 100% and a miss is a bug; a tree's side branches sit at other cache slots, so at a near-tie their rows "
    "can round differently. fp32 is near-exact (differences ~1e-5 in the logits). In bf16 with stock attention "
    "(GPU, and `none` when it is timed on sdpa), a verify forward over several tokens rounds differently from a "
    "one-token forward, so at a near-tie the target's own argmax can flip and the text take another (equally "
    "greedy) path: `none`'s own match against the reference says how often."
)

SPEEDUP_NOTE = (
    "speedup = end-to-end tokens/s over plain decoding (`none`) on the same prompts, every method interleaved "
    "prompt by prompt in one run; plain decoding is timed on its own fastest numerics (see Run facts). [..]: "
    "95% interval over the set's prompts (bootstrap; a speedup's is paired with plain decoding on the same prompts)."
)


def print_table(acc: AcceptanceResult, title: str = "eyas: acceptance and throughput") -> None:
    Console(width=max(120, Console().width)).print(results_table(acc, title))


def markdown_table(acc: AcceptanceResult) -> str:
    lines = [
        "| set | method | τ [95%] | acceptance per position | tokens/s [95%] | speedup [95%] | greedy match |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in acc.results:
        pos = " ".join(f"{a:.2f}" for a in r.acceptance_by_position)
        c = result_cells(r)
        lines.append(
            f"| {r.prompt_set} | {r.method} | {c['tau']} | {pos} | {c['tokens_per_s']} | {c['speedup']} | "
            f"{c['match']} |"
        )
    return "\n".join(lines)


def comparison_table(acc: AcceptanceResult) -> str:
    """Methods compared paired on the same prompts (:meth:`AcceptanceResult.comparisons`); empty if none."""
    rows = acc.comparisons()
    if not rows:
        return ""
    lines = [
        "| set | method | against | Δτ [95%] | tokens/s ratio [95%] |",
        "|---|---|---|---:|---:|",
    ]
    for c in rows:
        lines.append(
            f"| {c.prompt_set} | {c.method} | {c.against} | {c.delta_tau.format('+.2f')} | "
            f"{c.speed_ratio.format('.2f', '×')} |"
        )
    lines += [
        "",
        "Paired on the same prompts of the same run: a Δτ interval that excludes 0, or a ratio interval that "
        "excludes 1, is a difference these prompts resolve; one that holds it is not.",
    ]
    return "\n".join(lines)


def write_report(
    out_dir: Path,
    acc: AcceptanceResult,
    prof: StepProfile | None = None,
    extra: dict[str, Any] | None = None,
    title: str = "eyas evaluation",
    chain_length: int | None = None,
    command: str | None = None,
    sections: dict[str, str] | None = None,
    engine: list[EngineSetResult] | None = None,
) -> Path:
    """Write ``report.md``, the plots and ``results.json`` into ``out_dir``; returns the report path.
    ``sections``: further titled markdown sections, written after the result table. ``engine``: the same prompt
    sets measured inside a serving engine (:mod:`eval.engine`), shown beside the bundled loop."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {}
    if acc.results:
        plots = {
            "τ per set": plot_tau(acc, out_dir / "tau.png"),
            "acceptance per position": plot_acceptance_by_position(
                acc, out_dir / "acceptance_by_position.png"
            ),
            "tokens/s": plot_throughput(acc, out_dir / "throughput.png"),
        }
    if prof is not None:
        plots["step time vs context"] = plot_step_time(prof, out_dir / "step_time.png", chain_length)
    data: dict[str, Any] = {"acceptance": acc.to_dict()}
    if prof is not None:
        data["profile"] = prof.to_dict()
    if engine is not None:
        data["engine"] = [e.to_dict() for e in engine]
        data["engine_agreement"] = engine_agreements(engine, acc)
    if extra:
        data.update(extra)
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, default=float))
    md = [f"# {title}", ""]
    if command:
        md += ["Reproduce with:", "", f"    {command}", ""]
    if acc.results:
        md += [markdown_table(acc), "", SPEEDUP_NOTE, "", GREEDY_MATCH_NOTE, ""]
        paired = comparison_table(acc)
        if paired:
            md += ["## Paired comparisons", "", paired, ""]
    for name, text in (sections or {}).items():
        md += [f"## {name}", "", text, ""]
    if engine is not None:
        md += ["## Serving engine", "", engine_markdown_table(engine, acc), "", ENGINE_NOTE, ""]
    if extra:
        md += ["## Run facts", ""]
        md += [f"- **{k}**: {v}" for k, v in extra.items() if not isinstance(v, (dict, list))]
        md.append("")
    for name, p in plots.items():
        md += [f"## {name}", "", f"![{name}]({p.name})", ""]
    if prof is not None:
        md += [
            "## Step time (ms, median)",
            "",
            "| context | "
            + " | ".join(
                [f"verify {n}" for n in sorted(prof.verify_ms)]
                + (["draft step"] if prof.draft_step_ms else [])
            )
            + " |",
            "|---:|" + "---:|" * (len(prof.verify_ms) + (1 if prof.draft_step_ms else 0)),
        ]
        for i, length in enumerate(prof.context_lengths):
            row = [f"{prof.verify_ms[n][i]:.1f}" for n in sorted(prof.verify_ms)]
            if prof.draft_step_ms:
                row.append(f"{prof.draft_step_ms[i]:.2f}")
            md.append(f"| {length} | " + " | ".join(row) + " |")
        md.append("")
        if prof.plain_numerics:
            md += [
                f"verify 1 (plain decoding's step, the K = 0 price) timed on {prof.plain_numerics}, the baseline's "
                "numerics; every other column on the speculative methods'.",
                "",
            ]
        if prof.machine:
            md += ["Timed on " + ", ".join(f"{k} {v}" for k, v in prof.machine.items()) + ".", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return path


def plot_predicted_vs_measured(rows: list[dict[str, Any]], path: Path) -> Path:
    """Predicted (line) and measured (markers) tokens/s against context, one colour per method / prompt set.

    rows: dicts with ``method``, ``set``, ``L`` (context), ``pred``, ``meas`` and ``flagged``.
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"{r['method']} / {r['set']}", []).append(r)
    for i, (name, rs) in enumerate(groups.items()):
        rs = sorted(rs, key=lambda r: r["L"])
        color = f"C{i % 10}"
        xs = [r["L"] for r in rs]
        ax.plot(xs, [r["pred"] for r in rs], color=color, ls="-", label=f"{name}: predicted")
        ax.plot(xs, [r["meas"] for r in rs], color=color, ls="none", marker="o", label=f"{name}: measured")
        for r in rs:
            if r.get("flagged"):
                ax.annotate("!", (r["L"], r["meas"]), color="red", fontsize=12, ha="center", va="bottom")
    ax.set_xscale("log", base=2)
    title = "Predicted τ ÷ step time against measured tokens/s"
    return _save(fig, ax, path, "context length (tokens)", "tokens / s (decode, batch 1)", title, legend=6)


def plot_k_sweep(series: dict[str, list[float]], path: Path) -> Path:
    """Predicted tokens/s against chain length K (entry K of each series; K = 0 is plain decoding); the star marks
    the K that ``sweep_chain`` recommends (``shortest_fastest``: a tie goes to the shorter chain)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        best = shortest_fastest(ys)
        line = ax.plot(range(len(ys)), ys, marker="o", label=name)[0]
        ax.plot([best], [ys[best]], marker="*", markersize=14, color=line.get_color())
    title = "Predicted tokens/s against K (★ = best)"
    return _save(fig, ax, path, "chain length K (drafts per step)", "predicted tokens / s", title, legend=6)
