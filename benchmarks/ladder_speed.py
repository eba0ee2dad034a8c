"""How fast the hit-rate ladder is: ``python -m benchmarks.ladder_speed [--rounds 3] [--processes 2] [--semantics S]``.

Times, over ``--rounds`` rounds (min / median / max), in this process:

* the Mooncake conversation trace (12,031 requests, 512-token blocks): read the file and compute its ladder under
  LRU at 5,859 cached blocks, as ``python -m astrai.lab ladder`` does;
* an engine's history of 10,000 requests (a class's lesson traffic, made up here with a fixed seed: a shared system
  prompt, nine step prompts, each student's own words, follow-up turns that resend a conversation; pages of 16
  tokens): the trace made from its ``RequestInfo``s (``record.from_requests``), then its ladder at 2,048 pages
  (the playground's default engine) with a ``delivered`` rung (made-up requests report 0 cached tokens: a sum,
  timed all the same); and that ladder alone, from the trace.

Then both Mooncake traces' ladders at 1,000, 5,859 and 20,000 blocks (the table in README's lab section), under
``--semantics`` (the replay's rules, ``astrai.lab.replay.SEMANTICS``; the first by default).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astrai.lab.ladder import Ladder, ladder
from astrai.lab.record import from_requests
from astrai.lab.replay import SEMANTICS
from astrai.lab.trace import read_trace
from astrai.observation import RequestInfo
from benchmarks.host_cpu import cpu_name

TRACES = Path(__file__).parents[1] / "assets" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"
SYNTHETIC = TRACES / "synthetic_trace.jsonl"
HISTORY_REQUESTS, HISTORY_PAGE, HISTORY_PAGES = 10_000, 16, 2048


def timed(rounds: int, work: Callable[[], object]) -> str:
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return f"{min(seconds):.2f} / {statistics.median(seconds):.2f} / {max(seconds):.2f} s"


def class_history(requests: int = HISTORY_REQUESTS, seed: int = 0) -> list[RequestInfo]:
    """A made-up engine history: what a class of 30 sends through a 9-step lesson, over and over."""
    rng = random.Random(seed)
    words = lambda n: tuple(rng.randrange(32_000) for _ in range(n))  # noqa: E731 - a token generator
    system = words(64)
    steps = [words(rng.randint(40, 300)) for _ in range(9)]
    infos: list[RequestInfo] = []
    for i in range(requests):
        if infos and rng.random() < 0.2:  # a follow-up: an earlier prompt resent, and a new question
            prompt = infos[rng.randrange(max(0, len(infos) - 60), len(infos))].prompt_ids + words(rng.randint(5, 60))
        else:
            prompt = (system if rng.random() < 0.7 else ()) + rng.choice(steps) + words(rng.randint(0, 200))
        info = RequestInfo(i, "finished", len(prompt), 0, 1, 0, prompt, (1,), None, None, None)
        infos.append(info)
    return infos


def history_ladder(infos: list[RequestInfo], options: dict[str, Any]) -> Ladder:
    trace = from_requests(infos, HISTORY_PAGE, "class history")
    return ladder(trace, HISTORY_PAGES, "lru", delivered=[info.cached_tokens or 0 for info in infos], **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--semantics", choices=SEMANTICS, default=SEMANTICS[0], help="the replay's rules")
    args = parser.parse_args()
    options = {"processes": args.processes, "semantics": args.semantics}
    print(cpu_name())
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    rules = args.semantics
    print(f"min / median / max of {args.rounds} rounds, {args.processes} processes, {rules} rules; load average {load}")
    conversation = lambda: ladder(read_trace(CONVERSATION), 5859, "lru", **options)  # noqa: E731
    print(f"  conversation trace: read + ladder, lru at 5,859 blocks  {timed(args.rounds, conversation)}")
    infos = class_history()
    history = lambda: history_ladder(infos, options)  # noqa: E731
    print(f"  engine history, 10,000 requests: trace + ladder, lru at 2,048 pages  {timed(args.rounds, history)}")
    trace = from_requests(infos, HISTORY_PAGE, "class history")
    delivered = [info.cached_tokens or 0 for info in infos]
    alone = lambda: ladder(trace, HISTORY_PAGES, "lru", delivered=delivered, **options)  # noqa: E731
    print(f"  engine history, 10,000 requests: the ladder of its trace alone       {timed(args.rounds, alone)}")
    for path in (CONVERSATION, SYNTHETIC):
        trace = read_trace(path)
        for capacity in (1000, 5859, 20_000):
            result = ladder(trace, capacity, "lru", **options)
            rungs = " / ".join(f"{r.name} {r.share:.2%}" for r in result.rungs)
            print(f"  {trace.name} at {capacity:,}: {rungs}")


if __name__ == "__main__":
    main()
