"""One τ over several evaluations of one drafter: the tokens verify steps emitted (every token generated but the
first of each prompt, which prefill chooses) over the verify steps, summed over every report's ``eagle3-chain`` results (BENCH.md's "the 48 pooled": the recipe's 12 held-out prompts and the 36
others, as ``scripts/eval_held_out.sh`` evaluates them).

A pooled τ is not the mean of the sets' τ: each set weighs by its verify steps (the 36 prompts hold three times
the 12's tokens). BENCH.md states the definition; the sessions that first reported it computed it by hand from
the two reports, and this helper is its committed form.

Usage: python scripts/pooled_tau.py <report.md or its directory> [...] [--method eagle3-chain]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Pooled:
    """τ over every prompt of the given reports."""

    tau: float
    prompts: int
    steps: int
    emitted: int
    """Tokens the verify steps emitted: generated tokens less one per prompt (the bonus tokens included)."""


def results_path(report: str | Path) -> Path:
    """``results.json`` of an evaluation, given its ``report.md`` or its directory."""
    p = Path(report)
    path = (p if p.is_dir() else p.parent) / "results.json"
    if not path.is_file():
        raise SystemExit(
            f"pooled_tau: no results.json beside {report} (give an eval report or its directory)"
        )
    return path


def pooled_tau(reports: list[str | Path], method: str = "eagle3-chain") -> Pooled:
    """τ pooled over every prompt set of every report, for ``method``."""
    prompts = steps = emitted = 0
    for report in reports:
        path = results_path(report)
        rows = [r for r in json.loads(path.read_text())["acceptance"]["results"] if r["method"] == method]
        if not rows:
            raise SystemExit(f"pooled_tau: {path} holds no {method} results")
        for r in rows:
            prompts += r["prompts"]
            steps += r["steps"]
            emitted += r["tokens"] - r["prompts"]
    return Pooled(tau=emitted / steps, prompts=prompts, steps=steps, emitted=emitted)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="eval reports (report.md) or their directories")
    ap.add_argument("--method", default="eagle3-chain")
    a = ap.parse_args(argv)
    p = pooled_tau(a.reports, a.method)
    print(f"pooled τ ({a.method}): {p.tau:.3f} over {p.prompts} prompts, {p.steps} verify steps")


if __name__ == "__main__":
    main(sys.argv[1:])
