"""The evaluation stage's measurement rules (eval/stage.py, eval/acceptance.py): plain decoding timed on its own
fastest numerics, every method interleaved with it in one run, the K to serve chosen on calibration prompts that
are never reported, every verify width probed for exactness."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import eyas.eval.acceptance as acceptance
import eyas.eval.stage as stage
from eyas.eval.acceptance import REFERENCE, PromptSetSpec, default_methods, method_order, run_acceptance
from eyas.eval.stage import EvalJob, EvalStageConfig
from eyas.serving.models.exact_attention import EXACT
from eyas.serving.models.target import cpu_has_bf16
from tests.conftest import make_tiny_target

SETS = [{"name": "p", "source": "builtin:predictable", "n": 2}]


@pytest.fixture
def bf16_cpu(monkeypatch):
    """``eval.dtype=auto`` on a CPU with bf16 units whose row-exact probe passes (recorded: widths probed)."""
    probed = []
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(stage, "probe", lambda target, sizes: probed.append(list(sizes)))
    return probed


def test_plain_decoding_is_timed_on_sdpa_while_the_speculative_methods_keep_row_exact_numerics(bf16_cpu):
    target = make_tiny_target("llama")
    chosen = EvalStageConfig(prompt_sets=SETS).numerics(target)
    assert (chosen.verify.dtype, chosen.verify.attention) == (torch.bfloat16, EXACT)
    assert (chosen.baseline.dtype, chosen.baseline.attention) == (torch.bfloat16, "sdpa")
    assert "plain decoding (`none`, the speedup baseline) on torch.bfloat16 with sdpa" in chosen.note
    fp32 = EvalStageConfig(prompt_sets=SETS, dtype="float32").numerics(target)
    assert fp32.baseline is fp32.verify  # asked for one dtype, with stock attention: one target


def test_the_probe_checks_every_verify_width_the_evaluation_runs(bf16_cpu):
    """A chain of K = 6 verifies 7 tokens, but prompt lookup, the last steps of an answer and a shorter
    recommended K verify 2..6, and the tree its nodes + 1: every width from 2 to the widest is probed."""
    EvalStageConfig(
        prompt_sets=SETS, chain_length=6, tree={"topk": 4, "depth": 3, "total_tokens": 7}
    ).numerics(make_tiny_target("llama"))
    assert bf16_cpu[-1] == [2, 3, 4, 5, 6, 7, 8]
    chain_only = EvalStageConfig(prompt_sets=SETS, chain_length=3, methods=["eagle3-chain", "none"])
    assert chain_only.probe_widths() == [2, 3, 4]


@pytest.mark.skipif(not cpu_has_bf16(), reason="row exactness in bf16 is checked on CPUs with bf16 units")
def test_a_verify_width_between_the_chain_and_two_that_rounds_differently_fails_the_probe(monkeypatch):
    """Rows of a 4-token verify differ from one-token decoding (widths 3-6 occur: prompt lookup, the last steps):
    the probe catches it and the evaluation falls back to float32 instead of claiming exactness."""
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: True)
    target = make_tiny_target("llama")
    real = target.with_dtype

    def nudged_copy(dtype, attention=None):
        t = real(dtype, attention)
        if attention == EXACT:
            forward = t.forward

            def nudged(*args, **kwargs):
                out = forward(*args, **kwargs)
                if out.logits is not None and out.logits.shape[1] == 4:
                    out.logits[0, 2, 0] += 1.0
                return out

            t.forward = nudged
        return t

    monkeypatch.setattr(target, "with_dtype", nudged_copy)
    chosen = EvalStageConfig(prompt_sets=SETS, chain_length=6, methods=["eagle3-chain", "none"]).numerics(
        target
    )
    assert chosen.verify.dtype == torch.float32 and "4-token verify" in chosen.note


def test_methods_rotate_per_prompt_and_every_prompt_runs_every_method_before_the_next():
    methods = default_methods(3, with_tree=False)
    orders = [[m.name for m in method_order(methods, i)] for i in range(4)]
    assert orders[0] == ["eagle3-chain", "prompt-lookup", "none"]
    assert orders[1] == ["prompt-lookup", "none", "eagle3-chain"]
    assert [o[0] for o in orders] == ["eagle3-chain", "prompt-lookup", "none", "eagle3-chain"]


def test_the_baseline_decodes_on_its_own_target_interleaved_with_every_method(monkeypatch):
    """run_acceptance with a baseline target: `none` decodes on it, every other method and the greedy reference on
    the row-exact target; prompt by prompt, every method runs before the next prompt starts; speedups are over
    `none` of the same run, with paired intervals; the chains match the reference output."""
    from eyas.serving.load import random_drafter

    base = make_tiny_target("llama")
    verify = base.with_dtype(torch.bfloat16, EXACT)
    baseline = base.with_dtype(torch.bfloat16, "sdpa")
    drafter = random_drafter(verify, 64, seed=3)
    calls, method_of = [], {}
    real_generate, real_make = acceptance.generate, acceptance.make_proposer

    def make(spec, d):
        proposer = real_make(spec, d)
        method_of[id(proposer)] = spec.name
        return proposer

    def spy(target, proposer, prompt, n, *args, **kwargs):
        if n == 10:  # not the warm-up (8 tokens)
            calls.append((tuple(prompt), method_of[id(proposer)], target))
        return real_generate(target, proposer, prompt, n, *args, **kwargs)

    monkeypatch.setattr(acceptance, "make_proposer", make)
    monkeypatch.setattr(acceptance, "generate", spy)
    prompts = [[11, 12, 13, 14, 15, 16] * 3, [40, 41, 42, 40, 41, 42, 40], [7, 8, 9, 10]]
    spec = PromptSetSpec("s", "ids", 3, "s", max_new_tokens=10)
    acc = run_acceptance(
        verify, drafter, {"s": (spec, prompts)}, default_methods(3, with_tree=False), baseline=baseline
    )
    names = ["eagle3-chain", "prompt-lookup", "none", REFERENCE]
    assert [r.method for r in acc.results] == names
    assert len(calls) == 3 * len(names)
    for i, prompt in enumerate(prompts):  # prompt i: every method once, before prompt i + 1
        group = calls[i * len(names) : (i + 1) * len(names)]
        assert {c[0] for c in group} == {tuple(prompt)}
        on = {name: target for _, name, target in group}
        assert set(on) == set(names)
        assert on["none"] is baseline and on["none"].attention == "sdpa"
        assert on[REFERENCE] is verify and on["eagle3-chain"] is verify and on["prompt-lookup"] is verify
    assert [calls[i * len(names)][1] for i in range(3)] == [
        "eagle3-chain",
        "prompt-lookup",
        "none",
    ]  # rotated
    none = acc.get("s", "none")
    for r in acc.results:
        assert r.speedup == pytest.approx(r.tokens_per_s / none.tokens_per_s)
        assert r.speedup_ci is not None and r.tau_ci is not None and len(r.per_prompt) == 3
        if cpu_has_bf16() and r.method != "none":
            assert r.match_rate == 1.0  # row-exact: every chain emits the reference's tokens


def test_the_k_to_serve_is_chosen_on_calibration_prompts_and_measured_in_the_reported_run(
    tmp_path, monkeypatch, bf16_cpu
):
    """eval.calibration_prompts: the chain at K = chain_length runs on prompts never reported, the profile prices
    the K to serve from them, and that K's chain then runs among the reported methods in the one interleaved run
    (its speedup over the same `none`), with its provenance (split, hardware) recorded."""
    import json

    import eyas.eval.prompts as prompts_module
    from eyas.serving.export import export
    from eyas.serving.load import random_drafter

    target = make_tiny_target("llama")
    export(random_drafter(target, 64, seed=3), target, tmp_path / "export")

    def prompt_ids(spec, tokenizer, seed=0, max_prompt_tokens=None, exclude=()):
        base = 100 if spec.half == "calib" else 20  # the calib half holds other items
        return [[base + i, base + 1 + i, base + 2 + i] * 4 for i in range(spec.n)]

    monkeypatch.setattr(prompts_module, "load_prompt_ids", prompt_ids)
    runs = []
    real_run = stage.run_acceptance

    def spy(target, drafter, sets, methods, *args, **kwargs):
        runs.append(({n: ps for n, (_, ps) in sets.items()}, [m.name for m in methods]))
        return real_run(target, drafter, sets, methods, *args, **kwargs)

    real_recommend = stage.recommend_chain_length
    monkeypatch.setattr(stage, "run_acceptance", spy)
    # the recommendation's own logic is tests/test_recommend.py's; here K = 2 whatever it predicts
    monkeypatch.setattr(stage, "recommend_chain_length", lambda a, p: replace(real_recommend(a, p), best_k=2))
    ecfg = EvalStageConfig(
        prompt_sets=[{"name": "a", "source": "x", "n": 3, "max_new_tokens": 12}],
        chain_length=4,
        methods=["eagle3-chain", "prompt-lookup", "none"],
        calibration_prompts=2,
        profile={"context_lengths": [16, 64], "repeats": 1, "verify_tokens": [1]},
        export_dir=str(tmp_path / "export"),
    )
    res = stage.run(EvalJob(eval=ecfg, work_dir=str(tmp_path / "runs")), target=target)

    (calibration, cal_methods), (reported, methods) = runs  # two runs: no second baseline anywhere
    assert cal_methods == ["eagle3-chain"] and len(calibration["a"]) == 2 and len(reported["a"]) == 3
    assert not {tuple(p) for p in calibration["a"]} & {tuple(p) for p in reported["a"]}
    assert all(p[0] >= 100 for p in calibration["a"])  # drawn from the source's calib half
    assert methods == ["eagle3-chain", "eagle3-chain-k2", "prompt-lookup", "none"]
    rec = res.chain_length
    assert rec.best_k == 2 and rec.chosen_on == {"a": 2}
    assert {"cpu", "threads", "torch"} <= set(rec.hardware) and "calibration split" in rec.markdown()
    none, k2 = res.acceptance.get("a", "none"), res.acceptance.get("a", "eagle3-chain-k2")
    assert k2.speedup == pytest.approx(k2.tokens_per_s / none.tokens_per_s) and k2.speedup_ci is not None
    assert max(s[4] for s in k2.step_records) <= 2
    assert res.profile.plain_numerics.startswith("torch.bfloat16 with sdpa")  # K = 0 priced on the baseline
    data = json.loads((res.report.parent / "results.json").read_text())
    assert data["recommended_k"]["chosen_on"] == {"a": 2}
    assert "calibration prompts (choose K, never reported): a 2" in data["calibration split"]
    assert {(c["method"], c["against"]) for c in data["acceptance"]["comparisons"]} >= {
        ("eagle3-chain", "prompt-lookup"),
        ("eagle3-chain-k2", "eagle3-chain"),
    }
    text = res.report.read_text()
    assert "## Paired comparisons" in text and "τ [95%]" in text


def test_a_calibration_prompt_that_is_also_reported_is_dropped(monkeypatch):
    """A set reported from its whole source (no half) can draw, from its calib half, a prompt it also reports: the
    calibration split leaves it out, and a set that reports its calib half gets no calibration split at all."""
    import eyas.eval.prompts as prompts_module

    def prompt_ids(spec, tokenizer, seed=0, max_prompt_tokens=None, exclude=()):
        first = (
            2 if spec.half == "calib" else 0
        )  # calib half: prompts 2, 3, 4, ...; whole source: 0, 1, 2, ...
        return [[first + i] * 5 for i in range(spec.n)]

    monkeypatch.setattr(prompts_module, "load_prompt_ids", prompt_ids)
    ecfg = EvalStageConfig(
        prompt_sets=[
            {"name": "a", "source": "x", "n": 3},
            {"name": "b", "source": "x", "n": 2, "half": "calib"},
        ],
        calibration_prompts=3,
    )
    split = stage.split_prompts(ecfg, tokenizer=None)
    assert [p[0] for p in split.reported["a"][1]] == [0, 1, 2]
    spec, cal = split.calibration["a"]
    assert [p[0] for p in cal] == [3, 4] and spec.half == "calib" and spec.name == "calib_a"
    assert "b" not in split.calibration
