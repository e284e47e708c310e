"""Regeneration through a serving engine (data/regenerate_server.py) against a stub OpenAI-compatible server on
127.0.0.1 that runs a tiny target in the test process: token-exact requests carry the template's ids and give
in-process regeneration's records; a killed job resumes without asking a finished conversation again; chat mode
refuses a server whose template differs, naming the first differing token; errors name the conversation and the
server's message. One slow test runs real vLLM (``make vllm``) against in-process regeneration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.data.chat import format_prompt
from eyas.data.prepare import PrepareConfig, config_hash, prepare, read_conversations
from eyas.data.regenerate import RegenerateConfig, regenerate
from eyas.data.regenerate_server import (
    PromptMismatchError,
    RegenServerError,
    ServerInfo,
    ServerTarget,
    regenerate_via_server,
    server_info,
)
from tests.data.test_regenerate import QUESTIONS, _convs, _corpus
from tests.tokenizers import TEMPLATES, make_chat_tokenizer

from .regen_stub import RegenStub, model_answer, text_answer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat_target():
    from eyas.serving.models.target import target_from_model
    from eyas.serving.models.tiny import tiny_model

    tok = make_chat_tokenizer("chatml")
    return target_from_model(tiny_model("llama", seed=0, vocab_size=len(tok)), tok, name="tiny-chatml")


def _server_target(tok, name: str = "tiny-chatml") -> ServerTarget:
    return ServerTarget(
        name=name, source="(the stub's)", tokenizer=tok, stop_ids={2}, max_position_embeddings=2048
    )


def _cfg(**kw) -> RegenerateConfig:
    base = dict(max_new_tokens=6, batch_size=3, engine="server", concurrency=2, retry_backoff_s=0.0)
    return RegenerateConfig(**{**base, **kw})


def _records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_token_exact_requests_carry_the_template_ids_and_give_in_process_records(chat_target, tmp_path):
    convs = _convs()
    tok = chat_target.tokenizer
    with RegenStub(tok, model_answer(chat_target)) as stub:
        cfg = _cfg(server_url=stub.url)
        res = regenerate_via_server(
            convs, _server_target(tok), cfg, tmp_path / "s.jsonl", [server_info(stub.url)], progress=False
        )
        bodies = [b for p, b in stub.requests]
    regenerate(
        convs,
        chat_target,
        RegenerateConfig(max_new_tokens=6, batch_size=3),
        tmp_path / "p.jsonl",
        progress=False,
    )
    got, want = _records(tmp_path / "s.jsonl"), _records(tmp_path / "p.jsonl")
    assert got == want  # the same answers, token counts, finish reasons and meta as eyas's own decode loop
    assert res.written == len(convs) and res.turns == sum(
        len(r["meta"]["finish_reasons"]) for r in got.values()
    )
    # every request's prompt is the chat template's rendering of the conversation so far, answers included
    expected = []
    for r in got.values():
        msgs = r["conversations"]
        expected += [format_prompt(msgs[:i], tok) for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert sorted(stub.prompts()) == sorted(expected)
    for b in bodies:
        assert b["model"] == "stub-target" and b["max_tokens"] == 6 and b["temperature"] == 0.0
        assert b["stop_token_ids"] == [2] and b["return_token_ids"] is True and "seed" not in b


def test_a_killed_job_resumes_without_asking_a_finished_conversation(chat_target, tmp_path):
    """``python -m eyas.data.prepare prepare.regen.engine=server`` killed (SIGKILL) mid-run: the rerun asks only
    the conversations the first run had not written, and the result is an uninterrupted run's."""
    tok = chat_target.tokenizer
    corpus = _corpus(tmp_path)
    out = tmp_path / "prep"
    partial = out / "train" / "conversations.partial.jsonl"
    with RegenStub(tok, model_answer(chat_target), delay_s=0.15) as stub:
        tok.save_pretrained(tmp_path / "tok")  # what eyas reads of a target it regenerates through a server
        chat_target.model.config.save_pretrained(tmp_path / "tok")
        args = [
            f"target.path={tmp_path / 'tok'}",
            "corpus=jsonl",
            f"corpus.path={corpus.sources[0].path}",
            "corpus.eval_fraction=0.3",
            "prepare.regenerate=true",
            "prepare.regen.engine=server",
            f"prepare.regen.server_url={stub.url}",
            "prepare.regen.concurrency=1",
            "prepare.regen.max_new_tokens=6",
            "prepare.max_len=64",
            "prepare.progress=false",
            f"prepare.out_dir={out}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "eyas.data.prepare", *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 120
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the job wrote nothing in 120 s"
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        done = set(_records(partial))
        assert 2 <= len(done) < sum(1 for _ in (tmp_path / "chats.jsonl").open()), (
            "killed too late to test a resume"
        )
        first_prompts = _first_prompts(tok)
        asked_before = len(stub.requests)
        from hydra import compose, initialize_config_dir

        from eyas.data.prepare import prepare_job, run

        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            res = run(prepare_job(compose("config", args[:-1])))  # the same command, resumed in this process
        assert res.complete and res.splits["train"].regen.already_done == len(done)
        asked_again = {first_prompts.get(tuple(q)) for q in stub.prompts()[asked_before:]} - {None}
    assert asked_again and not asked_again & done
    # ...and the prepared conversations are those of in-process regeneration (greedy, the same target)
    whole = prepare(
        PrepareConfig(corpus=corpus, out_dir=str(tmp_path / "ref"), max_len=64, regenerate=True,
                      regen=RegenerateConfig(max_new_tokens=6), progress=False),
        chat_target,
    )  # fmt: skip
    for split in ("train", "eval"):
        a = read_conversations(out / split / "conversations.jsonl")
        b = read_conversations(whole.splits[split].conversations_path)
        assert [(c.id, c.messages) for c in a] == [(c.id, c.messages) for c in b]
    assert not partial.exists()


def _first_prompts(tok) -> dict[tuple[int, ...], str]:
    """Conversation id by the ids of its first prompt (the first request asked for it)."""
    return {
        tuple(format_prompt([m for m in c.messages if m["role"] != "assistant"][:1], tok)): c.id
        for c in _convs()
    }


def test_chat_mode_refuses_a_server_template_that_differs_naming_the_first_token(chat_target, tmp_path):
    tok = chat_target.tokenizer
    # the server's template writes "user:" where the target's writes "user"
    other = TEMPLATES["chatml"].replace("{{ m['role'] }}\n", "{{ m['role'] }}:\n")
    conv = _convs(2)[1]
    ours = format_prompt([conv.messages[0]], tok)
    with RegenStub(tok, model_answer(chat_target), template=other) as stub:
        theirs = stub.render([{"role": "user", "content": conv.messages[0]["content"]}])
        i = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        with pytest.raises(PromptMismatchError) as e:
            regenerate_via_server([conv], _server_target(tok), _cfg(request_mode="chat"), tmp_path / "c.jsonl",
                                  [server_info(stub.url)], progress=False)  # fmt: skip
    msg = str(e.value)
    assert f"conversation {conv.id!r} turn 1" in msg and f"first difference at token {i} " in msg
    assert (
        f"eyas {ours[i]} {tok.decode([ours[i]])!r}" in msg
        and f"server {theirs[i]} {tok.decode([theirs[i]])!r}" in msg
    )
    assert (
        tmp_path / "c.jsonl"
    ).read_text() == ""  # nothing written for a conversation answered to another prompt


def test_chat_mode_with_the_targets_template_gives_the_token_mode_records(chat_target, tmp_path):
    convs = _convs()
    tok = chat_target.tokenizer
    with RegenStub(tok, model_answer(chat_target)) as stub:
        for mode in ("tokens", "chat"):
            regenerate_via_server(convs, _server_target(tok), _cfg(request_mode=mode), tmp_path / f"{mode}.jsonl",
                                  [server_info(stub.url)], progress=False)  # fmt: skip
        paths = {p for p, _ in stub.requests}
    assert paths == {"/v1/completions", "/v1/chat/completions"}
    assert _records(tmp_path / "chat.jsonl") == _records(tmp_path / "tokens.jsonl")


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", None])
def test_reasoning_is_kept_in_the_records_reasoning_field(tmp_path, field):
    """The server's reasoning field (vLLM: ``reasoning``, formerly ``reasoning_content``), or a ``<think>`` span in
    the text when it returns neither ids nor a separate field, lands in the record's ``reasoning``."""
    tok = make_chat_tokenizer("qwen3")
    answer = text_answer(tok, "<think>\nTwo plus two is four.\n</think>\n\nThe answer is four.")
    conv = _convs(2)[1]
    with RegenStub(tok, answer, return_ids=False, report_prompt=False, reasoning_field=field) as stub:
        mode = "chat" if field else "tokens"
        regenerate_via_server([conv], _server_target(tok), _cfg(request_mode=mode, max_new_tokens=40),
                              tmp_path / "r.jsonl", [server_info(stub.url)], progress=False)  # fmt: skip
    (rec,) = _records(tmp_path / "r.jsonl").values()
    assistant = rec["conversations"][-1]
    assert assistant == {
        "role": "assistant",
        "content": "The answer is four.",
        "reasoning": "Two plus two is four.",
    }
    assert rec["meta"]["finish_reasons"] == ["stop"]


def test_a_server_error_names_the_conversation_and_the_servers_message(chat_target, tmp_path):
    tok = chat_target.tokenizer
    convs = _convs()
    bad = next(c for c in convs if c.messages[0]["content"] == QUESTIONS[3])
    fail = {QUESTIONS[3]: (400, "This model's maximum context length is 32 tokens")}
    with RegenStub(tok, model_answer(chat_target), fail=fail) as stub:
        with pytest.raises(RegenServerError) as e:
            regenerate_via_server(convs, _server_target(tok), _cfg(), tmp_path / "e.jsonl", [server_info(stub.url)],
                                  progress=False)  # fmt: skip
        asked = len(
            [
                b
                for p, b in stub.requests
                if p == "/v1/completions" and QUESTIONS[3] in tok.decode(b["prompt"])
            ]
        )
    msg = str(e.value)
    assert (
        f"conversation {bad.id!r} turn 1" in msg and "This model's maximum context length is 32 tokens" in msg
    )
    assert "HTTP 400" in msg and stub.url in msg
    assert asked == 1, "a 4xx answer is final: no retry"
    assert bad.id not in _records(tmp_path / "e.jsonl")


def test_transient_failures_are_retried_with_backoff_then_named(chat_target, tmp_path, monkeypatch):
    import eyas.data.regenerate_server as mod

    slept: list[float] = []  # the backoffs (the stub's own zero delays aside)
    monkeypatch.setattr(mod.time, "sleep", lambda s: slept.append(s) if s else None)
    tok = chat_target.tokenizer
    conv = _convs(2)[1]
    with RegenStub(tok, model_answer(chat_target), transient=2) as stub:
        regenerate_via_server([conv], _server_target(tok), _cfg(retries=2, retry_backoff_s=0.5), tmp_path / "a.jsonl",
                              [server_info(stub.url)], progress=False)  # fmt: skip
        assert len(stub.requests) == 3 and slept == [0.5, 1.0]
        stub.transient = 5
        with pytest.raises(
            RegenServerError, match=r"failed 3 times, last: HTTP 503: the engine is overloaded"
        ):
            regenerate_via_server([_convs(3)[2]], _server_target(tok), _cfg(retries=2), tmp_path / "b.jsonl",
                                  [server_info(stub.url)], progress=False)  # fmt: skip
    assert list(_records(tmp_path / "a.jsonl")) == [conv.id]


def test_several_servers_share_the_conversations(chat_target, tmp_path):
    tok = chat_target.tokenizer
    convs = _convs()
    with (
        RegenStub(tok, model_answer(chat_target)) as a,
        RegenStub(tok, model_answer(chat_target), delay_s=0.05) as b,
    ):
        cfg = _cfg(server_url=[a.url, b.url], concurrency=1)
        regenerate_via_server(convs, _server_target(tok), cfg, tmp_path / "dp.jsonl",
                              [server_info(a.url), server_info(b.url)], progress=False)  # fmt: skip
        assert a.requests and b.requests
    regenerate(convs, chat_target, RegenerateConfig(max_new_tokens=6), tmp_path / "p.jsonl", progress=False)
    assert _records(tmp_path / "dp.jsonl") == _records(tmp_path / "p.jsonl")


def test_max_batches_and_the_servers_window_bound_the_run(chat_target, tmp_path):
    tok = chat_target.tokenizer
    convs = _convs()
    with RegenStub(tok, model_answer(chat_target), max_model_len=30) as stub:
        info = server_info(stub.url)
        assert info == ServerInfo(stub.url, "stub-target", 30)
        res = regenerate_via_server(convs, _server_target(tok), _cfg(max_batches=1), tmp_path / "m.jsonl", [info],
                                    progress=False)  # fmt: skip
    recs = _records(tmp_path / "m.jsonl")
    assert res.written == 3 and res.remaining == len(convs) - 3
    for r in recs.values():  # no prompt + answer beyond the server's 30 tokens
        msgs = r["conversations"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert len(format_prompt(msgs[:i], tok)) + 6 <= 30
    assert any(r["meta"].get("ended_early") == "context" for r in recs.values())


def test_server_settings_stay_out_of_the_hash_of_in_process_engines(tmp_path):
    corpus = _corpus(tmp_path)

    def key(**regen) -> str:
        cfg = PrepareConfig(corpus=corpus, regenerate=True, regen=RegenerateConfig(**regen))
        return config_hash(cfg, "tok", "t")

    assert key() == key(concurrency=3, request_mode="chat", server_url="http://a:1")
    assert key(engine="server") == key(
        engine="server", server_url=["http://a:1", "http://b:2"], concurrency=64
    )
    assert key(engine="server") != key(engine="server", request_mode="chat") != key()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prepare.regen.engine=vllm", "engine must be one of loop, hf, server"),
        ("prepare.regen.request_mode=text", "request_mode must be 'tokens' or 'chat'"),
        (
            "prepare.regen.server_url=localhost:8000",
            r"server_url must be http\(s\)://host:port, not .localhost:8000.",
        ),
        ("prepare.regen.concurrency=0", "concurrency must be >= 1"),
    ],
)
def test_bad_server_settings_are_named(override, message):
    from hydra import compose, initialize_config_dir

    from eyas.data.prepare import prepare_config_from_hydra

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        ok = prepare_config_from_hydra(compose("config", ["prepare.regen.engine=server",
                                                          "prepare.regen.server_url=[http://a:1,http://b:2]"]))  # fmt: skip
        assert ok.regen.server_urls == ["http://a:1", "http://b:2"]
        with pytest.raises(ValueError, match=message):
            prepare_config_from_hydra(compose("config", [override]))


def _vllm_python() -> str | None:
    p = ROOT / ".venv-vllm" / "bin" / "python"
    return str(p) if p.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm: run `make vllm` to test against real vLLM")
def test_vllm_token_exact_regeneration_agrees_with_in_process(tmp_path):
    """The embedded target, greedy, through the vLLM server eyas starts (token-exact) against eyas's own decode
    loop, both bf16: prints the share of turns whose text agrees exactly and where the others part."""
    from eyas.data.regenerate_server import ServerSession, load_server_target, regeneration_agreement
    from eyas.serving.engine_process import EngineServerConfig
    from eyas.serving.models.target import TargetConfig, load_target

    convs = _convs()
    server = EngineServerConfig(python=_vllm_python(), max_model_len=1024, dtype="bfloat16")
    cfg = RegenerateConfig(engine="server", max_new_tokens=64, concurrency=4, server=server)
    st = load_server_target(TargetConfig())
    with ServerSession(st, cfg, tmp_path / "server.log", threads=1) as session:
        res = regenerate_via_server(
            convs, st, cfg, tmp_path / "vllm.jsonl", session.servers(), progress=False
        )
    assert res.written == len(convs)
    target = load_target(TargetConfig(dtype="bfloat16", device="cpu"))
    regenerate(
        convs,
        target,
        RegenerateConfig(max_new_tokens=64, batch_size=1),
        tmp_path / "eyas.jsonl",
        progress=False,
    )
    agree = regeneration_agreement(tmp_path / "vllm.jsonl", tmp_path / "eyas.jsonl", st.tokenizer)
    print(f"\nvLLM token-exact vs eyas in-process, greedy bf16: {agree.summary()}")
    assert agree.turns == res.turns and agree.mean_common_prefix > 0.5
