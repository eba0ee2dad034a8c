"""Page-pool operations per second: the working tree's pool under each eviction policy against the pool of other
git revisions, the seed's first of all: ``python -m benchmarks.cache_ops [--pages 100000] [--rounds 3]
[--requests 20000] [--base ab15097 ...]``.

A revision's ``astrai/page_pool.py`` is read with ``git show`` and loaded as a module of its own at run time (never
kept as a copy). Every pool replays one workload, the same calls in the same order, through the API all of them
share (``allocate``, ``register(page, key, tokens, chain_pos)``, ``lookup``, ``acquire``, ``release``): requests
that each take a prefix of one of 4,000 chains of up to 64 pages (popular chains more often), look its pages up
until the first miss, acquire the hits, allocate and register the rest, and hold them while the next 63 requests
run; the chains hold more pages than the pool, so a full pool evicts all along. Keys and tokens are made before
the clock starts, so hashing is not timed. An operation is one page looked up, acquired, allocated, registered or
released; each round times every pool once, in turn, from a freshly filled pool, and the table gives each pool's
min / median / max over the rounds and its median against the first base's.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import subprocess
import sys
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

from astrai.eviction import POLICIES
from astrai.page_pool import PagePool, page_key
from benchmarks.host_cpu import cpu_name

SEED = "ab15097"  # the project's first commit
CHAINS, CHAIN_PAGES, WINDOW, PAGE_SIZE = 4000, 64, 64, 16

Request = tuple[list[bytes], list[tuple[int, ...]]]  # one prefix: its pages' keys and tokens


def pool_of(revision: str) -> type:
    """``PagePool`` as ``astrai/page_pool.py`` was at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:astrai/page_pool.py"], capture_output=True, check=True)
    module = types.ModuleType(f"page_pool_{revision}")
    module.__file__ = f"{revision}:astrai/page_pool.py"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source.stdout, module.__file__, "exec"), module.__dict__)
    return module.PagePool


def workload(requests: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    chains: list[Request] = []
    for c in range(CHAINS):
        keys: list[bytes] = []
        tokens = [tuple(rng.randrange(50_000) for _ in range(PAGE_SIZE)) for _ in range(CHAIN_PAGES)]
        for i in range(CHAIN_PAGES):
            keys.append(page_key(keys[-1] if keys else None, tokens[i], salt=str(c)))
        chains.append((keys, tokens))
    weights = [1 / (c + 1) for c in range(CHAINS)]  # Zipf: a few chains are most of the traffic
    picked = rng.choices(range(CHAINS), weights, k=requests)
    return [(chains[c][0][:n], chains[c][1][:n]) for c in picked for n in [rng.randint(1, CHAIN_PAGES)]]


def run(pool: Any, requests: list[Request]) -> int:
    """Replay the requests through the pool; returns the operations done."""
    ops = 0
    held: deque[list[int]] = deque()
    for keys, tokens in requests:
        pages: list[int] = []
        for key, toks in zip(keys, tokens, strict=True):
            ops += 1
            page = pool.lookup(key, toks)
            if page is None:
                break
            pool.acquire(page)
            pages.append(page)
        hits = len(pages)
        for i in range(hits, len(keys)):
            page = pool.allocate()
            pool.register(page, keys[i], tokens[i], i)
            pages.append(page)
        ops += hits + 2 * (len(keys) - hits)  # the acquires, the allocations and registrations
        held.append(pages)
        if len(held) > WINDOW:
            done = held.popleft()
            pool.release(done)
            ops += len(done)
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--base", nargs="*", default=[SEED], help="git revisions whose pool to compare (default: seed)")
    args = parser.parse_args()
    print(cpu_name())
    warm, timed = workload(args.requests, seed=1), workload(args.requests, seed=2)
    pools: dict[str, Callable[[], Any]] = {}
    for revision in args.base:
        pools[revision] = functools.partial(pool_of(revision), args.pages, PAGE_SIZE)
    for name in POLICIES:
        pools[f"tree {name}"] = functools.partial(PagePool, args.pages, PAGE_SIZE, eviction=name)
    rates: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.rounds):
        for name, make in pools.items():
            pool = make()
            run(pool, warm)  # a full pool, evicting
            started = time.perf_counter()
            ops = run(pool, timed)
            rates[name].append(ops / (time.perf_counter() - started))
    base = statistics.median(rates[args.base[0]]) if args.base else None
    print(f"{args.pages:,} pages, {args.requests:,} requests, {args.rounds} rounds: operations per second")
    for name, values in rates.items():
        low, mid, high = min(values), statistics.median(values), max(values)
        ratio = f"  {mid / base:.2f}x {args.base[0]}'s" if base else ""
        print(f"  {name:<16} {low / 1e6:6.2f} / {mid / 1e6:6.2f} / {high / 1e6:6.2f} M{ratio}")


if __name__ == "__main__":
    main()
