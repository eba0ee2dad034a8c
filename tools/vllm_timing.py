"""How long a vLLM-backed playground takes to come up, and how late its KV events are:
``python -m tools.vllm_timing --rounds 3``.

Each round, on loopback:

1. starts vLLM on the embedded model with ``scripts/serve_vllm.py --wait`` (its venv made on first use) and times
   it until ``/health`` answers;
2. starts ``app.py --vllm-url ...`` and times it until the page answers and ``gradio_client`` has read its API;
3. attaches a ``VllmBackend`` of its own, runs the "Shared system prompt" scenario (4 panels, 64 tokens, greedy)
   and reads its subscriber's lag: from a KV-event batch's time stamp on the server to that batch applied in the
   tracker. What the page map shows then waits for the backend's sampler (``SAMPLE_EVERY_S``) and the browser's
   next redraw of the map, both listed with the result;
4. stops the app and the server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from gradio_client import Client

from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.playground.backends.vllm.sampler import SAMPLE_EVERY_S
from astrai.playground.scenarios import SCENARIO_BY_NAME
from astrai.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def one_round(port: int, app_port: int, tmp: str) -> dict[str, float]:
    events, replay = f"ipc://{tmp}/timing-kv.sock", f"ipc://{tmp}/timing-kv-replay.sock"
    serve = [sys.executable, str(REPO / "scripts" / "serve_vllm.py"), "--port", str(port)]
    started = time.monotonic()
    subprocess.run([*serve, "--wait", "--timeout", "900", "--kv-events", events, "--kv-replay", replay], check=True)
    server_s = time.monotonic() - started
    url = f"http://127.0.0.1:{port}"
    app = None
    try:
        started = time.monotonic()
        env = dict(os.environ, GRADIO_SERVER_PORT=str(app_port), GRADIO_ANALYTICS_ENABLED="False")
        app = subprocess.Popen(
            [sys.executable, str(REPO / "app.py"), "--vllm-url", url, "--kv-events", events, "--kv-replay", replay],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        wait_http(f"http://127.0.0.1:{app_port}/", 300)
        Client(f"http://127.0.0.1:{app_port}/", verbose=False)
        app_s = time.monotonic() - started

        backend = VllmBackend(url, events, replay)
        try:
            scenario = SCENARIO_BY_NAME["Shared system prompt"]
            prompts = [backend.format_prompt(scenario.prefix, p) for p in scenario.prompts]
            for _ in backend.submit(prompts, SamplingParams(max_tokens=64), salt=None):
                pass
            time.sleep(1.0)  # the last batches of the run
            lag = backend.subscriber_status()["lag_ms"]
        finally:
            backend.shutdown()
    finally:
        if app is not None:
            app.terminate()
            app.wait(30)
        subprocess.run([*serve, "--stop"], check=False)
    return {"server_s": server_s, "app_s": app_s, "lag_median_ms": lag["median"], "lag_max_ms": lag["max"]}


def spread(values: list[float], fmt: str) -> str:
    return " / ".join(f"{v:{fmt}}" for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--app-port", type=int, default=7871)
    args = parser.parse_args()
    tmp = tempfile.gettempdir()
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args.port, args.app_port, tmp))
        print(f"round {r + 1}: {rounds[-1]}", flush=True)
    print(
        "\n| server start to /health s | app start to UI ready s | event lag, median of batches ms | "
        "event lag, max ms |\n|---|---|---|---|"
    )
    print(
        " | ".join(
            [
                "",
                *(
                    spread([x[k] for x in rounds], f)
                    for k, f in (("server_s", ".1f"), ("app_s", ".1f"), ("lag_median_ms", ".1f"), ("lag_max_ms", ".1f"))
                ),
                "",
            ]
        ).strip()
    )
    print(
        f"\nmin / median / max of {len(rounds)} rounds. The page map then shows a batch within the backend's "
        f"sampling period ({SAMPLE_EVERY_S} s) plus the browser's next redraw of the map."
    )


if __name__ == "__main__":
    main()
