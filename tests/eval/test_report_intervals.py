"""Every τ, tokens/s and speedup a report shows carries its 95% interval: the markdown table, the printed table
and results.json (eval/report.py), and methods are compared paired on the same prompts."""

from __future__ import annotations

import json

import pytest

from eyas.eval.acceptance import PromptSetSpec, default_methods, run_acceptance
from eyas.eval.report import print_table, write_report
from eyas.serving.load import random_drafter
from tests.conftest import make_tiny_target


def test_tables_and_json_carry_the_intervals(tmp_path, capsys):
    target = make_tiny_target("llama")
    prompts = [[11, 12, 13, 14, 15, 16] * 3, [40, 41, 42, 40, 41, 42, 40], [7, 8, 9, 10], [30, 31, 30, 31]]
    spec = PromptSetSpec("s", "ids", 4, "s", max_new_tokens=10)
    methods = default_methods(3, with_tree=False)
    acc = run_acceptance(target, random_drafter(target, 64, seed=3), {"s": (spec, prompts)}, methods)
    report = write_report(tmp_path, acc, title="t")
    chain = acc.get("s", "eagle3-chain")
    assert chain.tau_ci.defined and chain.tau_ci.low <= chain.tau <= chain.tau_ci.high
    row = next(line for line in report.read_text().splitlines() if line.startswith("| s | eagle3-chain |"))
    assert chain.tau_ci.format() in row and chain.tokens_per_s_ci.format(".1f") in row
    assert chain.speedup_ci.format(".2f", "×") in row
    data = json.loads((tmp_path / "results.json").read_text())
    saved = next(r for r in data["acceptance"]["results"] if r["method"] == "eagle3-chain")
    for key in ("tau_ci", "tokens_per_s_ci", "speedup_ci"):
        assert {"estimate", "low", "high", "level", "n"} <= set(saved[key]) and saved[key]["n"] == 4
    assert len(saved["per_prompt"]) == 4
    (paired,) = data["acceptance"]["comparisons"]
    assert (paired["method"], paired["against"]) == ("eagle3-chain", "prompt-lookup")
    assert paired["delta_tau"]["estimate"] == pytest.approx(chain.tau - acc.get("s", "prompt-lookup").tau)
    assert "## Paired comparisons" in report.read_text()
    print_table(acc)
    printed = capsys.readouterr().out
    assert f"{chain.tau_ci.low:.2f}, {chain.tau_ci.high:.2f}]" in printed and "95% interval" in printed


def test_results_of_two_runs_are_compared_only_on_the_same_prompts():
    """Each prompt's record names its prompt (a fingerprint of its ids), so a comparison across runs (a drafter
    against another evaluated later, as the recipe study does) refuses results of other prompts of the same size."""
    from eyas.eval.acceptance import MethodSpec, compare, prompt_fingerprint

    target = make_tiny_target("llama")
    spec = PromptSetSpec("s", "ids", 2, "s", max_new_tokens=6)
    lookup = [MethodSpec("prompt-lookup", "prompt-lookup", "chain", 3)]
    a_prompts, b_prompts = [[11, 12, 13, 11, 12], [7, 8, 9, 10]], [[11, 12, 13, 11, 12], [30, 31, 30, 31]]
    a = run_acceptance(target, None, {"s": (spec, a_prompts)}, lookup, warmup=False).results[0]
    again = run_acceptance(target, None, {"s": (spec, a_prompts)}, lookup, warmup=False).results[0]
    b = run_acceptance(target, None, {"s": (spec, b_prompts)}, lookup, warmup=False).results[0]
    assert [p.prompt for p in a.per_prompt] == [prompt_fingerprint(p) for p in a_prompts]
    assert compare(a, again).delta_tau.estimate == pytest.approx(0.0)  # the same prompts, run twice
    with pytest.raises(ValueError, match="not measured on the same prompts of s: prompt 1 differs"):
        compare(a, b)
