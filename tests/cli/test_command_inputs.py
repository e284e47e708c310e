"""Every command is built by :mod:`eyas.command`: its inputs under its own key, named for what they are; an old
spelling or an unknown top-level key refused in one line with the key to write; a bad value or input one line
with exit status 2 (the traceback with ``EYAS_DEBUG=1``); ``--help`` shows the command's own keys; and
``eyas diagnose`` takes an exported drafter from the command line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from eyas.command import dry_run
from eyas.common import ConfigError
from tests.conftest import run_app

ENTRY = {
    "train": "eyas.train.__main__",
    "eval": "eyas.eval.__main__",
    "context": "eyas.eval.context_sweep",
    "diagnose": "eyas.eval.diagnose.__main__",
    "plan": "eyas.eval.plan",
    "extract": "eyas.data.extract",
    "bench_served": "eyas.lab.bench_served",
}


def _main(name: str):
    return importlib.import_module(ENTRY[name]).main


def _no_target(monkeypatch):
    """Fail the test if a command got as far as loading a target: its command line should have been refused."""
    import eyas.serving.models.target

    def refuse(*args, **kwargs):
        raise AssertionError("the command ran instead of refusing its command line")

    monkeypatch.setattr(eyas.serving.models.target, "load_target", refuse)


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [
        ("eval", "eval.checkpoint=/runs/export", "eval.export_dir=/runs/export"),
        ("context", "context.checkpoint=/runs/export", "context.export_dir=/runs/export"),
        ("bench_served", "bench_served.checkpoint=/runs/export", "bench_served.export_dir=/runs/export"),
        ("diagnose", "drafter=/runs/export", "diagnose.export_dir=/runs/export"),
        ("diagnose", "chain_length=6", "diagnose.chain_length=6"),
        ("plan", "model=kimi_k2", "plan.model=kimi_k2"),
        ("plan", "drafter=true", "plan.with_drafter=true"),
    ],
)
def test_an_old_spelling_is_refused_with_the_new_one(command, old, new, capsys, monkeypatch, tmp_path):
    _no_target(monkeypatch)
    assert run_app(_main(command), [old], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {old}: ") and err.endswith(f"write {new}\n"), err
    cmd = importlib.import_module(ENTRY[command]).COMMAND
    dry_run(cmd, [new.replace("/runs/export", str(tmp_path))])  # the new spelling is a valid command line


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("+trian.lr=1", "did you mean train.lr=1?"),  # what Hydra suggests for the typo trian.lr=1
        ("trian.lr=1", "did you mean train.lr=1?"),
        ("++trian.lr=1", "did you mean train.lr=1?"),
        ("max_steps=10", "did you mean train.max_steps=10?"),  # a key of a group the command reads
    ],
)
def test_an_unknown_top_level_key_is_refused_and_the_nearest_suggested(
    override, suggestion, capsys, monkeypatch, tmp_path
):
    _no_target(monkeypatch)
    assert run_app(_main("train"), [override], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    key = override.lstrip("+").split(".")[0].split("=")[0]
    assert err.count("\n") == 1 and err.startswith(f"error: {override}: unknown key '{key}'"), err
    assert suggestion in err and "eyas train reads target, drafter, train" in err


def test_keys_of_the_shared_config_are_still_accepted(tmp_path):
    """``work_dir`` is read through ``train.output_dir: ${work_dir}/train``; other groups of ``conf/config.yaml``
    stay overridable (the pipeline reads them)."""
    from eyas.train.__main__ import COMMAND

    job = dry_run(COMMAND, [f"work_dir={tmp_path}", "eval.chain_length=3", "hydra.run.dir=/tmp/x"])
    assert job.train.output_dir == f"{tmp_path}/train"


def test_a_value_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch, tmp_path):
    _no_target(monkeypatch)
    assert run_app(_main("train"), ["train.epochs=0"], monkeypatch, tmp_path) == 2
    assert capsys.readouterr().err == "error: train.epochs must be positive or null, not 0.0\n"
    monkeypatch.setenv("EYAS_DEBUG", "1")
    assert run_app(_main("train"), ["train.epochs=0"], monkeypatch, tmp_path) == 1  # Hydra's report of it
    err = capsys.readouterr().err
    assert "Traceback" in err and "train.epochs must be positive" in err


def test_a_data_error_names_the_file_in_one_line(capsys, monkeypatch, tmp_path):
    _no_target(monkeypatch)
    bad = tmp_path / "samples.jsonl"
    bad.write_text("not json\n")
    argv = [f"extract.samples={bad}", f"extract.out_dir={tmp_path / 'store'}"]
    assert run_app(_main("extract"), argv, monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}:1: malformed JSON"), err


def test_only_errors_that_say_what_to_change_lose_their_traceback():
    """A bug (an operation that failed inside eyas's code, a library's exception) keeps its traceback."""
    import torch

    from eyas.command import is_input_error
    from eyas.data.corpora.config import CorpusError

    def shape_bug():
        return torch.zeros(2, 3) @ torch.zeros(2, 3)

    for fn, expected in (
        (lambda: build_epochs(0), True),  # TrainConfig's own `raise ValueError(...)`
        (shape_bug, False),  # RuntimeError from torch, raised in a frame that is not eyas's
        (lambda: json.loads("{"), False),  # a library's ValueError subclass
        (lambda: (_ for _ in ()).throw(CorpusError("x.jsonl: empty")), True),  # an error class eyas defines
        (lambda: Path("/nonexistent/eyas-file").read_text(), True),  # a missing file, named
    ):
        with pytest.raises(Exception) as e:
            fn()
        assert is_input_error(e.value) == expected, (fn, e.value)


def build_epochs(epochs):
    from eyas.common import build_config
    from eyas.train.config import TrainConfig

    return build_config(TrainConfig, {"epochs": epochs}, "train")


@pytest.mark.parametrize(
    ("command", "key", "inputs"),
    [
        ("eval", "eval", ["export_dir: null"]),
        ("context", "context", ["export_dir: null"]),
        ("diagnose", "diagnose", ["export_dir: null", "chain_length: 4"]),
        ("plan", "plan", ["model: smollm2_135m", "with_drafter: false"]),
        ("export", "export", ["checkpoint: ???", "out_dir: ???"]),
    ],
)
def test_help_shows_the_commands_inputs_under_its_own_key(
    command, key, inputs, capsys, monkeypatch, tmp_path
):
    from eyas.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["eyas"])
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    config = out.split("== Config ==", 1)[1]
    assert f"\n{key}:\n" in config and all(f"\n  {line}\n" in config for line in inputs), config
    assert "\ntrain:\n" not in config and "\ncorpus:\n" not in config  # keys this command does not read


def test_diagnose_takes_an_exported_drafter_from_the_command_line(tiny_target_dir, tmp_path, monkeypatch):
    """README's `eyas diagnose diagnose.export_dir=<export>`: before, `drafter=<dir>` met the trainer's `drafter`
    config group ("Could not override 'drafter'") and diagnose could not be pointed at an export at all."""
    from eyas.serving.export import ExportConfig, export
    from eyas.serving.load import random_drafter
    from eyas.serving.models.target import TargetConfig, load_target

    target = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32", device="cpu"))
    export(
        random_drafter(target, 64, seed=1), target, tmp_path / "export", config=ExportConfig(dtype="float32")
    )
    out = tmp_path / "diagnose"
    argv = [
        f"target.path={tiny_target_dir}",
        "target.dtype=float32",
        "target.device=cpu",
        "diagnose=smoke",
        f"diagnose.export_dir={tmp_path / 'export'}",
        "diagnose.methods=[eagle3-chain]",
        "diagnose.contexts=[48]",
        "diagnose.rounds=1",
        "diagnose.profile_repeats=1",
        f"diagnose.out_dir={out}",
    ]
    assert run_app(_main("diagnose"), argv, monkeypatch, tmp_path) in (0, 1)  # 1: a flagged cell
    res = json.loads((out / "results.json").read_text())
    assert res["drafter"] == str(tmp_path / "export")
    assert {r["method"] for r in res["acceptance"]["results"]} == {"eagle3-chain"}


def test_a_bad_export_dir_is_named(capsys, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"^diagnose.export_dir: expected str or None"):
        from eyas.eval.diagnose.__main__ import COMMAND

        dry_run(COMMAND, ["diagnose.export_dir=[1]"])
