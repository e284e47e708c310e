"""`make bench` writes a generated page and never the hand-written BENCH.md (eyas/lab/bench.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eyas.eval.acceptance import AcceptanceResult
from eyas.lab.bench import GENERATED_MARK, write_bench_md

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def _pipe():
    """The least of a pipeline result the page writer reads."""
    stage = SimpleNamespace(name="train", facts={"steps": 10})
    return SimpleNamespace(
        stages=[stage], acceptance=AcceptanceResult([], {}), report="runs/eval/x/report.md"
    )


def _write(path: Path) -> None:
    write_bench_md(path, _pipe(), None, None, None, "python -m eyas.lab.bench", 60.0)


def test_the_bench_page_writer_leaves_the_hand_written_bench_md_intact(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_WORK", str(tmp_path / "runs"))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("bench")
    out = Path(OmegaConf.to_container(cfg.bench, resolve=True)["out"])
    assert out.resolve() != (REPO / "BENCH.md").resolve() and out.name == "BENCH.generated.md"

    hand = tmp_path / "BENCH.md"
    hand.write_text("# eyas benchmark\n\nStudies written by hand, 1,355 lines of them.\n")
    before = hand.read_text()
    with pytest.raises(FileExistsError, match="not a page eyas.lab.bench generated"):
        _write(hand)  # bench.out=BENCH.md, by mistake or habit
    assert hand.read_text() == before

    _write(out)  # the default: a generated page under the work dir, rewritten run after run
    _write(out)
    assert out.read_text().splitlines()[0] == GENERATED_MARK
