"""A stand-in for a vLLM / SGLang server, for tests of eval/engine_eval.py without either engine installed.

``python engine_stub.py --port P [--accept A] [--k K] [--ready-after S] [--die] [--never-ready]
[--served-model-name NAME] [--extra-model NAME]``

Every request generates ``max_tokens`` tokens: the first from prefill, the rest in verify steps that each accept
``A`` of ``K`` drafts (the last step accepts what is left), and publishes vLLM's spec-decode counters for them on
``/metrics`` a little after the response (as vLLM's asynchronous stat loggers do). ``/generate`` answers as
SGLang's native API, with ``spec_verify_ct`` (verify steps, the prefill not among them) in ``meta_info``.
Completions carry their token ids (:func:`output_ids`: vLLM's ``return_token_ids``, SGLang's ``output_ids``).
``/v1/models`` lists ``--extra-model`` (a model this stub does not serve) before its own, as a server with
several models may; completions for any other model than its own are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, k: int, accept: int):
        self.k, self.accept = k, accept
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * k
        self.lock = threading.Lock()

    def steps(self, n: int) -> list[int]:
        """Accepted drafts of each verify step generating ``n`` tokens."""
        out = []
        while n > 0:
            a = min(self.accept, n - 1)
            out.append(a)
            n -= a + 1
        return out

    def publish(self, steps: list[int]) -> None:
        time.sleep(0.3)
        with self.lock:
            for a in steps:
                self.drafts += 1
                self.draft_tokens += self.k
                self.accepted += a
                for i in range(a):
                    self.per_pos[i] += 1

    def metrics(self) -> str:
        with self.lock:
            lines = [
                "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="stub"}} {float(self.drafts)}',
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="stub"}} {float(self.draft_tokens)}',
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="stub"}} {float(self.accepted)}',
            ]
            lines += [
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="stub",position="{i}"}} '
                f"{float(v)}"
                for i, v in enumerate(self.per_pos)
            ]
        return "\n".join(lines) + "\n"


def output_ids(prompt: list[int], n: int) -> list[int]:
    """The ``n`` token ids the stub "generates" for a prompt: a function of the prompt, as greedy decoding is."""
    return [(sum(prompt) + 7 * j) % 1000 for j in range(n)]


def make_handler(
    state: State, ready_at: float, never_ready: bool, model: str = "stub-model", extra: str | None = None
):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ok = not never_ready and time.monotonic() >= ready_at
                self._send(200 if ok else 503, "")
            elif self.path == "/metrics":
                self._send(200, state.metrics(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                listed = ([extra] if extra else []) + [model]
                self._send(200, json.dumps({"data": [{"id": m} for m in listed]}))
            else:
                self._send(404, "")

        def _stream(self, events: list[dict]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ev in events:
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/completions":
                if body.get("model") != model or not all(isinstance(t, int) for t in body["prompt"]):
                    self._send(400, json.dumps({"error": "bad request"}))
                    return
                n = int(body["max_tokens"])
                steps = state.steps(n - 1)  # the first token comes from prefill
                ids = output_ids(body["prompt"], n)
                chunks, at = [1] + [a + 1 for a in steps], 0
                events = []
                for size in chunks:
                    choice = {"index": 0, "text": "t" * size, "finish_reason": None}
                    if body.get("return_token_ids"):  # vLLM: each chunk's own tokens
                        choice["token_ids"] = ids[at : at + size]
                    events.append({"choices": [choice]})
                    at += size
                events[-1]["choices"][0]["finish_reason"] = "length"
                events.append(
                    {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
                )
                self._stream(events)
                threading.Thread(target=state.publish, args=(steps,)).start()
            elif self.path == "/generate":
                n = int(body["sampling_params"]["max_new_tokens"])
                steps = state.steps(n - 1)  # the first token comes from prefill, not from a verify step
                meta = {
                    "completion_tokens": n,
                    "spec_verify_ct": len(steps),
                    "finish_reason": {"type": "length"},
                }
                prompt = body["input_ids"]
                self._stream([{"text": "t" * n, "output_ids": output_ids(prompt, n), "meta_info": meta}])
            else:
                self._send(404, "")

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--accept", type=int, default=2)
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--die", action="store_true")
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--served-model-name", default="stub-model")
    p.add_argument("--extra-model", default=None)
    a = p.parse_args()
    print("stub engine: loading model weights", flush=True)
    if a.die:
        print("RuntimeError: stub engine failed to allocate the KV cache", flush=True)
        sys.exit(3)
    server = ThreadingHTTPServer(
        ("127.0.0.1", a.port),
        make_handler(
            State(a.k, a.accept),
            time.monotonic() + a.ready_after,
            a.never_ready,
            a.served_model_name,
            a.extra_model,
        ),
    )
    print(f"stub engine: serving on {a.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
