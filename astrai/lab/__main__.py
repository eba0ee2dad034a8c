"""``python -m astrai.lab TRACE [TRACE ...] [--capacity LIST] [--policy LIST] [--block-size B] [--json]``: hit rate
against capacity. ``python -m astrai.lab ladder TRACE --capacity C ...``: the hit-rate ladder (``cli.py``).
``python -m astrai.lab TRACE --capacity C1 --tier2 C2 --write through|on_evict [--json]``: tiered replay
(``tiered.py``; ``--capacity``, ``--tier2`` and ``--write`` each take a comma-separated list; every combination runs).

Replays each trace through the real page pool (``replay.py``) under every policy at every capacity (``--semantics``:
pages of an engine's pool, the default, or ``trace``: cached blocks after each request), plus once without a bound:
the ceiling. Text: a table of token hit rates per policy and capacity, and one of the orphans left at the end
(cached blocks whose parent is gone). ``--json``: one object per trace with its ``semantics``, its ``ceiling`` and
``rows`` of ``policy``, ``capacity``, ``hit_rate``, ``hit_tokens``, ``evictions``, ``orphans``, ``refused``.
With ``--tier2``, the rows are ``TieredResult``'s fields, ``hit_rate`` and ``ttft_saved_s`` (``--load-ms``,
``--prefill-ms`` per ``--page-tokens`` page: the engine's measured costs, ``tiered.py`` says whose by default).

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
from astrai.lab.replay import CAPACITY_MEANING, REPLAY_POLICIES, SEMANTICS, Replay, ReplayResult, curve, in_parallel
from astrai.lab.tiered import (
    LOAD_MS_PER_PAGE,
    MEASURED_MODEL,
    PAGE_TOKENS,
    PREFILL_MS_PER_PAGE,
    TieredResult,
    run_tiered,
    ttft_saved_seconds,
)
from astrai.lab.trace import Trace
from astrai.tier import WRITE_POLICIES


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


def _write_list(text: str) -> list[str]:
    writes = text.split(",")
    unknown = [w for w in writes if w not in WRITE_POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown write policy {unknown[0]!r}; choose from {','.join(WRITE_POLICIES)}")
    return writes


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from error
    if not value >= 0:
        raise argparse.ArgumentTypeError("milliseconds are >= 0")
    return value


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
    parser.add_argument(
        "--policy", type=_policy_list, default=None, help="comma-separated (default: all; with --tier2, lru)"
    )
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
    tiered = parser.add_argument_group("tiered replay", f"costs default to {MEASURED_MODEL}")
    tiered.add_argument("--tier2", type=_int_list, default=None, help="tier 2's blocks (LRU), comma-separated")
    tiered.add_argument("--write", type=_write_list, help="through (the default), on_evict or both")
    tiered.add_argument(
        "--load-ms",
        type=_milliseconds,
        help=f"ms to load a page from tier 2 (default {LOAD_MS_PER_PAGE})",
    )
    tiered.add_argument(
        "--prefill-ms",
        type=_milliseconds,
        help=f"ms to recompute a page (default {PREFILL_MS_PER_PAGE})",
    )
    tiered.add_argument(
        "--page-tokens",
        type=cli.integer_at_least(1),
        help=f"tokens in the page those costs are for (default {PAGE_TOKENS})",
    )
    args = parser.parse_args(argv)
    tiered_only = ("write", "load_ms", "prefill_ms", "page_tokens")
    if args.tier2 is None and any(getattr(args, name) is not None for name in tiered_only):
        parser.error("--write, --load-ms, --prefill-ms and --page-tokens are for a tiered replay: give --tier2")
    traces = [cli.read_or_exit(parser, path, args.block_size) for path in args.traces]  # all checked before any runs
    if args.tier2 is not None:
        return _tiered(args, traces)
    args.policy = args.policy or list(REPLAY_POLICIES)
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


def _tiered(args: argparse.Namespace, traces: list[Trace]) -> int:
    """Every tier-1 policy, capacity, tier-2 size and write policy on each trace: a table, or JSON rows."""
    args.write = args.write or ["through"]
    args.load_ms = LOAD_MS_PER_PAGE if args.load_ms is None else args.load_ms
    args.prefill_ms = PREFILL_MS_PER_PAGE if args.prefill_ms is None else args.prefill_ms
    args.page_tokens = args.page_tokens or PAGE_TOKENS
    report = []
    for trace in traces:
        prepared = Replay(trace)
        policies = args.policy or ["lru"]
        jobs = [
            (p, c, t, w, args.semantics)
            for p in policies
            for c in args.capacity
            for t in args.tier2
            for w in args.write
        ]
        prepared.prepare_belady(policies, args.capacity, args.semantics)
        rows = in_parallel(prepared, run_tiered, jobs, args.processes)
        saved = [ttft_saved_seconds(r, args.load_ms, args.prefill_ms, args.page_tokens) for r in rows]
        if args.json:
            table = [
                dataclasses.asdict(r) | {"hit_rate": r.hit_rate, "ttft_saved_s": s}
                for r, s in zip(rows, saved, strict=True)
            ]
            report.append(
                {"trace": trace.name, "semantics": args.semantics, "requests": len(trace.requests), "rows": table}
            )
        else:
            _print_tiered(trace, rows, saved, args)
    if args.json:
        json.dump({"traces": report}, sys.stdout, indent=1)
        print()
    return 0


def _print_tiered(trace: Trace, rows: list[TieredResult], saved: list[float], args: argparse.Namespace) -> None:
    print(
        f"{trace.name}: {len(trace.requests):,} requests, {trace.input_tokens:,} prompt tokens; tier 1: "
        f"{CAPACITY_MEANING[args.semantics]}; tier 2: blocks under LRU; TTFT saved by tier 2's hits at "
        f"{args.load_ms:g} ms to load and {args.prefill_ms:g} ms to recompute a {args.page_tokens}-token page"
    )
    head = ("policy", "tier 1", "tier 2", "write", "hit rate", "tier-1 hits", "tier-2 hits", "written", "loaded")
    print("  " + "".join(f"{h:>12}" for h in head) + f"{'TTFT saved':>14}{'per request':>13}")
    for r, s in zip(rows, saved, strict=True):
        q = r.query_tokens or 1
        cells = [r.policy, f"{r.capacity:,}", f"{r.tier2:,}", r.write, f"{r.hit_rate:.2%}"]
        cells += [f"{r.tier1_hit_tokens / q:.2%}", f"{r.tier2_hit_tokens / q:.2%}", f"{r.blocks_written:,}"]
        cells.append(f"{r.blocks_loaded:,}")
        per = s / len(trace.requests) * 1000 if trace.requests else 0.0
        print("  " + "".join(f"{c:>12}" for c in cells) + f"{s:>12,.1f} s{per:>10,.0f} ms")
    print()


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
