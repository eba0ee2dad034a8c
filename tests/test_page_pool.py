"""The page pool on its own: states, LRU order, the chained hash, and a stateful property test per eviction policy."""

from __future__ import annotations

import heapq
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from astrai.eviction import POLICIES
from astrai.observation import PageEvicted
from astrai.page_pool import PagePool, PageState, page_key


def test_equal_page_after_different_prefix_gets_a_different_key():
    shared_page = [7, 8, 9, 10]
    key_a = page_key(page_key(None, [1, 2, 3, 4]), shared_page)
    key_b = page_key(page_key(None, [5, 6, 7, 8]), shared_page)
    assert key_a != key_b
    assert page_key(page_key(None, [1, 2, 3, 4]), shared_page) == key_a


def test_salt_separates_namespaces():
    assert page_key(None, [1, 2], salt="alice") != page_key(None, [1, 2], salt="bob")
    assert page_key(None, [1, 2], salt="alice") == page_key(None, [1, 2], salt="alice")


def test_lookup_compares_tokens_so_a_collision_serves_nothing():
    pool = PagePool(4, 2)
    page = pool.allocate()
    assert pool.register(page, b"key", [1, 2], 0)
    assert pool.lookup(b"key", [1, 2]) == page
    assert pool.lookup(b"key", [1, 3]) is None  # same key, other tokens: a forced collision


def test_release_is_tail_first_and_eviction_is_lru():
    pool = PagePool(3, 2)
    pages = [pool.allocate() for _ in range(3)]
    for i, p in enumerate(pages):
        pool.register(p, bytes([i]), [i, i], i)
    pool.release(pages)
    assert list(pool.policy) == pages[::-1]  # the tail goes first into the LRU, so it is evicted first
    pool.acquire(pages[2])  # a hit takes it out of the LRU ("touch")
    assert pool.state(pages[2]) is PageState.IN_USE and pages[2] not in pool.policy
    assert pool.allocate() == pages[1]  # no free page left: evict the least recently used
    assert pool.stats.evictions == 1
    assert pool.lookup(bytes([1]), [1, 1]) is None


def test_unregistered_pages_go_straight_back_to_free():
    pool = PagePool(2, 2)
    page = pool.allocate()
    pool.release([page])
    assert pool.state(page) is PageState.FREE and pool.cached_pages == 0


def test_in_use_pages_are_never_evicted():
    pool = PagePool(2, 2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"a", [1, 1], 0)
    with pytest.raises(MemoryError):
        pool.allocate()
    assert pool.ref_count[a] == pool.ref_count[b] == 1


def test_used_pages_are_counted_on_their_own_so_the_partition_can_fail():
    """``used_pages`` counts the pages holding a reference; were it ``n - free - cached``, a page listed twice would
    go unseen in the counts and ``free + used + cached == n`` could never fail."""
    pool = PagePool(4, 2)
    shared, cached = pool.allocate(), pool.allocate()
    pool.register(cached, b"c", [1, 1], 0)
    pool.acquire(shared)
    pool.release([cached])
    assert (pool.free_pages, pool.used_pages, pool.cached_pages) == (2, 1, 1)
    pool.acquire(cached)  # a hit revives a cached page
    pool.release([shared, cached, shared])
    assert (pool.free_pages, pool.used_pages, pool.cached_pages) == (3, 0, 1)
    page = pool.allocate()
    heapq.heappush(pool.free, page)  # a bookkeeping bug: a page in use is also on the free list
    assert pool.used_pages == 1
    assert pool.free_pages + pool.used_pages + pool.cached_pages == pool.n_pages + 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_clear_frees_cached_pages_and_unindexes_in_use_ones():
    pool = PagePool(3, 1)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"a", [1], 0)
    pool.register(b, b"b", [2], 0)
    pool.release([a])
    assert pool.clear() == 1
    assert pool.cached_pages == 0 and pool.index == {}
    pool.release([b])
    assert pool.free_pages == 3
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random alloc / share / register / release / evict / clear sequences against a model of live refs, under one
    eviction policy (``eviction``; a subclass per policy below)."""

    eviction = "lru"

    def __init__(self):
        super().__init__()
        self.evicted: list[int] = []  # the pages of the PageEvicted events, in order
        self.pool = PagePool(6, 2, emit=self.record, eviction=self.eviction)
        self.refs: list[int] = []  # every reference a caller holds, one entry per acquire/allocate
        self.evictions = 0

    def record(self, event, **fields):
        if event is PageEvicted:
            self.evicted.append(fields["page"])

    @precondition(lambda self: self.pool.available > 0)
    @rule()
    def allocate(self):
        evicting = self.pool.free_pages == 0
        ranks = self.pool.lru_rank()
        page = self.pool.allocate()
        if evicting:
            self.evictions += 1
            assert ranks[page] == 0, "eviction must take the page ranked 0 (evicted next)"
            assert self.evicted[-1] == page, "the eviction was not reported"
        assert page not in self.refs, "an in-use page was handed out again"
        self.refs.append(page)

    @precondition(lambda self: self.pool.cached_pages > 0)
    @rule()
    def evict(self):
        ranks = self.pool.lru_rank()
        page = self.pool.evict()
        self.evictions += 1
        assert ranks[page] == 0 and self.evicted[-1] == page
        assert self.pool.state(page) is PageState.FREE and self.pool.key[page] is None

    @rule(data=st.data())
    def share(self, data):
        indexed = sorted(self.pool.index.items())
        if not indexed:
            return
        key, page = data.draw(st.sampled_from(indexed))
        assert self.pool.lookup(key, self.pool.tokens[page]) == page
        self.pool.acquire(page)
        self.refs.append(page)

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def register(self, data, tokens):
        if not self.refs:
            return
        page = data.draw(st.sampled_from(self.refs))
        key = page_key(None, tokens)
        before = key in self.pool.index
        stored = self.pool.register(page, key, tokens, 0)
        assert stored == (not before and self.pool.key[page] == key)

    @rule(data=st.data())
    def release(self, data):
        if not self.refs:
            return
        n = data.draw(st.integers(1, len(self.refs)))
        taken = [self.refs.pop(data.draw(st.integers(0, len(self.refs) - 1))) for _ in range(n)]
        self.pool.release(taken)

    @rule()
    def clear(self):
        self.pool.clear()
        assert self.pool.cached_pages == 0 and not self.pool.index

    @invariant()
    def consistent(self):
        live: dict[int, int] = {}
        for page in self.refs:
            live[page] = live.get(page, 0) + 1
        self.pool.check_invariants(live)
        assert self.pool.stats.evictions == self.evictions
        assert self.pool.used_pages == len(live)


class FifoPoolMachine(PoolMachine):
    eviction = "fifo"


class LfuPoolMachine(PoolMachine):
    eviction = "lfu"


class ArcPoolMachine(PoolMachine):
    eviction = "arc"


MACHINES = (PoolMachine, FifoPoolMachine, LfuPoolMachine, ArcPoolMachine)
assert {machine.eviction for machine in MACHINES} == set(POLICIES), "a policy without its state machine"
for machine in MACHINES:
    machine.TestCase.settings = settings(
        max_examples=int(os.environ.get("ASTRAI_FUZZ_EXAMPLES", "300")), stateful_step_count=40, deadline=None
    )
test_pool_state_machine = PoolMachine.TestCase
test_pool_state_machine_fifo = FifoPoolMachine.TestCase
test_pool_state_machine_lfu = LfuPoolMachine.TestCase
test_pool_state_machine_arc = ArcPoolMachine.TestCase
