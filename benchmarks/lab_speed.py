"""How fast the lab replays a trace through the real pool: ``python -m benchmarks.lab_speed [TRACE] [--rounds 3]
[--capacity 5859] [--processes 2]``.

Times, over ``--rounds`` rounds (min / median / max): reading and preparing the trace (chain keys, Belady's future);
one replay of the whole trace per policy at one capacity, in this process; and a curve, every policy at the 10
capacities of ``python -m astrai.lab``'s default grid, over ``--processes`` worker processes. The trace defaults to
the Mooncake conversation trace (12,031 requests).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from astrai.lab.__main__ import log_capacities
from astrai.lab.replay import REPLAY_POLICIES, Replay, curve
from astrai.lab.trace import read_trace
from benchmarks.host_cpu import cpu_name

CONVERSATION = Path(__file__).parents[1] / "assets" / "traces" / "conversation_trace.jsonl"


def timed(rounds: int, work: Callable[..., object], *args: object) -> str:
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        work(*args)
        seconds.append(time.perf_counter() - started)
    return f"{min(seconds):.2f} / {statistics.median(seconds):.2f} / {max(seconds):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", default=str(CONVERSATION))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=5859)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    print(cpu_name())
    trace = read_trace(args.trace)
    print(f"{trace.name}: {len(trace.requests):,} requests; min / median / max of {args.rounds} rounds")
    print(f"  read + prepare                 {timed(args.rounds, lambda: Replay(read_trace(args.trace)).future)}")
    prepared = Replay(trace)
    prepared.future  # noqa: B018 - built once, outside the replays' times
    for policy in REPLAY_POLICIES:
        label = f"{policy} at {args.capacity:,} blocks"
        print(f"  {label:<30} {timed(args.rounds, prepared.run, policy, args.capacity)}")
    grid = log_capacities()
    label = f"curve, {len(REPLAY_POLICIES)} policies x {len(grid)} capacities, {args.processes} processes"
    print(f"  {label}: {timed(args.rounds, curve, prepared, REPLAY_POLICIES, grid, args.processes)}")


if __name__ == "__main__":
    main()
