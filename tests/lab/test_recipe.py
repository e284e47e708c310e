"""The recipe study (eyas/lab/recipe.py, conf/recipe.yaml): its prompts, variants and table, without training."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from eyas.command import dry_run
from eyas.eval.acceptance import PromptSetSpec


def _job(overrides: list[str]):
    from eyas.lab.recipe import COMMAND

    return dry_run(COMMAND, overrides)


def test_the_study_reports_out_of_distribution_reasoning_by_default_from_its_report_half():
    rc = _job([]).recipe
    p = rc.prompts
    assert (p.source, p.half, p.in_distribution) == ("ood_reasoning", "report", False)
    assert p.n == 24  # two prompts of each of the 12 tasks; the report half holds 300


def test_every_prompt_set_field_is_settable_from_the_command_line():
    job = _job(["recipe.prompts.half=calib", "recipe.prompts.n=12", "recipe.prompts.max_new_tokens=64"])
    assert (job.recipe.prompts.half, job.recipe.prompts.n, job.recipe.prompts.max_new_tokens) == (
        "calib",
        12,
        64,
    )
    job = _job(
        [
            "recipe.prompts.in_distribution=true",
            "recipe.prompts.name=reasoning_in_dist",
            "recipe.prompts.source=reasoning_gym",
            "recipe.prompts.label=in distribution",
            "recipe.prompts.half=null",
        ]
    )
    p = job.recipe.prompts
    assert (p.in_distribution, p.name, p.source, p.label, p.half) == (
        True,
        "reasoning_in_dist",
        "reasoning_gym",
        "in distribution",
        None,
    )
    # a key of PromptSetSpec the config lacked would be refused by Hydra ("not in struct"): every one is there
    from hydra import compose, initialize_config_module

    with initialize_config_module("eyas.conf", version_base="1.3"):
        cfg = compose("recipe")
    assert set(cfg.recipe.prompts) == {f.name for f in fields(PromptSetSpec)}
    with pytest.raises(ValueError, match="_in_dist"):  # the set's name says what it is
        _job(["recipe.prompts.in_distribution=true"])


# -- the variants -------------------------------------------------------------------------------------------------
def test_every_variant_composes_and_the_issue_40_ones_each_change_one_thing():
    from eyas.lab.recipe import variant_configs

    job = _job([])
    rc = job.recipe
    names = [v.name for v in rc.selected()]
    assert names[0] == rc.baseline_name() == "default"
    assert {"loss-tv", "loss-lk-hybrid", "loss-jsd", "loss-rkl", "loss-lk", "eagle3.1", "p-eagle"} <= set(
        names
    )
    assert names[-2:] == ["data-diverse", "data-600"]  # the data variants: the same training, other stores
    corpora = {v.name: v.corpus for v in rc.selected() if v.corpus}
    assert corpora == {"data-diverse": "demo_diverse", "data-600": "demo_600"}
    assert not any(v.history for v in rc.selected())  # the study before issue 40 runs only by name
    base_d, base_t = variant_configs(rc.selected()[0], job.drafter, job.train, 0)
    assert (base_t.max_steps, base_t.lr, base_t.ttt_steps, base_t.loss, base_d.init) == (
        800,
        1e-3,
        3,
        "fkl",
        "target",
    )
    for v in rc.variants:  # every one builds, as the study builds them before it trains
        for seed in (0, 1):
            d, t = variant_configs(v, job.drafter, job.train, seed)
        if v.history:
            continue
        changed = {k for k, x in vars(d).items() if x != getattr(base_d, k)}
        changed |= {k for k, x in vars(t).items() if x != getattr(base_t, k) and k not in ("seed", "data")}
        expect = {
            "default": set(),
            "data-diverse": set(),  # same drafter and training; the store is what differs
            "data-600": set(),
            "eagle3.1": {"fc_norm", "norm_output"},
            "p-eagle": {"parallel_drafting"},
            "p-eagle-ttt6": {"parallel_drafting", "ttt_steps"},
            "dflash": {
                "family",
                "init",
                "ttt_steps",
                "decay_gamma",
            },  # the block drafter, its start, block, weights
            # SpecForge's recipe: its optimizer, lr, warm-up, TTT length and a random start; the rest the study's
            "specforge": {"init", "lr", "ttt_steps", "optimizer", "warmup_steps"},
        }.get(v.name, {"loss"})
        assert changed == expect, v.name
        assert t.max_steps == base_t.max_steps and t.data.loader == {**base_t.data.loader, "seed": seed}


def test_only_picks_variants_by_name_and_the_baseline_is_paired_with_any_selection():
    from eyas.lab.recipe import RecipeConfig

    vs = [{"name": "a"}, {"name": "b"}, {"name": "old", "history": True}]
    assert [v.name for v in RecipeConfig(variants=vs).selected()] == ["a", "b"]
    assert [v.name for v in RecipeConfig(variants=vs, only=["old"]).selected()] == ["old"]
    rc = RecipeConfig(variants=vs, only=["b"], baseline="a")
    assert [v.name for v in rc.selected()] == ["a", "b"] and rc.baseline_name() == "a"
    with pytest.raises(ValueError, match="recipe.baseline: unknown variant"):
        RecipeConfig(variants=vs, baseline="c")
    with pytest.raises(ValueError, match="repeats a chain length"):
        RecipeConfig(variants=vs, chain_lengths=[6, 6])


# -- the table, from per-prompt records -----------------------------------------------------------------------------
PROMPTS = [f"p{i}" for i in range(6)]


def _eval(k: int, emitted: list[int], steps: list[int], method: str = "eagle3-chain", prompts=PROMPTS):
    from eyas.eval.acceptance import PromptRecord
    from eyas.lab.recipe_table import ChainEval

    recs = [PromptRecord(e + 1, e, s, 1.0, p) for e, s, p in zip(emitted, steps, prompts)]
    return ChainEval(k, method, "ood_reasoning", sum(emitted) / sum(steps), [0.5], recs)


def _result(name: str, evals, seed: int = 0):
    from eyas.lab.recipe_table import VariantResult

    return VariantResult(
        name, seed, 800, 52_000, 600.0, 2.0, 1.9, f"runs/train/{name}", f"w/{name}@800", evals
    )


BASE = [
    10,
    30,
    15,
    40,
    12,
    25,
]  # emitted per prompt over 10 steps each: τ 1.0 .. 4.0, a wide spread over prompts
STEPS = [10] * 6


def test_every_variant_gets_tau_with_its_interval_and_a_paired_difference_against_the_baseline():
    from eyas.lab.recipe_table import format_table, table_rows

    base = _result("default", [_eval(6, BASE, STEPS), _eval(3, BASE, STEPS)])
    better = _result(
        "loss-tv", [_eval(6, [e + 2 for e in BASE], STEPS), _eval(3, [e + 1 for e in BASE], STEPS)]
    )
    lookup = {k: _eval(k, [9] * 6, STEPS, "prompt-lookup") for k in (6, 3)}
    rows = table_rows([better, base], lookup, "default", [6, 3])
    assert [r.result.variant for r in rows] == ["default", "loss-tv"]  # the baseline first
    b6, v6 = rows[0].cells[6], rows[1].cells[6]
    assert b6.delta is None and b6.relative is None  # the baseline is not compared with itself
    tau_b, tau_v = sum(BASE) / 60, (sum(BASE) + 12) / 60
    assert v6.tau.estimate == pytest.approx(tau_v) and v6.tau.low < tau_v < v6.tau.high
    assert v6.tau.high - v6.tau.low > 0.5  # the prompts' spread: τ alone cannot tell the two apart
    # paired on the same prompts, the spread cancels: +2 tokens per prompt of 10 steps is +0.2 on every resample
    assert (v6.delta.estimate, v6.delta.low, v6.delta.high) == pytest.approx((0.2, 0.2, 0.2))
    assert v6.relative.estimate == pytest.approx(100 * (tau_v / tau_b - 1))
    assert v6.relative.low > 0  # a gain whose interval excludes zero
    assert v6.lookup_ratio.estimate == pytest.approx(tau_v / 0.9)
    assert v6.vs_lookup.estimate == pytest.approx(tau_v - 0.9)
    assert rows[1].cells[3].delta.estimate == pytest.approx(0.1)
    text = format_table(rows, lookup, "default", [6, 3])
    lines = text.splitlines()
    assert "τ, chain K=6" in lines[0] and "Δτ vs default, K=3 (%)" in lines[0]
    assert lines[2].startswith("| default | 0 | 800 | 52,000 | 600 |") and "baseline" in lines[2]
    assert f"{v6.tau.format('.3f')} | +0.200 [+0.200, +0.200] ({v6.relative.format('+.1f', '%')})" in lines[3]
    assert lines[-1].startswith("| prompt-lookup (reference) |") and "0.900" in lines[-1]


def test_a_variant_evaluated_on_other_prompts_than_the_baseline_is_refused():
    from eyas.lab.recipe_table import table_rows

    base = _result("default", [_eval(6, BASE, STEPS)])
    other = _result("loss-tv", [_eval(6, BASE, STEPS, prompts=[*PROMPTS[:5], "elsewhere"])])
    with pytest.raises(
        ValueError, match=r"variant loss-tv \(seed 0\) against the baseline at K=6 .*prompt 5 differs"
    ):
        table_rows([base, other], {}, "default", [6])
    lookup = {6: _eval(6, BASE, STEPS, "prompt-lookup", prompts=PROMPTS[::-1])}
    with pytest.raises(ValueError, match="against prompt lookup"):
        table_rows([base], lookup, "default", [6])
    fewer = _result("loss-jsd", [_eval(6, BASE[:4], STEPS[:4])])
    with pytest.raises(ValueError, match="other prompts"):
        table_rows([base, fewer], {}, "default", [6])


def test_a_variant_without_a_baseline_of_its_seed_has_no_difference():
    from eyas.lab.recipe_table import table_rows

    rows = table_rows(
        [_result("default", [_eval(6, BASE, STEPS)]), _result("loss-tv", [_eval(6, BASE, STEPS)], seed=1)],
        {},
        "default",
        [6],
    )
    assert rows[1].cells[6].delta is None and rows[1].cells[6].tau.defined


def test_the_table_is_recomputed_from_the_json_the_study_keeps():
    import json
    from dataclasses import asdict

    from eyas.lab.recipe_table import ChainEval, VariantResult, format_table, table_rows

    base = _result("default", [_eval(6, BASE, STEPS)])
    v = _result("loss-tv", [_eval(6, [e + 3 for e in BASE], STEPS)])
    lookup = {6: _eval(6, [9] * 6, STEPS, "prompt-lookup")}
    text = format_table(table_rows([base, v], lookup, "default", [6]), lookup, "default", [6])
    again = [VariantResult.from_dict(json.loads(json.dumps(r.to_dict()))) for r in (base, v)]
    lookup_again = {6: ChainEval.from_dict(json.loads(json.dumps(asdict(lookup[6]))))}
    assert again == [base, v]
    assert format_table(table_rows(again, lookup_again, "default", [6]), lookup_again, "default", [6]) == text


# -- the study, its stages stubbed ----------------------------------------------------------------------------------
class Calls(dict):
    """What the stubbed stages ran (compared whole by the tests), with ``seen``: the stores they trained on, the
    training texts the evaluations checked against and the corpora prepared (what the data-variant test reads)."""

    seen: dict[str, list]


def _stub_stages(monkeypatch, tmp_path):
    """The pipeline's stages as the study calls them, without a model: each variant's τ is the baseline's plus a
    token per prompt per position of the variant in the list; prompt lookup drafts 0.9 per step."""
    import json
    from types import SimpleNamespace

    import eyas.lab.recipe as recipe
    import eyas.pipeline as pipeline
    import eyas.serving.models.target as target_module
    from eyas.eval.acceptance import AcceptanceResult

    calls = Calls(train=[], eval=[], lookup=[])
    calls.seen = seen = {"stores": [], "texts": [], "prepare": []}
    target = SimpleNamespace(info=SimpleNamespace(to_dict=lambda: {"name": "tiny"}))
    monkeypatch.setattr(target_module, "load_target", lambda cfg: target)

    def stage_train(store_dir, dcfg, tcfg, target, work_dir, target_cfg):
        d = tmp_path / "train" / f"{Path(store_dir).name}-{tcfg.loss}-{dcfg.parallel_drafting}-{tcfg.seed}"
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "metrics.jsonl").exists():  # trained once; a rerun finds the run finished
            calls["train"].append(tcfg.loss)
            seen["stores"].append(Path(store_dir).name)
            rec = {"kind": "train", "tokens": 1000, "data_wait_s": 0.5, "compute_s": 1.5}
            (d / "metrics.jsonl").write_text(
                (json.dumps(rec) + "\n") * 2 + json.dumps({"kind": "eval"}) + "\n"
            )
        res = SimpleNamespace(
            steps=tcfg.max_steps,
            best_dir=str(d / "best"),
            last_checkpoint=None,
            final_eval={"tau_chain": 2.5, "tau_served": 2.25},
            metrics_path=str(d / "metrics.jsonl"),
        )
        return res, SimpleNamespace(path=str(d))

    def stage_eval(export_dir, ecfg, target, work_dir, extra, command):
        calls["eval"].append((extra["variant"], ecfg.chain_length))
        seen["texts"].append(ecfg.training_text)
        assert ecfg.methods == ["eagle3-chain"] and ecfg.prompt_sets[0].half == "report"
        gain = ["default", "loss-tv", "data-diverse"].index(extra["variant"])
        r = _eval(ecfg.chain_length, [e + gain for e in BASE], STEPS).set_result()
        return AcceptanceResult([r], {}), None, tmp_path / "report.md", None

    def measure_lookup(ecfg, target):
        calls["lookup"].append(ecfg.chain_length)
        return _eval(ecfg.chain_length, [9] * 6, STEPS, "prompt-lookup")

    def stage_prepare(pcfg, target, target_cfg):  # a data variant's mixture, prepared into its own directory
        seen["prepare"].append(pcfg.corpus.name)
        assert pcfg.out_dir is None  # hashed by its settings: never the base's directory
        return SimpleNamespace(out_dir=tmp_path / "prepare" / pcfg.corpus.name), None

    def stage_extract(prep, settings, target, work_dir):
        return tmp_path / "store" / f"of-{prep.out_dir.name}", None

    monkeypatch.setattr(pipeline, "stage_train", stage_train)
    monkeypatch.setattr(pipeline, "stage_prepare", stage_prepare)
    monkeypatch.setattr(pipeline, "stage_extract", stage_extract)
    monkeypatch.setattr(pipeline, "stage_export", lambda res, target, work_dir: (tmp_path / "export", None))
    monkeypatch.setattr(pipeline, "stage_eval", stage_eval)
    monkeypatch.setattr(recipe, "measure_lookup", measure_lookup)
    return calls


def test_a_rerun_recomputes_the_table_without_training_or_evaluating_again(monkeypatch, tmp_path, capsys):
    import json

    from eyas.lab.recipe import run_recipe

    calls = _stub_stages(monkeypatch, tmp_path)
    args = [f"work_dir={tmp_path}", f"recipe.store_dir={tmp_path / 'store'}", "recipe.only=[default,loss-tv]"]
    first = run_recipe(_job(args))
    printed = capsys.readouterr().out
    assert calls == {
        "train": ["fkl", "tv"],
        "eval": [("default", 6), ("default", 3), ("loss-tv", 6), ("loss-tv", 3)],
        "lookup": [6, 3],
    }
    assert "every variant stepped over 2,000 tokens" in printed and "max_steps 800" in printed
    assert (
        "K = 3 (standing in for the recommended K" in printed
        and "`ood_reasoning` (out of distribution" in printed
    )
    (out,) = (tmp_path / "recipe").iterdir()
    kept = json.loads((out / "loss-tv.seed0.json").read_text())
    assert [e["chain_length"] for e in kept["evals"]] == [6, 3] and len(kept["evals"][0]["per_prompt"]) == 6
    assert (
        kept["train_tokens_per_s"] == 500.0
    )  # 2,000 tokens over 4 s of steps, the evaluation's line left out
    table = json.loads((out / "recipe.json").read_text())["table"]
    assert table[1]["chains"]["6"]["delta_tau_vs_baseline"]["estimate"] == pytest.approx(0.1)

    calls.update(train=[], eval=[], lookup=[])
    again = run_recipe(_job(args))
    assert calls == {
        "train": [],
        "eval": [],
        "lookup": [],
    }  # everything reused: the table from the kept results
    assert (
        again == first and (out / "recipe.md").read_text().count("| loss-tv | 0 | 800 | 2,000 | 500 |") == 1
    )
    run_recipe(_job([*args, "recipe.reevaluate=true", "recipe.chain_lengths=[6]"]))
    assert calls["eval"] == [("default", 6), ("loss-tv", 6)] and calls["lookup"] == [6]


def test_a_data_variant_trains_on_its_own_store_and_is_checked_against_its_own_text(monkeypatch, tmp_path):
    """``corpus: demo_diverse``: its mixture is prepared and extracted with the study's settings into a store of
    its own, the variant trains there with the base's training, its prompts are checked against its own training
    text, and its Δτ is paired with the default's on the same prompts; a rerun reuses all of it."""
    import json

    from eyas.lab.recipe import run_recipe

    calls = _stub_stages(monkeypatch, tmp_path)
    base = tmp_path / "store" / "base"
    args = [f"work_dir={tmp_path}", f"recipe.store_dir={base}", "recipe.training_text=base.jsonl",
            "recipe.only=[default,data-diverse]", "recipe.chain_lengths=[6]"]  # fmt: skip
    run_recipe(_job(args))
    seen = calls.seen
    assert seen["prepare"] == ["demo_diverse"]
    assert seen["stores"] == ["base", "of-demo_diverse"] and calls["train"] == ["fkl", "fkl"]
    assert seen["texts"] == [
        "base.jsonl",
        str(tmp_path / "prepare" / "demo_diverse" / "train" / "conversations.jsonl"),
    ]
    (out,) = (tmp_path / "recipe").iterdir()
    table = json.loads((out / "recipe.json").read_text())["table"]
    assert [r["variant"] for r in table] == ["default", "data-diverse"]
    assert table[1]["chains"]["6"]["delta_tau_vs_baseline"]["estimate"] == pytest.approx(0.2)
    calls.update(train=[], eval=[])
    run_recipe(_job(args))
    assert calls["train"] == calls["eval"] == []  # both trainings and evaluations reused


def test_an_unknown_data_variant_corpus_stops_the_study_before_any_work(monkeypatch, tmp_path):
    from eyas.data.corpora import CorpusError
    from eyas.lab.recipe import run_recipe

    calls = _stub_stages(monkeypatch, tmp_path)
    job = _job([f"work_dir={tmp_path}", f"recipe.store_dir={tmp_path / 'store'}", "recipe.only=[default]"])
    job.recipe.variants.append(type(job.recipe.variants[0])(name="data-typo", corpus="no_such_mixture"))
    job.recipe.only = ["default", "data-typo"]
    with pytest.raises((CorpusError, FileNotFoundError, ValueError), match="no_such_mixture"):
        run_recipe(job)
    assert calls["train"] == [] and calls["lookup"] == []


def test_prompt_lookup_runs_on_the_prompts_the_variants_evaluation_runs(tmp_path, monkeypatch):
    """The reference row is measured by the study itself (it has no weights to train): on the same prompts, in the
    same order, as the evaluation stage gives a variant's export, so the two pair."""
    import eyas.eval.prompts as prompts_module
    from eyas.lab.recipe import eval_config, measure_lookup
    from eyas.lab.recipe_table import ChainEval, chain_cell
    from eyas.pipeline import stage_eval
    from eyas.serving.export import export
    from eyas.serving.load import random_drafter
    from tests.conftest import make_tiny_target

    def prompt_ids(
        spec, tokenizer, seed=0, max_prompt_tokens=None, exclude=()
    ):  # the tiny target has no template
        return [[20 + i, 21 + i, 22 + i, 20 + i, 21 + i] for i in range(spec.n)]

    monkeypatch.setattr(prompts_module, "load_prompt_ids", prompt_ids)
    target = make_tiny_target("llama")
    export(random_drafter(target, 64, seed=3), target, tmp_path / "export")
    prompts = (
        "{name:p,source:'builtin:predictable',n:3,label:p,max_new_tokens:6,in_distribution:false,half:null}"
    )
    job = _job([f"work_dir={tmp_path}", f"recipe.prompts={prompts}", "recipe.eval_dtype=float32"])
    ecfg = eval_config(job, 3, None)
    acc, *_ = stage_eval(tmp_path / "export", ecfg, target, tmp_path, {}, "test")
    chain = ChainEval.of(acc.results[0], 3)
    lookup = measure_lookup(ecfg, target)
    assert (chain.method, lookup.method, len(chain.per_prompt)) == ("eagle3-chain", "prompt-lookup", 3)
    assert [p.prompt for p in chain.per_prompt] == [p.prompt for p in lookup.per_prompt] and all(
        p.prompt for p in chain.per_prompt
    )
    cell = chain_cell(chain, None, lookup, "v")
    assert cell.lookup_ratio.estimate == pytest.approx(chain.tau / lookup.tau)
