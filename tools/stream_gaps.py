"""How smoothly vLLM servers stream, with the app out of the way:
``python -m tools.stream_gaps URL [URL ...] [--rounds 3] [--tokens 256]``.

One streamed completion per URL (a URL given twice gets two), all at once, sampled and run to ``--tokens`` tokens
(``ignore_eos``), as the playground's panels stream. Per stream: time to first chunk, the time from first to last
chunk, and the longest gap between two chunks. A panel cannot show more updates than its stream brings: a gap of
half a second in a stream of two is a panel standing still for a quarter of its run. This is how the launcher's
confinement of each replica to a core of its own was found and checked (``scripts/vllm_fleet.py``).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

MODEL = "tinystories-llama"  # scripts/serve_vllm.py's default served name


def stream(url: str, index: int, tokens: int) -> tuple[float, float, float]:
    """(time to first chunk, first to last chunk, longest gap between chunks), seconds."""
    body = {
        "model": MODEL,
        "prompt": f"Once upon a time, {index} little cats",
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals = []
    started = time.perf_counter()
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return arrivals[0] - started, arrivals[-1] - arrivals[0], max(gaps, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("urls", nargs="+", help="a vLLM server or router, e.g. http://127.0.0.1:8011")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    print("| round | stream | url | first chunk s | first to last s | longest gap ms |")
    print("|---|---|---|---|---|---|")
    n = len(args.urls)
    with ThreadPoolExecutor(max_workers=n) as pool:
        for round_ in range(1, args.rounds + 1):
            results = list(pool.map(stream, args.urls, range(n), [args.tokens] * n))
            for i, (url, (first, span, gap)) in enumerate(zip(args.urls, results, strict=True)):
                print(f"| {round_} | {i + 1} | {url} | {first:.2f} | {span:.2f} | {gap * 1000:.0f} |", flush=True)


if __name__ == "__main__":
    main()
