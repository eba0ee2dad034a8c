"""The playground's start as a Space makes it: ``python -m benchmarks.cold_start [--rounds 3] [--warm 1]``.

Each round starts ``python app.py`` in a fresh, empty HOME (so an empty compile cache, ``~/.cache/astrai``), as a
Space does after every sleep and push, and times from the process's spawn:

* ``page``: until ``GET /`` answers HTTP 200;
* ``first token``: until the first Run (2 panels, greedy, sent as soon as the page answers) streams its first text;
* ``compiled``: until the compiled forward serves (the app serves eager until then; its log says when).

It also times each Run from its submit to its first text (TTFT): the first Run, then Runs one after another while
the background compile goes on (their median), and one after the switch. The switch's moment is the app log's line
for it. ``--warm N`` then starts the app N more times in the last round's HOME (the cache filled). Printed: min /
median / max per figure, as a Markdown table, with the CPU and the load average. ``--app OTHER/app.py`` starts
another checkout's app (a version before this one, say: ``git archive COMMIT | tar -x -C DIR``); one whose stats
line does not say which forward serves compiled before its page answered, and is timed so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.host_cpu import cpu_name
from tools.loadtest import run_args

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600.0
FIGURES = {
    "page_s": "spawn to page (HTTP 200) s",
    "first_token_s": "spawn to first Run's first token s",
    "compiled_s": "spawn to compiled forward s",
    "ttft_first_s": "first Run's TTFT s",
    "ttft_compiling_s": "later Runs' TTFT while compiling s (median)",
    "ttft_compiled_s": "Run TTFT compiled s",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(predicate, proc: subprocess.Popen, what: str) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    return time.monotonic()


def _page_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _first_text(client, panels: list[str]) -> float:
    """Submit a Run; the monotonic time at which its first panel text arrives (the Run is then read to its end)."""
    job = client.submit(**run_args(panels, 32), api_name="/run")
    first = None
    for output in job:
        if first is None and any(isinstance(o, str) and o.strip() for o in output[: len(panels)]):
            first = time.monotonic()
    if first is None:
        raise RuntimeError(f"the Run streamed no text: {job.outputs()[-1:]}")
    return first


def _forward(client) -> str | None:
    """What the stats line says serves; None where it does not say (a version that compiled before serving)."""
    outputs = client.predict(api_name="/refresh")
    line = next(o for o in outputs if isinstance(o, str) and "pages ×" in o)
    return line.rsplit("forward: ", 1)[-1] if "forward: " in line else None


def _switched_at(log: Path) -> float:
    """The wall-clock time of the app log's line that says the compiled forward serves (``model_runner``)."""
    for line in log.read_text().splitlines():
        if "the model serves compiled" in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise RuntimeError(f"{log} does not say when the compiled forward began to serve")


def start(home: Path, log: Path, app: Path) -> dict[str, float | None]:
    """One start of app.py with ``home`` as its HOME; its figures in seconds from the spawn."""
    from gradio_client import Client

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME" and not k.startswith("ASTRAI_VLLM_")}
    env |= {"HOME": str(home), "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    env |= {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    url = f"http://127.0.0.1:{port}/"
    with log.open("w") as out:
        spawned, spawned_wall = time.monotonic(), time.time()
        proc = subprocess.Popen(
            [sys.executable, app.name], cwd=app.parent, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            page = _until(lambda: _page_answers(url), proc, "page")
            client = Client(url, verbose=False)
            submitted = time.monotonic()
            first = _first_text(client, ["Once upon a time", "The little dog"])
            during = []  # TTFTs of Runs sent while the app still serves eager
            said = _forward(client)
            while said not in (None, "**compiled**"):
                if proc.poll() is not None or time.monotonic() - spawned > TIMEOUT_S:
                    raise RuntimeError("the app exited, or never served the compiled forward")
                sent = time.monotonic()
                text = _first_text(client, [f"Lily went to the park {len(during)}", f"The cat sat {len(during)}"])
                during.append(text - sent)
                said = _forward(client)
            submitted_after = time.monotonic()
            after = _first_text(client, ["Lily went to the park", "The cat sat"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "page_s": page - spawned,
        "first_token_s": first - spawned,
        "compiled_s": page - spawned if said is None else _switched_at(log) - spawned_wall,
        "ttft_first_s": first - submitted,
        "ttft_compiling_s": statistics.median(during) if during else None,
        "ttft_compiled_s": after - submitted_after,
    }


def _cells(runs: list[dict]) -> str:
    cells = []
    for figure in FIGURES:
        values = [run[figure] for run in runs if run[figure] is not None]
        if not values:
            cells.append("n/a")
        elif len(values) == 1:
            cells.append(f"{values[0]:.1f}")
        else:
            cells.append(f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="cold starts, each in a fresh HOME")
    parser.add_argument("--warm", type=int, default=1, help="warm starts after them, in the last round's HOME")
    parser.add_argument("--app", type=Path, default=ROOT / "app.py", help="the app.py to start (another checkout's)")
    parser.add_argument("--logs", type=Path, default=None, help="keep each start's app log in this folder")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="astrai-cold-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    home = None
    try:
        for round_ in range(args.rounds):
            if home is not None:
                shutil.rmtree(home, ignore_errors=True)
            home = Path(tempfile.mkdtemp(prefix="astrai-home-"))
            result = start(home, logs / f"cold-{round_ + 1}.log", args.app.resolve())
            results["cold"].append(result)
            print(f"cold {round_ + 1}: {result}", file=sys.stderr, flush=True)
        for round_ in range(args.warm if home is not None else 0):
            assert home is not None
            result = start(home, logs / f"warm-{round_ + 1}.log", args.app.resolve())
            results["warm"].append(result)
            print(f"warm {round_ + 1}: {result}", file=sys.stderr, flush=True)
    finally:
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.app}\nCPU: {cpu_name()}; load average at the end (1/5/15 min): {load}; app logs in {logs}")
    print("min / median / max (one figure where one start)\n")
    print("| start | starts | " + " | ".join(FIGURES.values()) + " |")
    print("|---" * (2 + len(FIGURES)) + "|")
    for kind, runs in results.items():
        if runs:
            print(f"| {kind} | {len(runs)} | {_cells(runs)} |")


if __name__ == "__main__":
    main()
