"""The eviction policies in the pool: each one's order on hand-made cases, ranks that are the real eviction order,
heaps that stay small, and the engine's choice of policy by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai import InferenceEngine
from astrai.eviction import POLICIES, Arc
from astrai.page_pool import PagePool, page_key


def cached_pool(eviction: str, n: int, size: int = 4) -> tuple[PagePool, list[int]]:
    """A pool of ``size`` pages whose first ``n`` hold registered pages ``0..n-1`` (keys ``bytes([i])``), in use."""
    pool = PagePool(size, 1, eviction=eviction)
    pages = [pool.allocate() for _ in range(n)]
    for i, page in enumerate(pages):
        pool.register(page, bytes([i]), [i], 0)
    return pool, pages


def hit(pool: PagePool, page: int) -> None:
    """A prefix hit on a cached page: acquired, then released."""
    pool.acquire(page)
    pool.release([page])


def drain(pool: PagePool) -> list[int]:
    return [pool.evict() for _ in range(pool.cached_pages)]


def test_fifo_evicts_by_registration_whatever_the_hits():
    pool, (a, b, c) = cached_pool("fifo", 3)
    pool.release([c])
    pool.release([b])
    pool.release([a])  # released in the order c, b, a: LRU would evict c first
    hit(pool, a)  # and a hit would make a the most recent
    assert list(pool.policy) == [a, b, c] == drain(pool)


def test_lfu_evicts_the_fewest_hits_first_and_ties_least_recently_released():
    pool, (a, b, c) = cached_pool("lfu", 3)
    pool.release([a, b, c])  # tail-first: c, b, a
    hit(pool, a)
    hit(pool, a)
    hit(pool, b)
    assert [pool.hits[p] for p in (a, b, c)] == [2, 1, 0]
    assert list(pool.policy) == [c, b, a] == drain(pool)
    pool, (a, b, c) = cached_pool("lfu", 3)
    pool.release([a, b, c])  # no hits: the tie goes least recently released, the tail c first
    assert drain(pool) == [c, b, a]


def test_arc_keeps_pages_that_served_a_hit_over_one_off_pages():
    pool, (a, b, c) = cached_pool("arc", 3)
    pool.release([a, b, c])  # c, b, a: all in T1 (recent, no hit yet)
    hit(pool, c)  # c moves to T2 (frequent)
    assert list(pool.policy) == [b, a, c]  # p = 0: T1 goes first, least recent first
    assert drain(pool) == [b, a, c]


def test_arc_ghost_hits_move_its_target_for_recent_pages():
    pool, (a, b, c) = cached_pool("arc", 3, size=3)
    policy = pool.policy
    assert isinstance(policy, Arc)
    pool.release([a, b, c])
    assert pool.evict() == c  # T1's least recent; its key becomes a B1 ghost
    page = pool.allocate()
    pool.register(page, bytes([2]), [2], 0)  # c's key again: a ghost hit in B1 ...
    assert policy.p == 1.0  # ... so T1 (recent pages) deserves more room
    pool.release([page])
    assert list(policy) == [b, page, a]  # T1 = [b, a] is above p = 1, so b goes first; then T1 is at its target
    hit(pool, b)  # b joins T2 = [page, b]; T1 = [a] is at p = 1 ...
    assert drain(pool) == [page, b, a]  # ... so T2 gives up its least recent first, and the one-off a goes last


@pytest.mark.parametrize("eviction", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "hit", "release"]), st.integers(0, 99)), max_size=60))
def test_eviction_rank_is_the_order_pages_are_evicted_in(eviction, ops):
    """``lru_rank`` (0 = evicted next) is what successive evictions take, under every policy."""
    pool = PagePool(8, 1, eviction=eviction)
    held: list[int] = []
    for op, n in ops:
        if op == "alloc" and pool.available:
            page = pool.allocate()
            pool.register(page, page_key(None, [n % 12]), [n % 12], 0)
            held.append(page)
        elif op == "hit" and pool.index:
            page = sorted(pool.index.values())[n % len(pool.index)]
            pool.acquire(page)
            held.append(page)
        elif op == "release" and held:
            pool.release([held.pop(n % len(held))])
    ranks = pool.lru_rank()
    assert sorted(ranks.values()) == list(range(pool.cached_pages))
    assert drain(pool) == sorted(ranks, key=ranks.__getitem__)
    pool.check_invariants()


@pytest.mark.parametrize("eviction", ["fifo", "lfu"])
def test_heaps_stay_small_when_pages_are_revived_over_and_over(eviction):
    """Lazy deletion leaves a stale entry per revival; the heap is rebuilt before they pile up."""
    pool, pages = cached_pool(eviction, 4)
    pool.release(pages)
    for _ in range(10_000):
        hit(pool, pages[0])
    assert len(pool.policy._heap) <= 2 * pool.cached_pages + 64 + 1
    assert drain(pool)[-1] == (pages[0] if eviction == "lfu" else pages[3])


def test_an_unknown_policy_is_refused_with_the_choices(model, tokenizer):
    with pytest.raises(ValueError, match="eviction must be one of .*'lru'"):
        PagePool(4, 1, eviction="belady")  # the offline bound is the lab's, never an engine's
    with pytest.raises(ValueError, match="eviction must be one of"):
        InferenceEngine(model, tokenizer, n_pages=8, eviction="random", compile=False)
    with InferenceEngine(model, tokenizer, n_pages=8, eviction="arc", compile=False) as engine:
        assert isinstance(engine.pool.policy, Arc)
