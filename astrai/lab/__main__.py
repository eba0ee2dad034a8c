"""``python -m astrai.lab TRACE [TRACE ...] [--capacity LIST] [--policy LIST] [--block-size B] [--json]``: hit rate
against capacity. ``python -m astrai.lab ladder TRACE --capacity C ...``: the hit-rate ladder (``cli.py``).

Replays each trace through the real page pool (``replay.py``) under every policy at every capacity (``--semantics``:
pages of an engine's pool, the default, or ``trace``: cached blocks after each request), plus once without a bound:
the ceiling. Text: a table of token hit rates per policy and capacity, and one of the orphans left at the end
(cached blocks whose parent is gone). ``--json``: one object per trace with its ``semantics``, its ``ceiling`` and
``rows`` of ``policy``, ``capacity``, ``hit_rate``, ``hit_tokens``, ``evictions``, ``orphans``, ``refused``.

The curves shipped for the playground are made by::

    python -m astrai.lab assets/traces/conversation_trace.jsonl assets/traces/synthetic_trace.jsonl --json \\
        > assets/traces/curves.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from astrai.lab import cli
from astrai.lab.replay import CAPACITY_MEANING, REPLAY_POLICIES, SEMANTICS, Replay, ReplayResult, curve


def log_capacities(low: int = 1000, high: int = 50_000, points: int = 10) -> list[int]:
    """``points`` capacities from ``low`` to ``high``, evenly spaced on a log scale, rounded to whole blocks."""
    return [round(low * (high / low) ** (k / (points - 1))) for k in range(points)]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from error
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("capacities are blocks, >= 0")
    return values


def _policy_list(text: str) -> list[str]:
    policies = text.split(",")
    unknown = [p for p in policies if p not in REPLAY_POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown[0]!r}; choose from {','.join(REPLAY_POLICIES)}")
    return policies


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["ladder"]:
        return cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m astrai.lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (Mooncake's JSON lines)")
    parser.add_argument(
        "--capacity",
        type=_int_list,
        default=log_capacities(),
        help="capacities (see --semantics), comma-separated (default: 10 on a log scale from 1,000 to 50,000)",
    )
    parser.add_argument("--policy", type=_policy_list, default=list(REPLAY_POLICIES), help="comma-separated")
    parser.add_argument(
        "--semantics",
        choices=SEMANTICS,
        default=SEMANTICS[0],
        help="a capacity is an engine's pool of that many pages (engine), or that many cached blocks (trace)",
    )
    cli.add_block_size(parser)
    parser.add_argument(
        "--processes", type=cli.integer_at_least(1), default=None, help="replays in parallel (default: the CPUs)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    traces = [cli.read_or_exit(parser, path, args.block_size) for path in args.traces]  # all checked before any runs
    report = []
    for trace in traces:
        started = time.perf_counter()
        prepared = Replay(trace)
        ceiling = prepared.run("lru", None)  # no eviction: every policy serves the same
        rows = curve(prepared, args.policy, args.capacity, args.processes, args.semantics)
        seconds = time.perf_counter() - started
        if args.json:
            report.append({"semantics": args.semantics} | _trace_json(prepared, ceiling, rows))
        else:
            print(f"capacity: {CAPACITY_MEANING[args.semantics]}")
            _print_tables(prepared, ceiling, rows, args.capacity, seconds)
    if args.json:
        json.dump({"traces": report}, sys.stdout, indent=1)
        print()
    return 0


def _trace_json(prepared: Replay, ceiling: ReplayResult, rows: list[ReplayResult]) -> dict[str, object]:
    trace = prepared.trace
    return {
        "trace": trace.name,
        "requests": len(trace.requests),
        "block_size": trace.block_size,
        "input_tokens": trace.input_tokens,
        "ceiling": {"hit_rate": ceiling.hit_rate, "hit_tokens": ceiling.hit_tokens},
        "rows": [{k: v for k, v in dataclasses.asdict(r).items() if k != "query_tokens"} for r in rows],
    }


def _print_tables(
    prepared: Replay, ceiling: ReplayResult, rows: list[ReplayResult], capacities: list[int], seconds: float
) -> None:
    trace = prepared.trace
    print(
        f"{trace.name}: {len(trace.requests):,} requests, {trace.input_tokens:,} prompt tokens, "
        f"{trace.block_size} tokens a block; ceiling (no eviction) {ceiling.hit_rate:.2%}; {seconds:.1f} s"
    )
    by = {(r.policy, r.capacity): r for r in rows}
    policies = list(dict.fromkeys(r.policy for r in rows))
    for title, cell in (("token hit rate", lambda r: f"{r.hit_rate:.2%}"), ("orphans", lambda r: f"{r.orphans:,}")):
        print(f"  {title:<14}" + "".join(f"{c:>10,}" for c in capacities))
        for policy in policies:
            print(f"  {policy:<14}" + "".join(f"{cell(by[policy, c]):>10}" for c in capacities))
    print()


if __name__ == "__main__":
    sys.exit(main())
