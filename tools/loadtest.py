"""Load test of the playground: ``python -m tools.loadtest --clients 16 --rounds 3``.

Starts app.py on loopback (or uses ``--url``), then runs concurrent gradio_client users, each sending 4-panel
batches for several rounds and cancelling some mid-stream. It reports completed / errors / cancelled counts,
p50/p95 time to first token and total time, how a full queue answers, and the engine's used pages afterwards.
Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app.py"
PROMPTS = [
    "One day, he found a",
    "One day, his cat",
    "One day, a big storm",
    "One day, a little girl named Lily",
    "The dog ran to",
    "Mia wanted a",
    "The sun was",
    "Ben and Sam",
]
PREFIX = "Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. "


@contextlib.contextmanager
def launch_app(
    extra_env: dict[str, str] | None = None,
    log_path: Path | None = None,
    app: Path = APP,
    args: list[str] | None = None,
) -> Iterator[str]:
    """Serve ``app`` (this checkout's app.py by default) on a free loopback port for the duration of the block;
    yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        # the app's backend comes from ``args`` only: a test run's ASTRAI_VLLM_* (set by .ci/run for the vllm tests)
        # must not turn the embedded-engine apps into vLLM ones
        **{name: value for name, value in os.environ.items() if not name.startswith("ASTRAI_VLLM_")},
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed below, after the server
    command = [sys.executable, str(app), *(args or [])]
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=app.parent)
    url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + 120
    try:
        while True:
            try:
                urllib.request.urlopen(url + "config", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"app.py exited with {proc.returncode}; see {log_path}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("app.py did not start within 120 s") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_args(panels: list[str], max_tokens: int, prefix: str = PREFIX) -> dict:
    """Keyword arguments of the /run endpoint for these panel prompts, greedy."""
    prompts = panels + [""] * (6 - len(panels))
    return dict(
        n_panels=len(panels),
        shared_prefix=prefix,
        **{f"prompt_{i + 1}": p for i, p in enumerate(prompts)},
        max_tokens=max_tokens,
        temperature=0,
        top_p=1,
        top_k=0,
        seed=0,
        isolate_cache=False,
    )


@dataclass
class LoadReport:
    outcomes: Counter = field(default_factory=Counter)  # completed / cancelled / busy / error
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    busy_answer_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    used_pages_after: int = -1
    seconds: float = 0.0
    tokens_per_s: float | None = None  # tokens the engine generated during the load, over its wall time

    def summary(self) -> dict:
        def pct(values: list[float], q: float) -> float | None:
            return round(statistics.quantiles(values, n=100)[q - 1], 3) if len(values) >= 2 else None

        return dict(
            outcomes=dict(self.outcomes),
            ttft_p50=pct(self.ttft, 50),
            ttft_p95=pct(self.ttft, 95),
            total_p50=pct(self.total, 50),
            total_p95=pct(self.total, 95),
            busy_answers=len(self.busy_answer_s),
            busy_answer_max_s=max(self.busy_answer_s, default=None),
            errors=self.errors[:5],
            used_pages_after=self.used_pages_after,
            seconds=round(self.seconds, 1),
            tokens_per_s=None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
        )


def run_load(
    url: str,
    clients: int = 16,
    rounds: int = 3,
    max_tokens: int = 48,
    cancel_rate: float = 0.25,
    seed: int = 0,
    job_timeout: float = 180.0,
) -> LoadReport:
    from gradio_client import Client

    report = LoadReport()
    lock = threading.Lock()
    # gradio_client opens an httpx client per request, and httpx builds a fresh TLS context (loading certifi's CA
    # bundle) for each one unless it is given one: py-spy put 61% of this generator's CPU there, and the generator
    # shares the server's two cores. One context, verification unchanged, for every request (``ssl_verify`` goes
    # to httpx's ``verify`` as it is, and httpx takes a context there).
    tls = ssl.create_default_context()

    def user(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        client = Client(url, verbose=False, ssl_verify=tls)
        for _ in range(rounds):
            args = run_args(rng.sample(PROMPTS, 4), max_tokens)
            outcome, ttft, total, error = one_run(client, args, rng.random() < cancel_rate, job_timeout)
            with lock:
                report.outcomes[outcome] += 1
                if ttft is not None:
                    report.ttft.append(ttft)
                if outcome == "completed":
                    report.total.append(total)
                if outcome == "busy":
                    report.busy_answer_s.append(total)
                if error and outcome == "error":
                    report.errors.append(error)

    stats_client = Client(url, verbose=False, ssl_verify=tls)
    generated_before = stats_client.predict(api_name="/cache_stats").get("generated_tokens")  # None: older apps
    started = time.monotonic()
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=job_timeout * rounds + 60)
    report.outcomes["hung"] += sum(t.is_alive() for t in threads)
    report.seconds = time.monotonic() - started
    if generated_before is not None:
        generated = stats_client.predict(api_name="/cache_stats")["generated_tokens"] - generated_before
        report.tokens_per_s = generated / report.seconds
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # cancelled runs release their pages at the engine's next step
        report.used_pages_after = stats_client.predict(api_name="/cache_stats")["used_pages"]
        if report.used_pages_after == 0:
            break
        time.sleep(0.2)
    return report


def one_run(client, args: dict, cancel: bool, timeout: float) -> tuple[str, float | None, float, str | None]:
    """Returns (outcome, time to first text, total time, error message)."""
    started = time.monotonic()
    ttft = None
    try:
        job = client.submit(**args, api_name="/run")
        deadline = started + timeout
        while not job.done() and time.monotonic() < deadline:
            outputs = job.outputs()
            if ttft is None and outputs and any(outputs[-1][:4]):
                ttft = time.monotonic() - started
                if cancel:
                    job.cancel()
                    return "cancelled", ttft, time.monotonic() - started, None
            time.sleep(0.02)
        if not job.done():
            job.cancel()
            return "error", ttft, time.monotonic() - started, "timed out"
        job.result()
        if ttft is None and any(job.outputs()[-1][:4]):
            ttft = time.monotonic() - started
        return "completed", ttft, time.monotonic() - started, None
    except Exception as exc:
        message = str(exc)
        outcome = "busy" if "queue" in message.lower() and "full" in message.lower() else "error"
        return outcome, ttft, time.monotonic() - started, message[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running playground; by default app.py is started on loopback")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--queue-size", type=int, default=None, help="ASTRAI_QUEUE_SIZE for the started app")
    parser.add_argument("--max-batch", type=int, default=None, help="ASTRAI_MAX_BATCH_SIZE for the started app")
    parser.add_argument("--concurrency", type=int, default=None, help="ASTRAI_RUN_CONCURRENCY for the started app")
    parser.add_argument("--app", type=Path, default=APP, help="the app.py to start (another checkout's, say)")
    args = parser.parse_args()
    knobs = {
        "ASTRAI_QUEUE_SIZE": args.queue_size,
        "ASTRAI_MAX_BATCH_SIZE": args.max_batch,
        "ASTRAI_RUN_CONCURRENCY": args.concurrency,
    }
    env = {name: str(value) for name, value in knobs.items() if value is not None}
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(launch_app(env, app=args.app))
        report = run_load(url, args.clients, args.rounds, args.max_tokens)
    for key, value in report.summary().items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
