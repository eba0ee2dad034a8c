"""An idle OpenMP pool slows another thread's parallel ops: ``python -m benchmarks.openmp_pools [--rounds 3]``.

What ``astrai/openmp.py`` guards against, shown on one matmul of a decode step's shape (8 rows by a 1536x576
weight). Each round times it on the main thread, then on a fresh thread while the main thread's pool of OpenMP
workers sits idle, then on another fresh thread after the main thread released its pool (``release_pool``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from astrai.openmp import release_pool
from benchmarks.host_cpu import cpu_name


def median_us(calls: int = 500) -> float:
    weight, rows = torch.randn(1536, 576), torch.randn(8, 576)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        torch.nn.functional.linear(rows, weight)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def on_a_new_thread() -> float:
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(median_us()))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, median of 500 calls, µs\n")
    print("| round | main thread | another thread, main's pool idle | another thread, main's pool released |")
    print("|---|---|---|---|")
    for r in range(args.rounds):
        main_thread = median_us()
        beside_idle_pool = on_a_new_thread()
        release_pool()
        after_release = on_a_new_thread()
        print(f"| {r + 1} | {main_thread:.0f} | {beside_idle_pool:.0f} | {after_release:.0f} |", flush=True)


if __name__ == "__main__":
    main()
