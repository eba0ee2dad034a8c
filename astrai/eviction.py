"""Eviction policies: which cached page a full pool gives up first.

A policy holds the pool's *cached* pages (ref count 0, indexed) and nothing else; the pool tells it what happens
to its pages and asks it for a victim:

* ``stored(page)``  - the page was registered in the prefix index (it is in use: not evictable yet);
* ``cached(page)``  - its last reference was dropped: it is evictable now (the pool releases a request's pages
  tail-first, so a policy that orders by this call puts the tail before the head);
* ``revived(page)`` - a prefix hit took a cached page back (it is in use again: no longer evictable);
* ``victim()``      - remove and return the page to evict next (only asked while the policy holds a page);
* ``clear()``       - every cached page went free at once.

Invariant (``PagePool.check_invariants`` checks it): the policy holds exactly the cached pages, each once, and
iterates them in eviction order, first = evicted next; ``PagePool.lru_rank`` is that order. Every call is O(1)
(``Lru``, ``Arc``) or O(log n) (the heap policies: lazy deletion, so a revived page costs a dict delete, and the
heap is rebuilt when stale entries outnumber live ones, so it stays O(cached pages)); iterating sorts, O(n log n),
and is for observers only. A policy reads the pool (hit counts, keys) and never writes it.

The policies are chosen per engine by name (``InferenceEngine(eviction=...)``): ``POLICIES``. Belady's MIN needs
the future, so it lives with the trace replay (``astrai.lab.belady``), never here. The numbers quoted below are
token hit rates from ``python -m astrai.lab`` on the two Mooncake traces (``assets/traces/``), at 1,000 / 5,859 /
20,000 / 50,000 cached blocks of 512 tokens; SGLang's ``mem_cache/evict_policy.py`` (small policy classes beside the
cache) and vLLM v1's ``FreeKVCacheBlockQueue`` (eviction order kept by release order) are the models.
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from astrai.page_pool import PageKey, PagePool

RELEASES_BITS = 48  # LFU's tie-break, the release count, sits below the hit count in one int


class EvictionPolicy(Collection[int]):
    """The cached pages of one pool, in eviction order (iterate: first = evicted next). See the module docstring."""

    name: ClassVar[str]

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def stored(self, page: int) -> None:  # noqa: B027 - most policies note nothing at registration
        """The page was just registered in the prefix index; it is in use, so not evictable yet."""

    @abstractmethod
    def cached(self, page: int) -> None:
        """The page's last reference was dropped: it is evictable from now on."""

    @abstractmethod
    def revived(self, page: int) -> None:
        """A prefix hit took the cached page back: it is in use, no longer evictable."""

    @abstractmethod
    def victim(self) -> int:
        """Remove and return the page to evict next; only called while the policy holds a page."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every cached page (the pool freed them all)."""


class Lru(EvictionPolicy):
    """Least recently released first: an ``OrderedDict`` in release order, every call O(1).

    Why it does well on prefix chains: a request touches its whole chain and releases it tail-first, so a parent is
    always more recent than its children and LRU evicts leaves only (it never strands a cached child without its
    parent). SGLang's "leaves only" LRU, which evicts only pages without a cached child, therefore picks exactly the
    same victims on the Mooncake traces (equal hit rates at every capacity measured, in a stand-alone simulation of
    the replay's rules), and is not kept.
    """

    name = "lru"

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self._order: OrderedDict[int, None] = OrderedDict()  # first = least recently released

    def cached(self, page: int) -> None:
        self._order[page] = None

    def revived(self, page: int) -> None:
        del self._order[page]

    def victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: object) -> bool:
        return page in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class HeapPolicy(EvictionPolicy):
    """Cached pages in a min-heap by ``priority(page)`` (an int), which must not change while the page stays cached.

    A heap entry is one int, ``priority * n_pages + page``, so the heap compares ints only and equal priorities go
    lowest page first. Lazy deletion: ``_live`` maps each cached page to its current entry; a popped entry that is not
    its page's live one is stale and skipped (a page revived and cached again under an equal priority leaves an
    identical entry behind: the first pop takes the page out of ``_live``, so the second is stale). When stale
    entries outnumber the live ones the heap is rebuilt, so its size stays O(cached pages).
    """

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self._stride = pool.n_pages
        self._heap: list[int] = []
        self._live: dict[int, int] = {}

    @abstractmethod
    def priority(self, page: int) -> int:
        """Lowest first out; computed when the page becomes cached."""

    def cached(self, page: int) -> None:
        self._push(page, self.priority(page))

    def _push(self, page: int, priority: int) -> None:
        entry = priority * self._stride + page
        self._live[page] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def revived(self, page: int) -> None:
        del self._live[page]

    def victim(self) -> int:
        live, stride, heap = self._live, self._stride, self._heap
        while True:
            entry = heapq.heappop(heap)
            page = entry % stride
            if live.get(page) == entry:
                del live[page]
                return page

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, page: object) -> bool:
        return page in self._live

    def __iter__(self) -> Iterator[int]:
        return (entry % self._stride for entry in sorted(self._live.values()))


class Fifo(HeapPolicy):
    """First registered, first evicted, however often the page served hits since.

    A chain is registered head first, so FIFO evicts a chain's head before its tail and strands the rest (cached
    pages whose parent is gone serve nothing until the parent is computed again): it trails LRU at every capacity.
    """

    name = "fifo"

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self._registered = [0] * pool.n_pages  # the order of the page's registration
        self._count = itertools.count()

    def stored(self, page: int) -> None:
        self._registered[page] = next(self._count)

    def priority(self, page: int) -> int:
        return self._registered[page]


class Lfu(HeapPolicy):
    """Fewest prefix hits served since registration first (``PagePool.hits``); ties go least recently released.

    A page's hit count only grows while it is in use, so its priority is fixed while it is cached. Counts never
    decay, so blocks that were hot an hour ago crowd out today's: LFU trails LRU at most capacities.
    """

    name = "lfu"

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self._released = itertools.count()

    def priority(self, page: int) -> int:
        return (self.pool.hits[page] << RELEASES_BITS) + next(self._released)


class Arc(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03) over the cached pages: the research policy kept.

    ``T1`` holds cached pages that served no hit since they were registered, ``T2`` those that did, each in release
    order (first = least recent). ``B1`` and ``B2`` are ghosts: the keys of pages evicted from ``T1`` and ``T2``.
    A page registered under a ghost key goes to ``T2`` once cached, and moves the target size ``p`` of ``T1``: up
    for a ``B1`` ghost (recency was cut too short), down for a ``B2`` ghost. The victim is ``T1``'s least recent
    while ``T1`` is above ``p`` (or ``T2`` is empty), else ``T2``'s. Each ghost list holds at most as many keys as
    the cache holds pages when it evicts; ``p`` stays within [0, n_pages]. Every call is O(1).

    Why ARC: on the conversation trace, blocks reused once are far likelier to be reused again (a conversation that
    came back comes back), so keeping ``T2`` apart from one-off blocks beats plain recency where the cache is small.
    Token hit rates, LRU -> ARC (``python -m astrai.lab``), conversation trace: 4.59 -> 5.97% at 1,000 blocks,
    14.37 -> 16.16% at 5,859, 29.95 -> 30.35% at 20,000, but 36.32 -> 35.24% at 50,000 (LRU is better from between
    22,000 and 24,000 blocks on: a cache that large serves long-gap conversations, whose blocks sit in ``T1``);
    synthetic trace: 8.68 -> 9.14%, 32.10 -> 33.84%, 59.28 -> 60.65%, equal at 50,000 (the ceiling, 65.04%), and
    behind only near 1,500 blocks (12.58 -> 12.52%, ``assets/traces/curves.json``). The other candidates,
    measured with a stand-alone simulation of the replay's rules (which gives these four policies' numbers exactly):
    S3-FIFO (10% small queue, ghosts, frequency capped at 3) 5.47 / 15.96 / 25.77 / 35.29% on the conversation trace,
    above LRU only below about 6,000 blocks and below ARC everywhere but 50,000 (by 0.05 points); "leaves only" LRU
    equals LRU (see ``Lru``). ARC does not respect chains: it can evict a parent before its child, stranding the
    child (``astrai.lab`` counts such orphans).
    """

    name = "arc"

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[PageKey, None] = OrderedDict()
        self._b2: OrderedDict[PageKey, None] = OrderedDict()
        self._frequent = [False] * pool.n_pages  # goes to T2 when cached

    def stored(self, page: int) -> None:
        key = self.pool.key[page]
        assert key is not None, "a stored page is indexed"
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(self.pool.n_pages), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._frequent[page] = True
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._frequent[page] = True
        else:
            self._frequent[page] = False

    def cached(self, page: int) -> None:
        (self._t2 if self._frequent[page] else self._t1)[page] = None

    def revived(self, page: int) -> None:
        if self._frequent[page]:
            del self._t2[page]
        else:
            del self._t1[page]
            self._frequent[page] = True

    def victim(self) -> int:
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self.p or not t2):
            page, ghosts = t1.popitem(last=False)[0], self._b1
        else:
            page, ghosts = t2.popitem(last=False)[0], self._b2
        key = self.pool.key[page]
        assert key is not None, "a cached page is indexed"
        ghosts[key] = None
        while len(ghosts) > len(t1) + len(t2):
            ghosts.popitem(last=False)
        return page

    def clear(self) -> None:
        for queue in (self._t1, self._t2, self._b1, self._b2):
            queue.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, page: object) -> bool:
        return page in self._t1 or page in self._t2

    def __iter__(self) -> Iterator[int]:
        """The order ``victim`` would take them in, were nothing else to happen: ``p`` moves only at registration."""
        t1, t2 = iter(self._t1), iter(self._t2)
        n1, n2 = len(self._t1), len(self._t2)
        while n1 or n2:
            if n1 and (n1 > self.p or not n2):
                n1 -= 1
                yield next(t1)
            else:
                n2 -= 1
                yield next(t2)


PolicyFactory = Callable[["PagePool"], EvictionPolicy]
POLICIES: dict[str, type[EvictionPolicy]] = {policy.name: policy for policy in (Lru, Fifo, Lfu, Arc)}


def make_policy(eviction: str | PolicyFactory, pool: PagePool) -> EvictionPolicy:
    """The policy for ``pool``: a name from ``POLICIES``, or a factory (the trace replay's Belady)."""
    if callable(eviction):
        return eviction(pool)
    if not isinstance(eviction, str) or eviction not in POLICIES:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {eviction!r}")
    return POLICIES[eviction](pool)
