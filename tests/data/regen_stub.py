"""An OpenAI-compatible stand-in for a serving engine, for tests of data/regenerate_server.py without vLLM.

``RegenStub(tokenizer, answer)`` serves ``/v1/models``, ``/v1/completions`` (token-id prompts) and
``/v1/chat/completions`` on 127.0.0.1 from a thread of the test process, answering as vLLM does with
``return_token_ids``: completions echo ``choices[0].prompt_token_ids`` and return ``choices[0].token_ids`` (the end
token included); chat renders the messages with the tokenizer's template (or ``template``, to play a server whose
template is not the target's) and reports ``prompt_token_ids``; the reasoning parser's ``reasoning`` field is
filled when ``reasoning_field`` is set. ``answer(prompt_ids, body) -> ids`` is the target (a tiny model's greedy
decoding, or a fixed text). Every request body is kept in ``requests``; ``fail`` maps a text the prompt contains to
the (status, message) the server answers; ``transient`` first requests get HTTP 503.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_FORWARD = threading.Lock()
"""A target's forward keeps state between its hooks: one request at a time, over every stub of the test."""


class RegenStub:
    def __init__(
        self,
        tokenizer,
        answer: Callable[[list[int], dict[str, Any]], list[int]],
        *,
        template: str | None = None,
        fail: dict[str, tuple[int, str]] | None = None,
        transient: int = 0,
        return_ids: bool = True,
        report_prompt: bool = True,
        reasoning_field: str | None = None,
        delay_s: float = 0.0,
        model: str = "stub-target",
        max_model_len: int | None = None,
    ):
        self.tok, self.answer, self.template = tokenizer, answer, template
        self.fail = fail or {}
        self.transient = transient
        self.return_ids, self.report_prompt, self.reasoning_field = return_ids, report_prompt, reasoning_field
        self.delay_s, self.model, self.max_model_len = delay_s, model, max_model_len
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    # -- what the server does ------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=self.template
        )
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: list[int], body: dict[str, Any]) -> tuple[list[int], str]:
        with self.lock:  # one forward at a time through the model
            ids = list(self.answer(prompt, body))
        stop = set(body.get("stop_token_ids") or [])
        for i, t in enumerate(ids):
            if t in stop:
                return ids[: i + 1], "stop"
        return ids[: int(body["max_tokens"])], "length"

    def _error(self, path: str, body: dict[str, Any], prompt: list[int]) -> tuple[int, str] | None:
        with self.lock:
            self.requests.append((path, body))
            if self.transient > 0:
                self.transient -= 1
                return 503, "the engine is overloaded, try again"
        text = self.tok.decode(prompt)
        return next((v for k, v in self.fail.items() if k in text), None)

    def completion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = [int(t) for t in body["prompt"]]
        err = self._error("/v1/completions", body, prompt)
        if err:
            return err[0], {"error": {"message": err[1], "type": "BadRequestError", "code": err[0]}}
        ids, finish = self.generate(prompt, body)
        stop = set(body.get("stop_token_ids") or [])
        text = self.tok.decode(
            [t for t in ids if t not in stop], skip_special_tokens=body.get("skip_special_tokens", True)
        )
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
        if body.get("return_token_ids") and self.return_ids:
            choice.update(token_ids=ids, prompt_token_ids=prompt)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        return 200, {"object": "text_completion", "model": self.model, "choices": [choice], "usage": usage}

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = self.render(body["messages"])
        err = self._error("/v1/chat/completions", body, prompt)
        if err:
            return err[0], {"object": "error", "message": err[1], "type": "BadRequestError", "code": err[0]}
        ids, finish = self.generate(prompt, body)
        stop = set(body.get("stop_token_ids") or [])
        text = self.tok.decode(
            [t for t in ids if t not in stop], skip_special_tokens=body.get("skip_special_tokens", True)
        )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_field and "</think>" in text:
            head, _, tail = text.partition("</think>")
            message = {
                "role": "assistant",
                "content": tail.strip(),
                self.reasoning_field: head.replace("<think>", "").strip(),
            }
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        out: dict[str, Any] = {"object": "chat.completion", "model": self.model, "choices": [choice]}
        out["usage"] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        if body.get("return_token_ids") and self.return_ids:
            choice["token_ids"] = ids
            if self.report_prompt:
                out["prompt_token_ids"] = prompt
        return 200, out

    # -- HTTP ----------------------------------------------------------------------------------------------------
    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    card: dict[str, Any] = {"id": stub.model, "object": "model"}
                    if stub.max_model_len:
                        card["max_model_len"] = stub.max_model_len
                    self._send(200, {"object": "list", "data": [card]})
                else:
                    self._send(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("model") != stub.model:
                    self._send(
                        404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
                    )
                    return
                time.sleep(stub.delay_s)
                if self.path == "/v1/completions":
                    self._send(*stub.completion(body))
                elif self.path == "/v1/chat/completions":
                    self._send(*stub.chat(body))
                else:
                    self._send(404, {})

        return Handler

    def __enter__(self) -> RegenStub:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def prompts(self) -> list[list[int]]:
        """The token-id prompts of every completions request so far."""
        with self.lock:
            return [[int(t) for t in b["prompt"]] for p, b in self.requests if p == "/v1/completions"]


def model_answer(
    target, max_tokens_cap: int | None = None
) -> Callable[[list[int], dict[str, Any]], list[int]]:
    """The greedy answer of an eyas :class:`Target` (eyas's own decode loop, so it is what in-process
    regeneration generates), ending at the request's stop tokens."""
    from eyas.data.regenerate import RegenerateConfig, generate_batch

    def answer(prompt: list[int], body: dict[str, Any]) -> list[int]:
        n = (
            int(body["max_tokens"])
            if max_tokens_cap is None
            else min(int(body["max_tokens"]), max_tokens_cap)
        )
        cfg = RegenerateConfig(max_new_tokens=n)
        stops = set(body.get("stop_token_ids") or [2])
        with _FORWARD:  # two stubs may share one target, whose forward is not thread-safe
            return generate_batch(target, [prompt], cfg, 0, stops)[0].token_ids

    return answer


def text_answer(tokenizer, text: str, end: int = 2) -> Callable[[list[int], dict[str, Any]], list[int]]:
    """Always ``text`` then the end token."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end]
    return lambda prompt, body: ids
