"""The engine extraction backend trusts no path from a server reply: the hidden-states file a reply names is opened,
and deleted, only inside the states directory eyas was given (``extract.server_states_dir``, or the store's
``.engine-states/`` for a server eyas starts); a file is deleted only once it parsed and held this sample's tokens,
else it is kept and named. Without the engine's venv, extraction names ``extract.server.python`` and creates
nothing."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.data.extract import ExtractConfig
from eyas.data.extract_engine import (
    ENGINE_STATES_DIR,
    EngineFeatureError,
    HiddenStatesClient,
    check_states,
    engine_target,
)
from eyas.data.types import Sample
from eyas.serving.engine_process import REPO_ROOT, EngineError, EngineServerConfig
from eyas.serving.models.target import TargetConfig

SAMPLE = Sample(id="s0", input_ids=[3, 4, 5], loss_mask=[False, True, True])


class ReplyServer:
    """``/v1/completions`` answering with ``reply_path`` as its hidden-states file, whatever the prompt."""

    def __init__(self, reply_path: str):
        self.reply_path = reply_path
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"data": [{"id": "stub"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(
                    {
                        "choices": [{"text": "x"}],
                        "kv_transfer_params": {"hidden_states_path": stub.reply_path},
                    }
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> ReplyServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _states_file(path: Path, ids: list[int]) -> None:
    save_file({"hidden_states": torch.zeros(len(ids), 2, 4), "token_ids": torch.tensor(ids)}, str(path))


def _outside(tmp_path: Path) -> Path:
    """A file of the user's beside the states directory, in the engine's format (so only the path can refuse it)."""
    victim = tmp_path / "user" / "precious.safetensors"
    victim.parent.mkdir()
    _states_file(victim, SAMPLE.input_ids)
    Path(str(victim) + ".lock").write_text("")
    return victim


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_reply_naming_a_file_outside_the_states_dir_is_refused_and_the_file_survives(tmp_path, how):
    states = tmp_path / "states"
    states.mkdir()
    victim = _outside(tmp_path)
    before = victim.read_bytes()
    reply = {
        "absolute": str(victim),
        "dotdot": str(states / ".." / "user" / victim.name),
        "symlink": str(states / "req-1.safetensors"),
    }[how]
    if how == "symlink":
        os.symlink(victim, reply)
    with ReplyServer(reply) as srv:
        client = HiddenStatesClient(srv.url, states, timeout_s=2)
        with pytest.raises(EngineError) as e:
            client.fetch(SAMPLE)
    msg = str(e.value)
    assert reply in msg and "not inside the states directory" in msg and str(states) in msg
    assert "extract.server_states_dir" in msg
    assert victim.read_bytes() == before and Path(str(victim) + ".lock").exists()


def test_a_file_that_does_not_parse_is_named_and_kept(tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    bad = states / "req-1.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with ReplyServer(str(bad)) as srv, pytest.raises(EngineError) as e:
        HiddenStatesClient(srv.url, states, timeout_s=0.3).fetch(SAMPLE)
    msg = str(e.value)
    assert str(bad) in msg and "not a readable safetensors file" in msg and "did not appear" not in msg
    assert bad.exists()


def test_a_file_of_other_tokens_is_named_and_kept_and_a_good_one_deleted(tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    f = states / "req-1.safetensors"

    def check(s, st):
        return check_states(s, st, num_aux=1, hidden_size=4)

    _states_file(f, [9, 9, 9])
    with ReplyServer(str(f)) as srv:
        client = HiddenStatesClient(srv.url, states, timeout_s=2)
        with pytest.raises(EngineFeatureError, match=rf"other tokens.*the file is kept: {f}"):
            client.fetch(SAMPLE, check)
        assert f.exists()
        _states_file(f, SAMPLE.input_ids)
        assert client.fetch(SAMPLE, check)["hidden_states"].shape == (3, 2, 4)
    assert not f.exists(), "a file that passed its checks is deleted"


def test_a_server_url_without_its_states_dir_is_refused():
    with pytest.raises(ValueError, match=r"extract.server_url needs extract.server_states_dir="):
        ExtractConfig(backend="vllm", server_url="http://127.0.0.1:1")


@pytest.mark.parametrize("python", ["missing", "default"])
def test_without_the_vllm_venv_extraction_names_its_own_setting_and_creates_nothing(
    tmp_path, tiny_target_dir, monkeypatch, python
):
    if python == "default" and (REPO_ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("this checkout has .venv-vllm")
    monkeypatch.chdir(tmp_path)
    given = str(tmp_path / "nope" / "python") if python == "missing" else None
    cfg = ExtractConfig(backend="vllm", server=EngineServerConfig(python=given), progress=False)
    out = tmp_path / "store"
    with pytest.raises(EngineError) as e, engine_target(TargetConfig(path=str(tiny_target_dir)), cfg, out):
        pass
    msg = str(e.value)
    assert "extract.server.python=" in msg and "eval.server" not in msg
    assert not (out / ENGINE_STATES_DIR).exists()
