"""Why is my hit rate low? The hit-rate ladder of a trace: from every prompt token down to what the policy serves
at the capacity, each gap between two rungs split into causes (tokens).

``python -m astrai.lab ladder TRACE --capacity C [--policy lru] [--tier2 C2 [--write through|on_evict]] [--json]
[--csv FILE] [--html FILE] [--block-size B] [--semantics S] [--processes N]`` (``ladder.py`` computes it; with
``--tier2``, C is tier 1's pages and the ladder gets the tier's rung). This module also holds the checks
the curves' command (``__main__.py``) shares: bad input ends in one line on stderr and exit status 2, never a
traceback.

Text: the rungs top to bottom, each gap between them with its causes. ``--json``: ``Ladder.to_dict()``.
``--csv FILE`` / ``--html FILE``: the same ladder as CSV, and as a self-contained HTML report (``report.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from astrai.eviction import POLICIES
from astrai.lab.ladder import Ladder, LadderError, ladder
from astrai.lab.replay import SEMANTICS
from astrai.lab.report import gap_summary, ladder_csv, ladder_html
from astrai.lab.trace import Trace, read_trace
from astrai.tier import WRITE_POLICIES


def integer_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (``_`` separators allowed), else argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def add_block_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--block-size",
        type=integer_at_least(1),
        default=None,
        metavar="B",
        help="tokens per block of a trace that does not say (Mooncake's format; default 512)",
    )


def read_or_exit(parser: argparse.ArgumentParser, path: str, block_size: int | None) -> Trace:
    """``read_trace``, or the parser's one-line error (exit status 2) naming the file and what is wrong with it."""
    try:
        return read_trace(path, block_size)
    except OSError as error:
        parser.error(f"{path}: {error.strerror or error}")
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.lab ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", metavar="TRACE", help="a trace file (Mooncake's JSON lines)")
    parser.add_argument("--capacity", type=integer_at_least(0), required=True, help="in pages (see --semantics)")
    parser.add_argument("--policy", choices=POLICIES, default="lru", help="the online policy replayed (default lru)")
    parser.add_argument(
        "--tier2",
        type=integer_at_least(0),
        default=None,
        metavar="C2",
        help="a second tier of C2 blocks (LRU) behind the pool: adds its rung (default: none)",
    )
    parser.add_argument(
        "--write", choices=WRITE_POLICIES, default=None, help="tier 2's write policy, with --tier2 (default through)"
    )
    add_block_size(parser)
    parser.add_argument(
        "--semantics",
        choices=SEMANTICS,
        default=SEMANTICS[0],
        help="a capacity is an engine's pool of that many pages (engine), or that many cached blocks (trace)",
    )
    parser.add_argument(
        "--processes", type=integer_at_least(1), default=None, help="replays in parallel (default: the CPUs)"
    )
    parser.add_argument("--json", action="store_true", help="print the ladder as JSON")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="also write it as CSV")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write a self-contained HTML report")
    args = parser.parse_args(argv)
    if args.write is not None and args.tier2 is None:
        parser.error("--write is tier 2's write policy: give --tier2, its blocks")
    trace = read_or_exit(parser, args.trace, args.block_size)
    try:
        result = ladder(
            trace,
            args.capacity,
            args.policy,
            semantics=args.semantics,
            processes=args.processes,
            tier2=args.tier2,
            write=args.write,
        )
    except LadderError as error:
        parser.error(str(error))
    try:
        if args.csv is not None:
            args.csv.write_text(ladder_csv(result), encoding="utf-8")
        if args.html is not None:
            args.html.write_text(ladder_html(result), encoding="utf-8")
    except OSError as error:
        parser.error(f"{error.filename}: {error.strerror or error}")
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(ladder_text(result))
    return 0


def ladder_text(result: Ladder) -> str:
    """The rungs, each followed by the gap to the next one and its causes."""
    lines = [f"{result.trace}: {result.requests:,} requests, {result.block_size} tokens a page, {result.setting}"]
    gaps = {g.above: g for g in result.gaps}
    width = max(14, *(len(r.name) + 2 for r in result.rungs))
    for rung in result.rungs:
        lines.append(f"  {rung.name:<{width}}{rung.tokens:>15,}  {rung.share:>7.2%}")
        if rung.name in gaps:
            lines.append(f"      - {gap_summary(gaps[rung.name])}")
    return "\n".join(lines)
