"""Every command builds its typed config through the one loader (``eyas.common.build_config``), which names an
unknown key or a wrong type in one line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eyas.common import ConfigError, build_config, load_job
from tests.conftest import run_app

CONF = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class Inner:
    k: int = 1
    ratio: float = 0.5


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    sizes: list[int] = field(default_factory=list)
    pair: tuple[float, float] = (0.0, 1.0)
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"outer.limit must be >= 0, not {self.limit}")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inner": {"k": "abc"}}, "outer.inner.k: expected int, got 'abc'"),
        ({"inner": {"kk": 1}}, "outer.inner.kk: unknown key (valid: k, ratio)"),
        ({"sizes": [1, "two"]}, "outer.sizes[1]: expected int, got 'two'"),
        ({"pair": [1.0]}, "outer.pair: expected 2 values, got [1.0]"),
        ({"limit": "many"}, "outer.limit: expected int or None, got 'many'"),
        ({"inner": {"k": True}}, "outer.inner.k: expected int, got True"),
    ],
)
def test_bad_keys_and_types_are_named_in_one_line(data, message):
    with pytest.raises(ConfigError) as e:
        build_config(Outer, data, "outer")
    assert str(e.value) == message


def test_values_are_validated_by_the_dataclass_itself():
    with pytest.raises(ValueError, match=r"^outer.limit must be >= 0, not -1$"):
        build_config(Outer, {"limit": -1}, "outer")


def test_good_values_are_converted_to_the_declared_types():
    out = build_config(Outer, {"inner": {"ratio": 1}, "pair": [0, 2], "limit": None, "name": 7}, "outer")
    assert out == Outer(name="7", inner=Inner(ratio=1.0), pair=(0.0, 2.0))
    assert isinstance(out.inner.ratio, float) and isinstance(out.pair, tuple)


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


def _jobs():
    from eyas.data.extract import ExtractJob
    from eyas.data.prepare import prepare_job
    from eyas.eval.stage import EvalJob
    from eyas.pipeline import pipeline_job
    from eyas.serving.export import ExportJob
    from eyas.train.config import TrainJob

    return {
        "prepare": ("config", prepare_job),
        "extract": ("config", lambda c: load_job(c, ExtractJob)),
        "train": ("config", lambda c: load_job(c, TrainJob)),
        "export": ("config", lambda c: load_job(c, ExportJob)),
        "eval": ("config", lambda c: load_job(c, EvalJob)),
        "pipeline": ("demo", pipeline_job),
        "bench": ("bench", pipeline_job),
        "recipe": ("recipe", pipeline_job),
    }


@pytest.mark.parametrize(
    "command", ["prepare", "extract", "train", "export", "eval", "pipeline", "bench", "recipe"]
)
def test_every_command_builds_its_config_and_names_a_bad_override(command):
    config_name, build = _jobs()[command]
    job = build(_compose(config_name, []))
    assert job.target.path == "embedded"
    group, key, bad, expected = {
        "prepare": ("prepare", "max_len", "long", "int"),
        "extract": ("extract", "shard_size", "abc", "int"),
        "export": ("export", "overwrite", "maybe", "bool"),
        "eval": ("eval", "chain_length", "six", "int"),
    }.get(command, ("train", "max_steps", "abc", "int"))
    if command in ("prepare", "extract", "export", "eval", "pipeline", "bench", "recipe"):
        with pytest.raises(ConfigError, match=r"^target.dtype: expected str, got \[1\]$"):
            build(_compose(config_name, ["target.dtype=[1]"]))
    with pytest.raises(ConfigError) as e:
        build(_compose(config_name, [f"{group}.{key}={bad}"]))
    assert str(e.value) == f"{group}.{key}: expected {expected}, got '{bad}'"
    with pytest.raises(ConfigError, match=rf"^{group}.no_such_key: unknown key"):
        build(_compose(config_name, [f"+{group}.no_such_key=1"]))


@pytest.mark.parametrize(
    "command",
    ["prepare", "extract", "train", "export", "eval", "diagnose", "plan", "demo", "bench", "recipe"],
)
def test_every_command_has_help(command, capsys, monkeypatch, tmp_path):
    from eyas.cli import COMMANDS, main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets its own
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code in (None, 0)
    out = capsys.readouterr().out
    assert out.startswith(f"eyas {command}: {COMMANDS[command][1]}")
    assert "== Config ==" in out  # Hydra's help: the groups and the composed config


def test_eyas_help_lists_every_command(capsys):
    from eyas.cli import COMMANDS, main

    main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)


@pytest.mark.parametrize(
    ("module", "override", "message"),
    [
        ("eyas.train.__main__", "train.max_steps=abc", "train.max_steps: expected int, got 'abc'"),
        (
            "eyas.data.extract",
            "extract.max_batch_rows=lots",
            "extract.max_batch_rows: expected int, got 'lots'",
        ),
        ("eyas.pipeline", "train.lr=fast", "train.lr: expected float, got 'fast'"),
    ],
)
def test_a_command_ends_with_the_one_line_error(module, override, message, capsys, monkeypatch, tmp_path):
    import importlib

    from tests.conftest import run_app

    assert run_app(importlib.import_module(module).main, [override], monkeypatch, tmp_path) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("preset", ["default", "smoke", "gpu"])
def test_every_diagnose_preset_builds_its_config(preset):
    from eyas.command import dry_run
    from eyas.eval.diagnose.__main__ import COMMAND

    job = dry_run(COMMAND, [f"diagnose={preset}"])
    with pytest.raises(ConfigError, match=r"^diagnose.rounds: expected int, got 'many'$"):
        dry_run(COMMAND, [f"diagnose={preset}", "diagnose.rounds=many"])
    assert job.diagnose.methods and job.target.path


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("eyas.data.extract", "extract.samples is not set"),
        ("eyas.serving.export", "export.checkpoint is not set"),
        ("eyas.eval.__main__", "eval.export_dir is not set"),
    ],
)
def test_a_command_names_the_setting_it_still_needs(module, message, capsys, monkeypatch, tmp_path):
    import importlib

    from tests.conftest import run_app

    assert run_app(importlib.import_module(module).main, [], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}: ") and err.count("\n") == 1


def test_recipe_variants_override_the_demo_recipe_and_are_checked_by_name():
    from eyas.lab.recipe import RecipeConfig, variant_configs
    from eyas.pipeline import pipeline_job

    cfg = _compose("recipe", [])
    job = pipeline_job(cfg)
    rc = build_config(RecipeConfig, cfg.recipe, "recipe")
    v = next(v for v in rc.variants if v.name == "loss-tv")
    d, t = variant_configs(v, job.drafter, job.train, seed=3)
    assert d.init == "target" and t.loss == "tv" and t.lr == job.train.lr and t.seed == 3
    assert (
        t.max_steps == job.train.max_steps and t.data.store_dir == job.train.data.store_dir
    )  # same budget, data
    assert (
        t.data.loader["seed"] == 3
    )  # the seed moves the data order too (all a target-started drafter varies by)
    assert {k: v for k, v in t.data.loader.items() if k != "seed"} == {
        k: v for k, v in job.train.data.loader.items() if k != "seed"
    }
    base = (job.train.max_steps, job.train.lr, job.train.ttt_steps, job.train.optimizer)
    assert base == (800, 1e-3, 3, "auto")  # the study's base: today's demo training
    # the study before issue 40 keeps its own base (200 steps, AdamW at 3e-4, TTT 7), so its command lines still
    # train what they trained
    old = next(v for v in rc.variants if v.name == "target-init-lr1e-3")
    _, t = variant_configs(old, job.drafter, job.train, seed=0)
    assert (t.max_steps, t.lr, t.ttt_steps, t.optimizer, t.eval_every) == (200, 1e-3, 7, "adamw", 50)
    # another train config on the command line is the base of the variants, not overridden by the study's
    bench = pipeline_job(_compose("recipe", ["train=bench"])).train
    assert (bench.epochs, bench.lr, bench.ttt_steps, bench.data.loader["max_tokens"]) == (2, 2e-3, 4, 1024)
    assert (bench.optimizer, bench.schedule, bench.decay_ratio) == ("auto", "wsd", 0.2)
    _, t = variant_configs(
        build_config(RecipeConfig, {"variants": [{"name": "x"}]}).variants[0], job.drafter, bench, 0
    )
    assert (t.epochs, t.ttt_steps) == (2, 4)
    bad = {"name": "x", "drafter": {"init": "warm"}}
    with pytest.raises(ValueError, match="drafter.init must be"):
        variant_configs(
            build_config(RecipeConfig, {"variants": [bad]}).variants[0], job.drafter, job.train, 0
        )
    with pytest.raises(ConfigError, match="recipe.x.train.no_such_key: unknown key"):
        variant_configs(
            build_config(RecipeConfig, {"variants": [{"name": "x", "train": {"no_such_key": 1}}]}).variants[
                0
            ],
            job.drafter,
            job.train,
            0,
        )
    with pytest.raises(ValueError, match="unknown variants"):
        build_config(RecipeConfig, {"variants": [{"name": "a"}], "only": ["b"]})


def test_loader_settings_are_checked_when_the_train_config_is_built():
    from eyas.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"^train\.data\.loader\.packing must be one of .*'padding'"):
        build_config(TrainConfig, {"data": {"loader": {"packing": "padding"}}}, "train")
    with pytest.raises(ConfigError, match=r"train\.data\.loader\.rows: unknown key"):
        build_config(TrainConfig, {"data": {"loader": {"rows": 2}}}, "train")
    ok = build_config(
        TrainConfig, {"data": {"loader": {"packing": "padded", "max_tokens": "window"}}}, "train"
    )
    assert ok.data.loader == {
        "packing": "padded",
        "max_tokens": "window",
    }  # the window is the trainer's to resolve


def test_a_recipe_variant_with_a_bad_setting_stops_before_the_target_is_loaded(monkeypatch, tmp_path, capsys):
    import eyas.lab.recipe
    import eyas.serving.models.target

    def no_stage(*args, **kwargs):
        raise AssertionError("the study started before its variants were checked")

    monkeypatch.setattr(eyas.serving.models.target, "load_target", no_stage)
    bad = "recipe.variants=[{name:ok},{name:bad,train:{data:{loader:{packing:padding}}}}]"
    assert run_app(eyas.lab.recipe.main, [bad], monkeypatch, tmp_path) == 2
    assert "train.data.loader.packing must be one of" in capsys.readouterr().err


# ------------------------------------------------------------------ the micro-benchmarks are Hydra apps too
def _bench_commands():
    from eyas.lab import bench_context, bench_extract, bench_served, bench_train, held_out_spread

    return {
        "bench_train": (bench_train, bench_train.BenchTrainConfig, "steps", "abc", "int"),
        "bench_extract": (bench_extract, bench_extract.BenchExtractConfig, "samples", "many", "int"),
        "bench_context": (bench_context, bench_context.BenchContextConfig, "lr", "fast", "float"),
        "bench_served": (bench_served, bench_served.BenchServedConfig, "chain_length", "six", "int"),
        "held_out_spread": (held_out_spread, held_out_spread.HeldOutSpreadConfig, "draws", "many", "int"),
    }


@pytest.mark.parametrize(
    "name", ["bench_train", "bench_extract", "bench_context", "bench_served", "held_out_spread"]
)
def test_micro_benchmarks_are_hydra_apps_that_name_a_bad_override(name, monkeypatch, tmp_path, capsys):
    module, cls, key, bad, expected = _bench_commands()[name]
    cfg = build_config(cls, _compose(name, [])[name], name)
    assert cfg == cls()  # the yaml lists every field at its dataclass default
    with pytest.raises(ConfigError) as e:
        build_config(cls, _compose(name, [f"{name}.{key}={bad}"])[name], name)
    assert str(e.value) == f"{name}.{key}: expected {expected}, got '{bad}'"
    assert run_app(module.main, [f"+{name}.no_such_key=1"], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {name}.no_such_key: unknown key"), err
    assert run_app(module.main, ["--help"], monkeypatch, tmp_path) in (None, 0)
    assert f"{name}:" in capsys.readouterr().out


def test_bench_train_sweep_runs_through_hydra_with_children(monkeypatch, tmp_path):
    """A real (tiny) sweep: the TTT attention alone, block and dense, each timed in its own child process."""
    from eyas.lab import bench_train

    out = tmp_path / "attn.json"
    argv = [
        "bench_train.attention=[]",
        "bench_train.seq_len=[32]",
        "bench_train.steps=1",
        "bench_train.warmup=0",
        "bench_train.threads=1",
        f"bench_train.out={out}",
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["app", *argv])
    bench_train.main()
    res = json.loads(out.read_text())
    assert res["seq_lens"] == [32]
    assert [(r["attention"], r["seq_len"], r["ttt_steps"]) for r in res["results"]] == [
        ("block", 32, 7),
        ("dense", 32, 7),
    ]
    assert all(r["fwd_bwd_ms"] > 0 for r in res["results"])


def test_eyas_bench_passes_its_micro_benchmark_settings_as_overrides(tmp_path, monkeypatch):
    """`eyas bench` runs the micro-benchmarks as `python -m <module> <its overrides> <module>.out=<json>`: the
    conf/bench.yaml lists are valid overrides of their configs, and the JSON comes back."""
    from eyas.lab.bench import _run_json
    from eyas.lab.bench_extract import BenchExtractConfig
    from eyas.lab.bench_train import BenchTrainConfig

    b = _compose("bench", []).bench
    for cls, name, args in (
        (BenchTrainConfig, "bench_train", b.train_bench_args),
        (BenchExtractConfig, "bench_extract", b.extract_bench_args),
    ):
        build_config(
            cls, _compose(name, list(args))[name], name
        )  # every override names a field of the right type
    monkeypatch.chdir(tmp_path)
    res = _run_json(
        [
            "eyas.lab.bench_train",
            "bench_train.attention=[block]",
            "bench_train.seq_len=[16]",
            "bench_train.steps=1",
        ],
        tmp_path / "t.json",
    )
    assert [r["attention"] for r in res["results"]] == ["block"]


def test_the_yaml_lists_every_field_of_the_stage_configs():
    """Every option of the eval, export, extract, regeneration and target configs is spelled out in conf/ (so `eval.dtype=...`
    and the like are plain overrides, not `+key=` additions, and nothing is left to a silent code default)."""
    from dataclasses import fields

    from eyas.data.extract import ExtractStage
    from eyas.data.regenerate import RegenerateConfig
    from eyas.eval.profile import ProfileConfig
    from eyas.eval.stage import EvalStageConfig
    from eyas.serving.engine_process import EngineServerConfig
    from eyas.serving.export import ExportStage
    from eyas.serving.models.target import TargetConfig
    from eyas.serving.tree import TreeConfig

    cfg = _compose("config", [])
    for cls, node in [
        (EvalStageConfig, cfg.eval),
        (ProfileConfig, cfg.eval.profile),
        (EngineServerConfig, cfg.eval.server),
        (TreeConfig, cfg.eval.tree),
        (ExportStage, cfg.export),
        (ExtractStage, cfg.extract),
        (TargetConfig, cfg.target),
        (RegenerateConfig, cfg.prepare.regen),
        (EngineServerConfig, cfg.prepare.regen.server),
    ]:
        assert {f.name for f in fields(cls)} == set(node), cls.__name__
    for name in ("demo", "bench"):
        job = _jobs()["pipeline"][1](_compose(name, []))
        assert job.eval.dtype == "auto" and job.eval.measure_best_k
