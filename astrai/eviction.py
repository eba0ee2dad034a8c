"""Eviction policies: which cached page a full pool gives up first.

A policy holds the pool's *cached* pages (ref count 0, indexed) and nothing else. It reads nothing of the pool: the
pool tells it what happens to its pages, with the facts a policy may need, and asks it for a victim
(``EvictionPolicy`` is that protocol, so this module imports nothing of ``astrai.page_pool``):

* ``missed(key)``              - a page is about to be allocated to compute the page of this key (a prefix miss),
  before any eviction the allocation makes;
* ``stored(page, key, pos)``   - the page was registered in the prefix index under ``key``, at chain position
  ``pos`` (it is in use: not evictable yet);
* ``hit(page)``                - a prefix hit took a reference on the page (in use: not evictable);
* ``cached(page, hits)``       - its last reference was dropped: it is evictable now, having served ``hits`` prefix
  hits since it was allocated (the pool releases a request's pages tail-first, so a policy that orders by this call
  puts the tail before the head);
* ``victim(incoming)``         - remove and return the page to evict next (only asked while the policy holds a page);
  ``incoming`` is the key of the page the eviction makes room for, if the allocation named one;
* ``clear()``                  - every cached page went free at once, and in-use pages were unindexed.

Invariant (``PagePool.check_invariants`` checks it): the policy holds exactly the cached pages, each once, and
iterates them in eviction order, first = evicted next (for ``Arc``: next evicted on demand, see there);
``PagePool.lru_rank`` is that order. Every call is O(1) (``Lru``, ``Arc``) or O(log n) (the heap policies: lazy
deletion, so a revived page costs a dict delete, and the heap is rebuilt when stale entries outnumber live ones, so
it stays O(cached pages)); iterating sorts, O(n log n), and is for observers only.

The policies are chosen per engine by name (``InferenceEngine(eviction=...)``): ``POLICIES``; each is built from the
pool's size alone. Belady's MIN needs the future, so it lives with the trace replay (``astrai.lab.belady``), never
here. The numbers quoted below are token hit rates from ``python -m astrai.lab`` on the two Mooncake traces
(``assets/traces/``, ``curves.json``), at 1,000 / 5,859 / 20,000 / 50,000 cached blocks of 512 tokens; SGLang's
``mem_cache/evict_policy.py`` (small policy classes beside the cache) and vLLM v1's ``FreeKVCacheBlockQueue``
(eviction order kept by release order) are the models.
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterator
from enum import Enum
from typing import ClassVar, Protocol

RELEASES_BITS = 48  # LFU's tie-break, the release count, sits below the hit count in one int


class EvictionPolicy(Collection[int], Protocol):
    """The cached pages of one pool, in eviction order (iterate: first = evicted next), and the events the pool tells
    it (module docstring). A policy is built from the pool's size: ``policy(n_pages)``."""

    name: ClassVar[str]

    def missed(self, key: Hashable) -> None:
        """A page is about to be allocated for the page of ``key``; an eviction for it may follow at once."""
        return None  # most policies order by release only

    def stored(self, page: int, key: Hashable, chain_pos: int) -> None:
        """The page was just registered in the prefix index; it is in use, so not evictable yet."""
        return None

    @abstractmethod
    def hit(self, page: int) -> None:
        """A prefix hit took a reference on the page: it is in use, not evictable (if it was cached, no longer)."""

    @abstractmethod
    def cached(self, page: int, hits: int) -> None:
        """The page's last reference was dropped: it is evictable from now on; it served ``hits`` prefix hits."""

    @abstractmethod
    def victim(self, incoming: Hashable | None = None) -> int:
        """Remove and return the page to evict next; only called while the policy holds a page."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every page (the pool freed the cached ones and unindexed the rest)."""


class Lru(EvictionPolicy):
    """Least recently released first: an ``OrderedDict`` in release order, every call O(1).

    Why it does well on prefix chains: a request touches its whole chain and releases it tail-first, so a parent is
    always more recent than its children and LRU evicts leaves only (it never strands a cached child without its
    parent). SGLang's "leaves only" LRU, which evicts only pages without a cached child, therefore picks exactly the
    same victims on the Mooncake traces (equal hit rates at every capacity measured, in a stand-alone simulation of
    the replay's rules), and is not kept.
    """

    name = "lru"

    def __init__(self, n_pages: int) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # first = least recently released

    def hit(self, page: int) -> None:
        self._order.pop(page, None)

    def cached(self, page: int, hits: int) -> None:
        self._order[page] = None

    def victim(self, incoming: Hashable | None = None) -> int:
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
    """Cached pages in a min-heap by ``priority(page, hits)`` (an int), fixed while the page stays cached.

    A heap entry is one int, ``priority * n_pages + page``, so the heap compares ints only and equal priorities go
    lowest page first. Lazy deletion: ``_live`` maps each cached page to its current entry; a popped entry that is not
    its page's live one is stale and skipped (a page revived and cached again under an equal priority leaves an
    identical entry behind: the first pop takes the page out of ``_live``, so the second is stale). When stale
    entries outnumber the live ones the heap is rebuilt, so its size stays O(cached pages).
    """

    def __init__(self, n_pages: int) -> None:
        self._stride = n_pages
        self._heap: list[int] = []
        self._live: dict[int, int] = {}

    @abstractmethod
    def priority(self, page: int, hits: int) -> int:
        """Lowest first out; computed when the page becomes cached, having served ``hits`` prefix hits."""

    def cached(self, page: int, hits: int) -> None:
        entry = self.priority(page, hits) * self._stride + page
        self._live[page] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def hit(self, page: int) -> None:
        self._live.pop(page, None)

    def victim(self, incoming: Hashable | None = None) -> int:
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
    pages whose parent is gone serve nothing until the parent is computed again). So it trails LRU at every capacity of
    ``curves.json`` but two, both on the synthetic trace: at 3,684 blocks it is ahead (22.88 against 22.80%), and at
    50,000 both reach the ceiling.
    """

    name = "fifo"

    def __init__(self, n_pages: int) -> None:
        super().__init__(n_pages)
        self._registered = [0] * n_pages  # the order of the page's registration
        self._count = itertools.count()

    def stored(self, page: int, key: Hashable, chain_pos: int) -> None:
        self._registered[page] = next(self._count)

    def priority(self, page: int, hits: int) -> int:
        return self._registered[page]


class Lfu(HeapPolicy):
    """Fewest prefix hits served since the page was allocated first (``PagePool.hits``); ties go least recently
    released.

    A page's hit count only grows while it is in use, so its priority is fixed while it is cached. Counts never
    decay, so blocks that were hot an hour ago crowd out today's: LFU trails LRU at most capacities.
    """

    name = "lfu"

    def __init__(self, n_pages: int) -> None:
        super().__init__(n_pages)
        self._released = itertools.count()

    def priority(self, page: int, hits: int) -> int:
        return (hits << RELEASES_BITS) + next(self._released)


class _Miss(Enum):
    """What Fig. 4 of the ARC paper does for a page that is not resident: its case, which fixes where the page goes
    (T1 or T2) and how REPLACE makes room for it."""

    NEW = "IV: joins T1"
    NEW_T1_FULL = "IV.A with |T1| = c: joins T1, and T1's LRU page leaves with no ghost"
    GHOST_B1 = "II: a B1 ghost, p grows; joins T2"
    GHOST_B2 = "III: a B2 ghost, p shrinks; joins T2, and REPLACE's tie rule applies"


class Arc(EvictionPolicy):
    """ARC, the Adaptive Replacement Cache of Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
    Cache" (USENIX FAST'03), as its Fig. 4 specifies it, with c = the pool's pages.

    ``T1`` holds resident pages referenced once since they came in, ``T2`` those referenced again; ``B1`` and ``B2``
    are ghosts, the keys of pages REPLACE evicted from ``T1`` and ``T2``, most recent last. Bounds (Fig. 4 keeps them,
    and so does this): |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c; 0 <= p <= c. Per reference x:

    * x resident (case I, a prefix hit): x moves to T2.
    * x in B1 (case II): p += max(|B2| / |B1|, 1), at most c; REPLACE; x joins T2. x in B2 (case III): p -=
      max(|B1| / |B2|, 1), at least 0; REPLACE; x joins T2.
    * otherwise (case IV): if |T1| + |B1| = c, B1's LRU ghost is dropped and REPLACE runs, or, when |T1| = c, T1's
      LRU page is evicted with no ghost; else, when the directory holds >= c entries, B2's LRU ghost is dropped if it
      holds 2c, and REPLACE runs. x joins T1.
    * REPLACE evicts T1's LRU page into B1 if |T1| >= 1 and (|T1| > p, or x is in B2 and |T1| = p: the tie rule),
      else T2's LRU page into B2.

    How the pool maps onto a cache of c pages:

    * **A reference is a prefix hit (``hit``) or an allocation for a key (``missed``).** The pool names the key before
      it evicts, so p adapts before the allocation's eviction and REPLACE sees x, as in the paper's order. The page
      joins T1 or T2 when it is registered (``stored``), after its forward.
    * **REPLACE runs only when the pool has no free page,** which is when the paper's full cache runs it: the ghost
      deletions of cases II-IV run on every miss either way, so the bounds hold with free pages too.
    * **Resident means indexed, in use or cached.** |T1| and |T2| count pages pinned by running requests, because
      they fill the pool; recency is release order (the end of a page's last use). Variants, where no cache of c
      evictable pages has an equivalent: REPLACE takes the least recently released *evictable* page of the list it
      picks, and the other list's when the picked one has none; pages in use that hold no key (a partial last page,
      generated tokens) fill pages outside the directory; an allocation that names no key, or an eviction on demand
      (the lab's trim to capacity), is REPLACE for an x in neither ghost list; a page registered without an announced
      allocation (a page of generated tokens, full only after its allocation) goes through case II-IV at
      registration, with no REPLACE; a page shared in the step that computes it (before it is registered) is one
      reference. One request at a time, every reference one page, the pool is exactly the paper's cache
      (``tests/test_eviction.py`` checks it against a transcription of Fig. 4, hit for hit and page for page).
    * **The lab's replay where it trims to the capacity after each request** (``astrai.lab.replay``: a pool of the
      capacity plus room for the longest request, so an allocation never evicts): c is that whole pool, not the
      capacity, and a trim may evict a block the request has just computed. The README's lab table is of that.
    * **Iteration** (``lru_rank``) is the order of evictions on demand; an allocation whose key is a B2 ghost may
      take T1's page first by the tie rule.

    Why ARC: on the conversation trace, blocks reused once are far likelier to be reused again (a conversation that
    came back comes back), so keeping ``T2`` apart from one-off blocks beats plain recency where the cache is small.
    Token hit rates, LRU -> ARC (``python -m astrai.lab``), conversation trace: 4.59 -> 5.78% at 1,000 blocks,
    14.37 -> 15.55% at 5,859, but 29.95 -> 29.86% at 20,000 and 36.32 -> 35.29% at 50,000 (LRU is better from
    between 19,000 and 19,500 blocks on: a cache that large serves long-gap conversations, whose blocks sit in
    ``T1``); synthetic trace: 8.68 -> 8.67% (behind by 0.01 point), 32.10 -> 33.73%, 59.28 -> 60.67%, equal at
    50,000 (the ceiling, 65.04%); ahead at every capacity of ``curves.json`` from 1,544 to 32,374. The other
    candidates, measured with a stand-alone simulation of the replay's rules (before ARC followed Fig. 4): S3-FIFO
    (10% small queue, ghosts, frequency capped at 3) 5.47 / 15.96 / 25.77 / 35.29% on the conversation trace, above
    LRU only below about 6,000 blocks; against this ARC, behind at 1,000 and 20,000 blocks and ahead at 5,859;
    "leaves only" LRU equals LRU (see ``Lru``). ARC does not respect chains: it can evict a parent before its
    child, stranding the child (``astrai.lab`` counts such orphans).
    """

    name = "arc"

    def __init__(self, n_pages: int) -> None:
        self.c = n_pages
        self.p = 0.0  # the target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()  # T1's evictable pages, least recently released first
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._resident: dict[int, Hashable] = {}  # every page of T1 and T2, in use or cached -> its key
        self._keys: set[Hashable] = set()  # their keys
        self._frequent: set[int] = set()  # the pages of T2
        self._b1: OrderedDict[Hashable, None] = OrderedDict()  # ghosts, least recent first
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        # keys announced by ``missed`` and not registered yet; a cancelled request's are dropped oldest first
        self._incoming: OrderedDict[Hashable, _Miss] = OrderedDict()

    @property
    def t1_size(self) -> int:
        """|T1|: resident pages referenced once, in use or cached."""
        return len(self._resident) - len(self._frequent)

    @property
    def t2_size(self) -> int:
        return len(self._frequent)

    @property
    def ghosts(self) -> tuple[int, int]:
        """|B1| and |B2|."""
        return len(self._b1), len(self._b2)

    def missed(self, key: Hashable) -> None:
        if key in self._keys or key in self._incoming:
            return  # resident (a block computed again after its parent's eviction), or already on its way in
        self._incoming[key] = self._miss(key)
        if len(self._incoming) > self.c:
            self._incoming.popitem(last=False)

    def _miss(self, key: Hashable) -> _Miss:
        """Cases II-IV of Fig. 4 for a key that is not resident, but REPLACE (``victim`` runs it)."""
        b1, b2, c = self._b1, self._b2, self.c
        if key in b1:
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            return _Miss.GHOST_B1
        if key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            return _Miss.GHOST_B2
        t1 = len(self._resident) - len(self._frequent)
        if t1 + len(b1) >= c:
            if t1 >= c:
                return _Miss.NEW_T1_FULL  # every page of the pool is in T1, so an eviction follows
            b1.popitem(last=False)
        elif len(self._resident) + len(b1) + len(b2) >= 2 * c:
            b2.popitem(last=False)
        return _Miss.NEW

    def stored(self, page: int, key: Hashable, chain_pos: int) -> None:
        miss = self._incoming.pop(key, None)
        if miss is None:  # no announced allocation; the page being stored is not in T1, so |T1| < c here
            miss = self._miss(key)
        self._resident[page] = key
        self._keys.add(key)
        if miss in (_Miss.GHOST_B1, _Miss.GHOST_B2):
            self._frequent.add(page)

    def hit(self, page: int) -> None:
        if page not in self._resident:
            return  # shared in the step that computes it: not registered yet
        self._t1.pop(page, None)
        self._t2.pop(page, None)
        self._frequent.add(page)

    def cached(self, page: int, hits: int) -> None:
        (self._t2 if page in self._frequent else self._t1)[page] = None

    def _from_t1(self, t1_size: int, t1_evictable: bool, t2_evictable: bool, tie: bool) -> bool:
        """REPLACE's choice of list, moved to the other list when the chosen one has no evictable page."""
        wanted = t1_size >= 1 and (t1_size > self.p or (tie and t1_size == self.p))
        return (wanted and t1_evictable) or not t2_evictable

    def victim(self, incoming: Hashable | None = None) -> int:
        miss = self._incoming.get(incoming) if incoming is not None else None
        resident, frequent = self._resident, self._frequent
        ghosts: OrderedDict[Hashable, None] | None
        if miss is _Miss.NEW_T1_FULL:
            queue, ghosts = self._t1, None
        elif self._from_t1(len(resident) - len(frequent), bool(self._t1), bool(self._t2), miss is _Miss.GHOST_B2):
            queue, ghosts = self._t1, self._b1
        else:
            queue, ghosts = self._t2, self._b2
        page = queue.popitem(last=False)[0]
        key = resident.pop(page)
        self._keys.remove(key)
        frequent.discard(page)
        if ghosts is not None:
            ghosts[key] = None
        return page

    def clear(self) -> None:
        for queue in (self._t1, self._t2, self._resident, self._b1, self._b2, self._incoming):
            queue.clear()
        self._keys.clear()
        self._frequent.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, page: object) -> bool:
        return page in self._t1 or page in self._t2

    def __iter__(self) -> Iterator[int]:
        """The order ``victim`` takes them in on demand, were nothing else to happen (p moves only on misses)."""
        t1, t2 = iter(self._t1), iter(self._t2)
        n1, n2, size1 = len(self._t1), len(self._t2), self.t1_size
        while n1 or n2:
            if self._from_t1(size1, n1 > 0, n2 > 0, tie=False):
                n1 -= 1
                size1 -= 1
                yield next(t1)
            else:
                n2 -= 1
                yield next(t2)


PolicyFactory = Callable[[int], EvictionPolicy]  # n_pages -> a policy (the trace replay's Belady)
POLICIES: dict[str, PolicyFactory] = {policy.name: policy for policy in (Lru, Fifo, Lfu, Arc)}


def make_policy(eviction: str | PolicyFactory, n_pages: int) -> EvictionPolicy:
    """The policy for a pool of ``n_pages``: a name from ``POLICIES``, or a factory (the trace replay's Belady)."""
    if callable(eviction):
        return eviction(n_pages)
    if not isinstance(eviction, str) or eviction not in POLICIES:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {eviction!r}")
    return POLICIES[eviction](n_pages)
