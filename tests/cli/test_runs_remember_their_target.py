"""A run remembers its target: training records it (``<run>/target.json``, copied into every checkpoint and
``best/``), export carries it into ``eyas_export.json``, and ``eyas export`` / ``eyas eval`` load that target when
the command line has no ``target=``, refusing one that does not fit the drafter."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from eyas.serving.target_record import TARGET_FILE, TargetRecord, find_target_record


def run_app(main, argv, monkeypatch, tmp_path) -> int:
    """A Hydra app in this process as ``python -m ... argv`` runs it; its exit status (0: it returned)."""
    monkeypatch.chdir(tmp_path)  # Hydra writes its run directory under the working directory
    monkeypatch.setattr(sys, "argv", ["app", *argv])
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _train(tiny_target_dir: Path, out: Path, monkeypatch, tmp_path) -> Path:
    from eyas.train.__main__ import main

    args = [
        f"target.path={tiny_target_dir}",
        "target.dtype=float32",
        "train=smoke",
        "drafter.draft_vocab_size=64",
        f"train.output_dir={out}",
        "train.wandb.mode=disabled",
        f"hydra.run.dir={tmp_path / 'hydra-train'}",
    ]
    assert run_app(main, args, monkeypatch, tmp_path) == 0
    return max((out / "checkpoints").iterdir())


def test_eval_without_target_evaluates_against_the_tiny_target_the_drafter_was_trained_on(
    tiny_target_dir, tmp_path, monkeypatch, capsys
):
    from eyas.eval.__main__ import main as eval_main
    from eyas.serving.export import main as export_main
    from eyas.serving.models.tiny import tiny_model

    ckpt = _train(tiny_target_dir, tmp_path / "run", monkeypatch, tmp_path)
    want = str(Path(tiny_target_dir).resolve())
    for where in (tmp_path / "run", ckpt):
        rec = TargetRecord.from_dict(json.loads((where / TARGET_FILE).read_text()))
        assert rec.path == want and rec.hidden_size == 64 and rec.aux_layers == [0, 1, 2]

    capsys.readouterr()
    export = tmp_path / "export"
    args = [
        f"export.checkpoint={ckpt}",
        f"export.out_dir={export}",
        f"hydra.run.dir={tmp_path / 'hydra-export'}",
    ]
    assert run_app(export_main, args, monkeypatch, tmp_path) == 0
    assert (
        f"export: target {want} (recorded in {ckpt / TARGET_FILE})" in capsys.readouterr().out
    )  # Hydra's log
    rec, where = find_target_record(export)
    assert rec.path == want and where == export / "eyas_export.json"

    sets = "[{name: p, source: 'builtin:predictable', n: 1, max_new_tokens: 8}]"
    args = [
        f"eval.export_dir={export}",
        f"eval.prompt_sets={sets}",
        "eval.methods=[eagle3-chain,none]",
        "eval.profile=null",
        "eval.measure_best_k=false",
        "eval.dtype=float32",
        f"work_dir={tmp_path / 'runs'}",
        f"hydra.run.dir={tmp_path / 'hydra-eval'}",
    ]
    assert run_app(eval_main, args, monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    assert f"eval: target {want} (recorded in {export / 'eyas_export.json'})" in out
    assert f"target {want} loaded" in out and "report:" in out

    # a target given on the command line that does not fit the drafter is refused, naming both
    other = tmp_path / "other"
    tiny_model("llama", seed=1, vocab_size=rec.vocab_size, hidden_size=32).save_pretrained(other)
    (other / "tokenizer.json").write_bytes((Path(tiny_target_dir) / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tiny_target_dir) / name).exists():
            (other / name).write_bytes((Path(tiny_target_dir) / name).read_bytes())
    assert run_app(eval_main, [*args, f"target.path={other}"], monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert f"the drafter at {export} was trained against {want} (hidden size 64" in err
    assert f"not {other} (hidden size 32" in err and "hidden size 64 vs 32" in err


def test_a_drafter_without_a_record_keeps_the_default_target(tmp_path, caplog):
    from eyas.serving.models.target import TargetConfig
    from eyas.serving.target_record import choose_target

    caplog.set_level(logging.INFO)
    (tmp_path / "old").mkdir()
    chosen = choose_target(None, tmp_path / "old", "eval")
    assert chosen.config == TargetConfig() and chosen.record is None
    assert "records no target" in caplog.text
    given = TargetConfig(path="some/model")
    assert choose_target(given, tmp_path / "old", "eval").config is given
    # a target the caller loaded itself (the pipeline) is used as it is, and not recorded as the default one
    caplog.clear()
    loaded = choose_target(None, tmp_path / "old", "export", caller_loaded=True)
    assert not loaded.known and "records no target" not in caplog.text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [([], False), (["target=hf", "target.path=x"], True), (["target.dtype=float32"], True), (["+target.x=1"], True),
     (["train.target_hidden=1"], False)],
)  # fmt: skip
def test_command_line_sets_a_group_only_when_an_override_names_it(overrides, expected, monkeypatch):
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig

    from eyas.command import command_line_sets

    assert command_line_sets("target")  # outside a Hydra app every value was chosen by the caller
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(
        HydraConfig, "get", staticmethod(lambda: SimpleNamespace(overrides=SimpleNamespace(task=overrides)))
    )
    assert command_line_sets("target") is expected
