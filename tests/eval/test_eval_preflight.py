"""The evaluation stage checks what it writes to and talks to before its first forward: a ``work_dir`` that is a
file or cannot be written, an ``eval.server_url`` that is not an address or where nothing answers, a missing
engine venv each end it in one line naming the setting, instead of after the whole bundled evaluation."""

from __future__ import annotations

import pytest

from eyas.common import ConfigError
from eyas.eval.stage import EvalJob, EvalStageConfig, run
from eyas.serving.engine_process import free_port
from eyas.serving.export import export
from eyas.serving.load import random_drafter
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import TargetConfig, load_target

from ..conftest import run_app

SETS = [{"name": "p", "source": "builtin:predictable", "n": 1, "max_new_tokens": 4}]


class ForwardRan(AssertionError):
    pass


@pytest.fixture
def no_forward(monkeypatch, tiny_target_dir):
    """A tiny target (with a chat tokenizer) whose and whose drafter's forward raise :class:`ForwardRan`."""
    target = load_target(TargetConfig(path=str(tiny_target_dir), dtype="float32", device="cpu"))

    def boom(*a, **kw):
        raise ForwardRan("a model forward ran before the settings were checked")

    monkeypatch.setattr(type(target.model), "forward", boom)
    monkeypatch.setattr(Eagle3Drafter, "forward", boom)
    return target


def _job(tmp_path, target, work_dir, **kw) -> EvalJob:
    d = tmp_path / "export"
    if not d.exists():
        export(random_drafter(target, draft_vocab_size=64), target, d)
    ecfg = EvalStageConfig(prompt_sets=SETS, export_dir=str(d), profile=None, methods=["eagle3-chain"], **kw)
    return EvalJob(eval=ecfg, work_dir=str(work_dir))


def _file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


def test_the_guard_catches_a_forward(tmp_path, no_forward):
    """The control: with good settings the stage reaches a forward, which the fixture turns into ForwardRan."""
    with pytest.raises(ForwardRan):
        run(_job(tmp_path, no_forward, tmp_path / "runs"), no_forward)


@pytest.mark.parametrize(
    "case,why",
    [("file", "is a file"), ("under_file", "is a file"), ("uncreatable", "/proc accepts no new directories")],
)
def test_an_unwritable_work_dir_is_named_before_any_forward(tmp_path, no_forward, case, why):
    work_dir = {
        "file": _file(tmp_path),
        "under_file": _file(tmp_path) / "sub",
        "uncreatable": "/proc/eyas-eval",
    }[case]
    with pytest.raises(ConfigError) as e:
        run(_job(tmp_path, no_forward, work_dir), no_forward)
    msg = str(e.value)
    assert msg.startswith(f"work_dir={work_dir}: ") and why in msg and "\n" not in msg


@pytest.mark.parametrize("url", ["notaurl", "localhost:8000", "http://:80", "http://host:port"])
def test_a_server_url_that_is_not_an_address_is_refused_with_the_config(url):
    with pytest.raises(
        ConfigError, match=r"^eval.server_url='.*' is not a server address: give http://host:port"
    ):
        EvalStageConfig(prompt_sets=SETS, engine="vllm", server_url=url)


def test_a_server_url_where_nothing_answers_is_named_before_any_forward(tmp_path, no_forward):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as e:
        run(_job(tmp_path, no_forward, tmp_path / "runs", engine="vllm", server_url=url), no_forward)
    assert str(e.value).startswith(f"eval.server_url={url}: no engine server answers there")


def test_a_missing_engine_venv_is_named_before_any_forward(tmp_path, no_forward):
    py = tmp_path / "nope" / "bin" / "python"
    with pytest.raises(ConfigError, match=rf"^eval.server.python={py} does not exist"):
        run(
            _job(tmp_path, no_forward, tmp_path / "runs", engine="vllm", server={"python": str(py)}),
            no_forward,
        )


@pytest.mark.parametrize("module", ["eval", "pipeline"])
def test_the_commands_end_in_one_line_with_status_2_before_loading_the_target(
    tmp_path, monkeypatch, capsys, module
):
    """``python -m eyas.eval`` and the pipeline (whose eval comes after hours of training) check eval's settings
    first: one line, exit status 2, no target loaded."""
    import eyas.serving.models.target

    def no_load(*a, **kw):
        raise ForwardRan("the target was loaded before the settings were checked")

    monkeypatch.setattr(eyas.serving.models.target, "load_target", no_load)
    if module == "eval":
        from eyas.eval.__main__ import main
    else:
        from eyas.pipeline import main
    py = tmp_path / "nope" / "python"
    argv = ["eval.engine=vllm", f"eval.server.python={py}", f"work_dir={tmp_path / 'runs'}"]
    assert run_app(main, argv + ["eval.export_dir=x"] * (module == "eval"), monkeypatch, tmp_path) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == f"error: eval.server.python={py} does not exist"
    )
