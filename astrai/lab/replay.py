"""Trace replay through the real ``PagePool`` and ``KVCacheManager``: hit rate against cache capacity, no model.

How a trace drives the engine's cache code (the code paths are the engine's; only the forward is left out):

* **A block is a page of one token, and its token is its hash id.** The pool has ``page_size`` 1 and a request's
  "tokens" are its ``hash_ids``, so the manager's chained keys (``page_key(parent, [hash id])``) and its token check
  on lookup work unchanged, and the manager's cap of a hit at ``len(tokens) - 1`` pages is exactly the trace's
  ``(input_length - 1) // block_size`` blocks (there are ``ceil(input_length / block_size)`` ids). An id therefore
  stands for its chain: equal ids after different prefixes are different blocks, whether or not the trace's ids
  name their prefix as Mooncake's do.
* **Replay is sequential, in file order:** for each request the manager admits it (the longest cached leading run
  of its reusable blocks is acquired, a page is allocated for each other block, the partial last one included),
  its full blocks are computed (``num_computed`` = ``input_length // block_size``: a partial last block holds KV
  but is never full, so it is never registered, as in the engine), ``commit`` registers the new full blocks, and
  ``free`` releases every page tail-first: the reused and new full blocks become cached, the partial one goes free.
  A full block that is already cached past the reused run (its parent had been evicted: an orphan) is left as it
  is: the pool indexes one copy, and this request did not read it.
* **What a capacity means: the semantics.**

  - ``"engine"`` (the default): **capacity C is an engine's pool of C pages** (``InferenceEngine(n_pages=C)``)
    running the requests one at a time with ``max_tokens=1``. The pool has C pages; an allocation that finds no free
    page evicts the policy's victim then, while the request's own pages (its hits and the pages allocated before)
    are in use and cannot be evicted. A request whose prompt and the one token it samples need more than the whole
    pool (``input_length + 1 > C * block_size``) is refused, as the engine refuses it: it is served nothing and
    changes nothing (``refused`` counts them). A prompt is admitted whole, as by an engine whose token budget
    (``max_batched_tokens``) holds it: with chunked prefill, ARC, which adapts at registration, may pick other
    victims for the later chunks. ``tests/test_lab_engine.py`` runs request sequences through the engine and
    through this replay at several pool sizes and compares each request's hit.
  - ``"trace"``: **capacity C counts cached blocks after each request**, as Mooncake's Figure 9 does. A request is
    admitted from headroom for the trace's longest request (an allocation never evicts), all its full blocks are
    cached, and only then is the cache trimmed: while more than C pages are cached, ``PagePool.evict`` evicts the
    policy's victim, which may be a block this request just computed. README's lab table was made so.

  ``capacity=None`` never evicts, under either: the ceiling, what an unbounded cache would serve.
* **Memory follows the trace, not the capacity:** the pool never needs more pages than the trace's distinct blocks
  plus its longest request (cached pages hold distinct chain keys; the rest are the running request's), so it is
  given no more, whatever the capacity: a larger pool would only hold pages that stay free.
* **Hit rate** is token-weighted: reused blocks times ``block_size`` over all prompt tokens (refused requests'
  included). The manager's own counters are in blocks (its pages); every admission here is a first one.

For LRU a request's blocks become the most recently released, its head most recent of all (tail-first release),
so the tail goes first. Belady (``belady.py``) reads the future that ``Future`` precomputes, by chain key. Chain keys
are computed once per trace (with the manager's own ``page_key``) and handed to each request's key memo, so a curve
of many runs hashes each block once.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, TypeVar

from astrai.eviction import POLICIES, PolicyFactory
from astrai.kv_cache_manager import KVCacheManager
from astrai.lab.belady import Belady, Future
from astrai.lab.trace import Trace
from astrai.page_pool import PageKey, PagePool, page_key
from astrai.request import Request
from astrai.sampling import SamplingParams
from astrai.tier import SecondTier

REPLAY_POLICIES = (*POLICIES, Belady.name)  # every online policy, and the offline bound
Semantics = Literal["engine", "trace"]
SEMANTICS: tuple[Semantics, ...] = ("engine", "trace")  # what a capacity means (module docstring); first: default
CAPACITY_MEANING: dict[Semantics, str] = {
    "engine": "pages of an engine's pool (n_pages), in use or cached",
    "trace": "blocks cached after each request (pages in use not counted)",
}
_PARAMS = SamplingParams(max_tokens=1)  # a Request needs some; nothing is sampled
TierFactory = Callable[[], SecondTier]
Result = TypeVar("Result")


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int | None  # "engine": the pool's pages; "trace": cached blocks; None: unbounded (the ceiling)
    hit_rate: float  # hit tokens / prompt tokens
    hit_tokens: int
    query_tokens: int
    evictions: int
    orphans: int  # cached at the end with their parent block gone: no hit until the parent is computed again
    refused: int = 0  # "engine": requests a pool this small refuses (served nothing); "trace": always 0


class Replay:
    """One trace, prepared once (chain keys, Belady's future), replayed under any policy, capacity and semantics."""

    def __init__(self, trace: Trace) -> None:
        empty = next((i for i, r in enumerate(trace.requests) if r.input_length < 1), None)
        if empty is not None:  # read_trace refuses such a line; a Trace built in code may still hold one
            raise ValueError(f"request {empty} has no prompt tokens: a request to replay has at least one")
        self.trace = trace
        self.full = [trace.full_blocks(r) for r in trace.requests]
        self.headroom = max((len(r.hash_ids) for r in trace.requests), default=1)  # pages of the longest request
        self.keys: list[list[PageKey]] = []
        for request, full in zip(trace.requests, self.full, strict=True):
            keys: list[PageKey] = []
            for block in request.hash_ids[:full]:
                keys.append(page_key(keys[-1] if keys else None, [block]))
            self.keys.append(keys)
        self.distinct = len({key for keys in self.keys for key in keys})  # the most pages that can ever be cached
        self._futures: dict[tuple[int, ...], Future] = {}

    @cached_property
    def future(self) -> Future:
        """Belady's future when every request runs."""
        return Future(self.trace, self.keys)

    def future_without(self, refused: tuple[int, ...]) -> Future:
        """Belady's future when the ``refused`` requests do not run (a refused request reuses nothing)."""
        if not refused:
            return self.future
        if refused not in self._futures:
            self._futures[refused] = Future(self.trace, self.keys, frozenset(refused))
        return self._futures[refused]

    def prepare_belady(self, policies: Sequence[str], capacities: Sequence[int | None], semantics: Semantics) -> None:
        """Build Belady's futures for these runs now: before a fork, once, not once per worker."""
        if Belady.name in policies:
            for capacity in capacities:
                self.future_without(self.refused(capacity, semantics))

    def refused(self, capacity: int | None, semantics: Semantics = "engine") -> tuple[int, ...]:
        """The requests an engine with a pool of ``capacity`` pages refuses: their prompt and the one token they
        sample do not fit in it (``InferenceEngine`` refuses a prompt whose tokens and ``max_tokens`` need more KV
        than the whole pool holds). None are under ``"trace"`` semantics or without a bound."""
        if semantics == "trace" or capacity is None:
            return ()
        room = capacity * self.trace.block_size
        return tuple(i for i, r in enumerate(self.trace.requests) if r.input_length + 1 > room)

    def run(self, policy: str, capacity: int | None, semantics: Semantics = "engine") -> ReplayResult:
        """Replay the whole trace through a fresh pool (see the module docstring for the exact rules)."""
        hits, pool, refused = self.replay_hits(policy, capacity, semantics)
        hit_tokens = sum(hits)
        query_tokens = self.trace.input_tokens
        orphans = sum(pool.parent_key[p] is not None and pool.parent_key[p] not in pool.index for p in pool.policy)
        return ReplayResult(
            policy=policy,
            capacity=capacity,
            hit_rate=hit_tokens / query_tokens if query_tokens else 0.0,
            hit_tokens=hit_tokens,
            query_tokens=query_tokens,
            evictions=pool.stats.evictions,
            orphans=orphans,
            refused=refused,
        )

    def request_hits(self, policy: str, capacity: int | None, semantics: Semantics = "engine") -> list[int]:
        """The prompt tokens the cache served each request, in the trace's order (0 for a refused one)."""
        return self.replay_hits(policy, capacity, semantics)[0]

    def replay_hits(
        self, policy: str, capacity: int | None, semantics: Semantics, tier: TierFactory | None = None
    ) -> tuple[list[int], PagePool, int]:
        """Each request's hit tokens, the pool as the replay left it, and how many requests were refused. ``tier``:
        makes the second tier the manager continues its lookups into (``tiered.py``)."""
        if policy not in REPLAY_POLICIES:
            raise ValueError(f"policy must be one of {list(REPLAY_POLICIES)}, got {policy!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"capacity must be an integer >= 0 or None, got {capacity!r}")
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")
        refused = self.refused(capacity, semantics)
        belady: Belady | None = None
        eviction: str | PolicyFactory = policy
        if policy == Belady.name:
            future = self.future_without(refused)

            def eviction(n_pages: int) -> Belady:
                nonlocal belady
                belady = Belady(n_pages, future)
                return belady

        trim = semantics == "trace" and capacity is not None
        busiest = self.distinct + self.headroom  # cached pages hold distinct keys; the rest are the running request's
        if semantics == "trace":
            pages = (self.distinct if capacity is None else min(capacity, self.distinct)) + self.headroom
        else:  # at least one page: a pool of none refuses every request, and PagePool needs one
            pages = max(1, busiest if capacity is None else min(capacity, busiest))
        pool = PagePool(pages, 1, eviction=eviction)
        manager = KVCacheManager(pool, prefix_caching=True)
        if tier is not None:
            manager.attach_tier(tier())
        size, skip = self.trace.block_size, frozenset(refused)
        hits: list[int] = []
        for i, request in enumerate(self.trace.requests):
            if i in skip:
                hits.append(0)
                continue
            if belady is not None:
                belady.now = i
            req = Request(prompt_ids=list(request.hash_ids), params=_PARAMS, page_keys=list(self.keys[i]))
            if not manager.admit(req, len(req.prompt_ids)):
                raise AssertionError("a request that is not refused fits the pool")
            hits.append(req.num_computed * size)
            req.num_computed = self.full[i]
            manager.commit(req)
            manager.end_step()
            manager.free(req)
            if trim and capacity is not None:
                for _ in range(pool.cached_pages - capacity):
                    pool.evict()
        return hits, pool, len(refused)


def replay(trace: Trace, policy: str, capacity: int | None, semantics: Semantics = "engine") -> ReplayResult:
    return Replay(trace).run(policy, capacity, semantics)


_worker: tuple[Replay, Callable[..., Any]] | None = None  # a prepared trace and its run, inherited by workers (fork)


def _run_one(job: tuple[Any, ...]) -> Any:
    assert _worker is not None
    prepared, run = _worker
    return run(prepared, *job)


def in_parallel(
    prepared: Replay, run: Callable[..., Result], jobs: Sequence[tuple[Any, ...]], processes: int | None = None
) -> list[Result]:
    """``run(prepared, *job)`` for every job, in order. ``processes`` (default: the CPUs, at most the jobs) run them
    in parallel; the prepared trace reaches them by ``fork`` (where there is none, or with 1, they run here)."""
    processes = min(processes or os.cpu_count() or 1, len(jobs))
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [run(prepared, *job) for job in jobs]
    global _worker
    _worker = (prepared, run)
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return pool.map(_run_one, jobs, chunksize=1)
    finally:
        _worker = None


def curve(
    trace: Trace | Replay,
    policies: Sequence[str],
    capacities: Sequence[int | None],
    processes: int | None = None,
    semantics: Semantics = "engine",
) -> list[ReplayResult]:
    """Every policy at every capacity, policy-major, on ``processes`` (``in_parallel``)."""
    prepared = trace if isinstance(trace, Replay) else Replay(trace)
    jobs = [(policy, capacity, semantics) for policy in policies for capacity in capacities]
    prepared.prepare_belady(policies, capacities, semantics)
    return in_parallel(prepared, Replay.run, jobs, processes)
