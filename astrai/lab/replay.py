"""Trace replay through the real ``PagePool`` and ``KVCacheManager``: hit rate against cache capacity, no model.

How a trace drives the engine's cache code (the code paths are the engine's; only the forward is left out):

* **A block is a page of one token, and its token is its hash id.** The pool has ``page_size`` 1 and a request's
  "tokens" are its ``hash_ids``, so the manager's chained keys (``page_key(parent, [hash id])``) and its token check
  on lookup work unchanged, and the manager's cap of a hit at ``len(tokens) - 1`` pages is exactly the trace's
  ``(input_length - 1) // block_size`` blocks (there are ``ceil(input_length / block_size)`` ids).
* **Replay is sequential, in file order:** for each request the manager admits it (the longest cached leading run
  of its reusable blocks is acquired, a page is allocated for each other block, the partial last one included),
  its full blocks are computed (``num_computed`` = ``input_length // block_size``: a partial last block holds KV
  but is never full, so it is never registered, as in the engine), ``commit`` registers the new full blocks, and
  ``free`` releases every page tail-first: the reused and new full blocks become cached, the partial one goes free.
  Only then does the cache shrink: while more than ``capacity`` pages are cached, ``PagePool.evict`` evicts the
  policy's victim. A full block that is already cached past the reused run (its parent had been evicted: an
  orphan) is left as it is: the pool indexes one copy, and this request did not read it.
* **Capacity counts cached blocks, not pages in use.** While a request runs, its pages are in use and not
  evictable, so the pool has ``capacity`` pages plus headroom for the longest request of the trace; an allocation
  never has to evict, and after each request the cache holds at most ``capacity`` blocks, as Mooncake's Figure 9
  counts it. ``capacity=None`` never evicts: the ceiling, what an unbounded cache would serve.
* **Hit rate** is token-weighted: reused blocks times ``block_size`` over all prompt tokens. The manager's own
  counters are in blocks (its pages); every admission here is a first one.

For LRU a request's blocks become the most recently released, its head most recent of all (tail-first release),
so the tail goes first. Belady (``belady.py``) reads the future that ``Future`` precomputes. Chain keys are
computed once per trace (with the manager's own ``page_key``) and handed to each request's key memo, so a curve of
many runs hashes each block once.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from astrai.eviction import POLICIES, PolicyFactory
from astrai.kv_cache_manager import KVCacheManager
from astrai.lab.belady import Belady, Future
from astrai.lab.trace import Trace
from astrai.page_pool import PageKey, PagePool, page_key
from astrai.request import Request
from astrai.sampling import SamplingParams

REPLAY_POLICIES = (*POLICIES, Belady.name)  # every online policy, and the offline bound
_PARAMS = SamplingParams(max_tokens=1)  # a Request needs some; nothing is sampled


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int | None  # cached blocks; None: unbounded (the ceiling)
    hit_rate: float  # hit tokens / prompt tokens
    hit_tokens: int
    query_tokens: int
    evictions: int
    orphans: int  # cached at the end with their parent block gone: no hit until the parent is computed again


class Replay:
    """One trace, prepared once (chain keys, Belady's future), replayed under any policy and capacity."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.full = [trace.full_blocks(r) for r in trace.requests]
        self.headroom = max((len(r.hash_ids) for r in trace.requests), default=1)
        self.keys: list[list[PageKey]] = []
        for request, full in zip(trace.requests, self.full, strict=True):
            keys: list[PageKey] = []
            for block in request.hash_ids[:full]:
                keys.append(page_key(keys[-1] if keys else None, [block]))
            self.keys.append(keys)

    @cached_property
    def future(self) -> Future:
        return Future(self.trace)

    def run(self, policy: str, capacity: int | None) -> ReplayResult:
        """Replay the whole trace through a fresh pool (see the module docstring for the exact rules)."""
        if policy not in REPLAY_POLICIES:
            raise ValueError(f"policy must be one of {list(REPLAY_POLICIES)}, got {policy!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"capacity must be an integer >= 0 or None, got {capacity!r}")
        belady: Belady | None = None
        eviction: str | PolicyFactory = policy
        if policy == Belady.name:

            def eviction(n_pages: int) -> Belady:
                nonlocal belady
                belady = Belady(n_pages, self.future)
                return belady

        pages = (sum(self.full) if capacity is None else capacity) + self.headroom
        pool = PagePool(pages, 1, eviction=eviction)
        manager = KVCacheManager(pool, prefix_caching=True)
        for i, request in enumerate(self.trace.requests):
            if belady is not None:
                belady.now = i
            req = Request(prompt_ids=list(request.hash_ids), params=_PARAMS, page_keys=list(self.keys[i]))
            if not manager.admit(req, len(req.prompt_ids)):
                raise AssertionError("the headroom fits every request")
            req.num_computed = self.full[i]
            manager.commit(req)
            manager.end_step()
            manager.free(req)
            if capacity is not None:
                for _ in range(pool.cached_pages - capacity):
                    pool.evict()
        hit_tokens = manager.hit_tokens * self.trace.block_size
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
        )


def replay(trace: Trace, policy: str, capacity: int | None) -> ReplayResult:
    return Replay(trace).run(policy, capacity)


_worker_replay: Replay | None = None  # a curve's prepared trace, inherited by its worker processes (fork)


def _run_one(job: tuple[str, int | None]) -> ReplayResult:
    assert _worker_replay is not None
    return _worker_replay.run(*job)


def curve(
    trace: Trace | Replay, policies: Sequence[str], capacities: Sequence[int | None], processes: int | None = None
) -> list[ReplayResult]:
    """Every policy at every capacity, policy-major. ``processes`` (default: the CPUs, at most the runs) replay in
    parallel; the prepared trace reaches them by ``fork`` (where there is none, or with 1, they run here)."""
    prepared = trace if isinstance(trace, Replay) else Replay(trace)
    jobs = [(policy, capacity) for policy in policies for capacity in capacities]
    processes = min(processes or os.cpu_count() or 1, len(jobs))
    if Belady.name in policies:
        prepared.future  # noqa: B018 - built once here, before the fork, not once per worker
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [prepared.run(*job) for job in jobs]
    global _worker_replay
    _worker_replay = prepared
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return pool.map(_run_one, jobs, chunksize=1)
    finally:
        _worker_replay = None
