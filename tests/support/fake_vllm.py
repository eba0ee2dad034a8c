"""A stand-in for a vLLM OpenAI-compatible server, for the fault tests: ``python -m tests.support.fake_vllm --port P``.

A real vLLM server takes about a minute to start on 2 cores, so the tests that kill a server mid-run and start it
again use this one (stdlib only; it starts in well under a second). It serves what ``VllmBackend`` reads:
``/health``, ``/v1/models`` (the embedded model's directory as ``root``, so the app loads the same tokenizer),
``/metrics`` (a recorded payload of the real server, tests/data/vllm/metrics_before.txt, with this process's own
``process_start_time_seconds``, so that a restarted fake is seen as one), ``/tokenize`` and ``/detokenize`` (a toy
chat template: each turn as ``<role>content``, one token per character) and streaming
``/v1/completions`` as vLLM sends them (SSE ``data:`` lines, ``token_ids``, a final usage chunk, ``[DONE]``), one
token every ``--delay`` seconds, so a test can kill it mid-stream.

In-process (``serve()``), each server gets a ``Handler`` subclass of its own whose class attributes a test sets:
how ``/metrics`` answers (``metrics_text``, ``metrics_status``, ``metrics_delay``) and ``/tokenize``
(``tokenize_errors``: statuses to answer first, one per call; ``tokenize_calls`` counts the calls).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "assets" / "models" / "tinystories-llama"
METRICS = ROOT / "tests" / "data" / "vllm" / "metrics_before.txt"
MODEL = "tinystories-llama"  # the recorded metrics carry this model_name
STARTED = time.time()  # this process's start, as its /metrics says
NO_TEMPLATE = (  # what vLLM answers /tokenize for messages to a model without a chat template (HTTP 400)
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if "
    "the tokenizer does not define one."
)
WORDS = ["Once", " upon", " a", " time", ",", " there", " was", " a", " little", " dog", "."]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay = 0.05
    counts = {"active": 0, "finished": 0, "aborted": 0}  # GET /fake/stats: what happened to the streams
    lock = threading.Lock()
    metrics_text: str | None = None  # None: the recorded payload with this process's start time
    metrics_status = 200
    metrics_delay = 0.0  # seconds before /metrics answers
    tokenize_errors: list[int] = []  # statuses /tokenize answers first, one per call (serve() gives each its own)
    tokenize_calls = 0

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            data = {"object": "list", "data": [{"id": MODEL, "root": str(MODEL_DIR), "max_model_len": 1024}]}
            self._send(200, json.dumps(data).encode())
        elif self.path == "/fake/stats":
            with self.lock:
                self._send(200, json.dumps(self.counts).encode())
        elif self.path == "/metrics":
            time.sleep(self.metrics_delay)
            text = self.metrics_text if self.metrics_text is not None else recorded_metrics(STARTED)
            self._send(self.metrics_status, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length) or b"{}")
        if self.path in ("/tokenize", "/detokenize"):
            self._tokens(request)
            return
        if self.path != "/v1/completions":
            self._send(404, b'{"error": "not found"}')
            return
        if request.get("model") != MODEL:
            self._send(404, json.dumps({"error": {"message": f"model {request.get('model')} not found"}}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = int(request.get("max_tokens", 16))
        self._count("active", 1)
        outcome = "aborted"
        try:
            for i in range(n):
                time.sleep(self.delay)
                last = i == n - 1
                choice = {"index": 0, "text": WORDS[i % len(WORDS)], "token_ids": [100 + i % 50]}
                choice["finish_reason"] = "length" if last else None
                self._event({"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [choice]})
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
            self._event({"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            outcome = "finished"
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the stream (Stop): vLLM aborts the request here
        finally:
            self._count("active", -1)
            self._count(outcome, 1)
        self.close_connection = True

    def _tokens(self, request: dict) -> None:
        if self.path == "/detokenize":
            self._send(200, json.dumps({"prompt": "".join(map(chr, request["tokens"]))}).encode())
            return
        cls = type(self)
        with self.lock:
            cls.tokenize_calls += 1
            status = cls.tokenize_errors.pop(0) if cls.tokenize_errors else 200
        if status != 200:
            message = NO_TEMPLATE if status == 400 else f"fake error {status}"
            self._send(status, json.dumps({"error": {"message": message, "code": status}}).encode())
            return
        text = "".join(f"<{m['role']}>{m['content']}" for m in request["messages"]) + "<assistant>"
        self._send(200, json.dumps({"tokens": [ord(c) for c in text], "count": len(text)}).encode())

    def _count(self, name: str, delta: int) -> None:
        with self.lock:
            self.counts[name] += delta

    def _event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()


def recorded_metrics(started: float) -> str:
    """The recorded /metrics payload, as a server started at ``started`` would send it."""
    text = METRICS.read_text()
    return re.sub(r"^process_start_time_seconds .*$", f"process_start_time_seconds {started}", text, flags=re.M)


@contextlib.contextmanager
def serve() -> Iterator[tuple[str, type[Handler]]]:
    """A fake in this process, on a free port: ``(its URL, its own Handler subclass)``."""
    handler = type("FakeHandler", (Handler,), {"counts": dict(Handler.counts), "tokenize_errors": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per streamed token")
    args = parser.parse_args()
    Handler.delay = args.delay
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"fake vLLM on http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
