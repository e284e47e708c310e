"""A damaged or foreign drafter is named with its file and the way out: a truncated export weight file, an invalid
``config.json`` (not "no drafter here"), a damaged ``eyas_export.json``, a damaged trainer checkpoint given to the
export command, a drafter for another target (its embedding, or aux layer ids from the export that the target
lacks)."""

from __future__ import annotations

import pytest

from eyas.serving.export import ExportJob, ExportStage, export, record_serving, run
from eyas.serving.export_format import EYAS_SIDECAR, WEIGHTS, ExportError
from eyas.serving.load import DrafterLoadError, describe_export, load_drafter, random_drafter
from eyas.serving.models.drafter import save_drafter_weights
from eyas.serving.models.target import TargetConfig

from ..conftest import make_tiny_target


@pytest.fixture
def exported(tmp_path):
    target = make_tiny_target()
    d = tmp_path / "export"
    export(random_drafter(target, draft_vocab_size=64), target, d)
    return target, d


def test_a_truncated_export_weight_file_is_named_with_the_way_out(exported):
    target, d = exported
    w = d / WEIGHTS
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError) as e:
        load_drafter(str(d), target)
    msg = str(e.value)
    assert str(w) in msg and "damaged" in msg and "export it again" in msg


def test_an_invalid_config_json_is_named_not_reported_as_no_drafter(exported):
    target, d = exported
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    with pytest.raises(ValueError) as e:
        load_drafter(str(d), target)
    msg = str(e.value)
    assert str(d / "config.json") in msg and "not valid JSON" in msg and "no drafter here" not in msg
    assert "export it again" in msg


def test_a_damaged_eyas_export_json_is_named(exported):
    target, d = exported
    (d / EYAS_SIDECAR).write_text('{"format": "sgl')
    for call in (
        lambda: load_drafter(str(d), target),
        lambda: describe_export(d),
        lambda: record_serving(d, 3, "x"),
    ):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert str(d / EYAS_SIDECAR) in msg and "damaged" in msg and "delete it" in msg


def _checkpoint(tmp_path, target):
    drafter = random_drafter(target, draft_vocab_size=64)
    ckpt = tmp_path / "best"
    ckpt.mkdir()
    save_drafter_weights(ckpt, drafter.trainable_state_dict(), drafter.config.to_dict())
    return ckpt


def test_a_damaged_checkpoint_given_to_export_is_named(tmp_path):
    target = make_tiny_target()
    ckpt = _checkpoint(tmp_path, target)
    w = ckpt / "drafter.safetensors"
    w.write_bytes(w.read_bytes()[:64])
    with pytest.raises(ExportError) as e:
        run(ExportJob(export=ExportStage(checkpoint=str(ckpt), out_dir=str(tmp_path / "out"))), target)
    msg = str(e.value)
    assert str(w) in msg and "damaged" in msg and "another checkpoint" in msg
    assert not (tmp_path / "out").exists()


def test_a_drafter_for_another_target_names_the_directory_and_the_target(tmp_path, exported):
    _, d = exported
    other = make_tiny_target(hidden_size=96, vocab_size=320)
    with pytest.raises(ValueError) as e:
        load_drafter(str(d), other)
    msg = str(e.value)
    assert "target embedding (320, 96) does not fit this drafter" in msg
    assert str(d) in msg and other.info.name in msg
    ckpt = _checkpoint(tmp_path, make_tiny_target())
    with pytest.raises(ExportError) as e:
        run(ExportJob(export=ExportStage(checkpoint=str(ckpt), out_dir=str(tmp_path / "out"))), other)
    msg = str(e.value)
    assert "does not fit this drafter" in msg and str(ckpt) in msg and other.info.name in msg


def test_aux_layer_ids_the_target_lacks_are_said_to_come_from_the_export(tmp_path, tiny_target_dir):
    """A drafter for an 8-layer target evaluated on the 4-layer one: its aux ids come from its config."""
    from eyas.serving.load import (
        load_target_for_drafter,
    )  # what eval, diagnose and context load targets with

    deep = make_tiny_target(num_layers=8)
    d = tmp_path / "deep_export"
    export(random_drafter(deep, draft_vocab_size=64), deep, d)
    with pytest.raises(DrafterLoadError) as e:
        load_target_for_drafter(
            TargetConfig(path=str(tiny_target_dir), dtype="float32", device="cpu"), str(d)
        )
    msg = str(e.value)
    assert f"the drafter at {d} reads target layers {list(deep.aux_layers)} (from its config)" in msg
    assert str(tiny_target_dir) in msg and "target it was trained for" in msg
