"""The page pool: fixed-size KV pages with ref counts, a prefix index and an eviction policy over cached pages.

Every page is in exactly one state:

* ``free``   - holds no KV worth keeping; sits in the free list.
* ``in_use`` - ref count >= 1.
* ``cached`` - ref count 0, but its complete KV is indexed by its chained hash and its eviction policy holds it.

The policy (``astrai/eviction.py``; LRU unless the engine names another) orders the cached pages for eviction, in
O(1) or O(log n) per call, and the index is a dict. The free list is a min-heap (O(log n)): a fresh page is always
the lowest-numbered free one, so the pages in use stay packed at the low end of the pool and a page map of a large,
lightly used pool stays legible. ``allocate`` evicts only when the free list is empty; ``evict`` evicts on demand
(the trace replay trims its cache to a capacity so). The pool tells its policy what happens to each page, and the
policy reads nothing of the pool (``astrai.eviction.EvictionPolicy``).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from astrai.eviction import EvictionPolicy, PolicyFactory, make_policy
from astrai.observation import PageEvicted, PageStored

PageKey = bytes
Emit = Callable[..., None]  # emit(EventClass, **fields): the engine stamps seq, step and time


class PageState(StrEnum):
    FREE = "free"
    IN_USE = "in_use"
    CACHED = "cached"


def page_key(parent: PageKey | None, tokens: Sequence[int], salt: str | None = None) -> PageKey:
    """Chained hash of one full page: the parent's key (or the salt, for a first page) plus this page's tokens.

    Chaining makes a page's key depend on everything before it, so equal tokens after different prefixes
    never share KV.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"root:" + (salt or "").encode("utf-8", "surrogatepass"))
    else:
        h.update(b"page:" + parent)
    h.update(b"|" + ",".join(map(str, tokens)).encode())
    return h.digest()


@functools.lru_cache(maxsize=1024)
def namespace_id(salt: str | None) -> bytes:
    """The opaque id of a prefix-cache namespace, published with the pages stored in it (``PageStored.namespace``).

    A digest, so the events never carry a salt (the playground's salts are session hashes); equal salts give equal
    ids, and no salt is a namespace of its own. Memoized: a commit asks once per request per step.
    """
    return hashlib.blake2b(b"namespace:" + (salt or "").encode("utf-8", "surrogatepass"), digest_size=8).digest()


@dataclass
class PoolStats:
    """Counters that only ever grow; occupancy is the pool's: its free list, its policy and ``used_pages``."""

    evictions: int = 0
    stored: int = 0


class PagePool:
    """Owns page bookkeeping (not the KV tensors themselves): states, ref counts, hashes, eviction order, free list.

    ``eviction`` names a policy of ``astrai.eviction.POLICIES`` (a ``ValueError`` names the choices otherwise) or is
    a factory of one from the pool's size (the trace replay's Belady, which needs the future).
    """

    def __init__(
        self, n_pages: int, page_size: int, emit: Emit | None = None, eviction: str | PolicyFactory = "lru"
    ) -> None:
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"n_pages and page_size must be >= 1, got {n_pages} and {page_size}")
        self.n_pages = n_pages
        self.page_size = page_size
        self.ref_count = [0] * n_pages
        self.key: list[PageKey | None] = [None] * n_pages
        self.tokens: list[tuple[int, ...] | None] = [None] * n_pages
        self.chain_pos: list[int] = [-1] * n_pages
        self.parent_key: list[PageKey | None] = [None] * n_pages
        self.stored_by: list[int | None] = [None] * n_pages  # the request whose forward wrote the indexed KV
        self.hits: list[int] = [0] * n_pages  # prefix hits served since the page was allocated
        self.touched: dict[int, None] = {}  # pages changed since ``take_touched``, in the order of their last change
        self.index: dict[PageKey, int] = {}
        self.free: list[int] = list(range(n_pages))  # a heap (a sorted list is one)
        self._used = 0  # pages with ref count >= 1, kept as refs go 0 -> 1 -> 0 (see ``used_pages``)
        self.stats = PoolStats()
        self._emit = emit  # None (a pool used on its own: tests, the trace replay): no event is built
        self.policy: EvictionPolicy = make_policy(eviction, n_pages)  # holds the cached pages; told of each change
        # told of each eviction once it is done (page, key, tokens, parent, chain_pos), while the page's KV is still
        # intact: the second tier's "on_evict" policy writes it there (``astrai.tier``); None: nobody listens
        self.on_evict: Callable[[int, PageKey, tuple[int, ...], PageKey | None, int], None] | None = None

    # ----- queries -------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self.free)

    @property
    def cached_pages(self) -> int:
        return len(self.policy)

    @property
    def lru(self) -> EvictionPolicy:
        """The cached pages in eviction order (first = evicted next), whatever the policy; the name is the LRU's,
        which readers of the pool (the engine's page records) know it by."""
        return self.policy

    @property
    def used_pages(self) -> int:
        """Pages with ref count >= 1, counted as references are taken and dropped, not derived from the other two
        states: so ``free + used + cached == n_pages`` is a check that a page lost or listed twice fails."""
        return self._used

    @property
    def available(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return len(self.free) + len(self.policy)

    def state(self, page: int) -> PageState:
        if self.ref_count[page] > 0:
            return PageState.IN_USE
        return PageState.CACHED if page in self.policy else PageState.FREE

    def lookup(self, key: PageKey, tokens: Sequence[int]) -> int | None:
        """The page holding exactly these tokens under this chain key, or None.

        The stored tokens are compared too, so a hash collision can never serve wrong KV.
        """
        page = self.index.get(key)
        if page is None or self.tokens[page] != tuple(tokens):
            return None
        return page

    # ----- ref counting ---------------------------------------------------------------------------------
    def acquire(self, page: int) -> None:
        """Take a reference on an indexed page (a prefix hit); a cached page leaves its policy (not evictable)."""
        if self.ref_count[page] == 0:
            if page not in self.policy:
                raise RuntimeError(f"page {page} is free; only in-use or cached pages can be shared")
            self._used += 1
        self.policy.hit(page)
        self.ref_count[page] += 1
        self.hits[page] += 1
        self.touch(page)

    def allocate(self, for_request: int | None = None, key: PageKey | None = None) -> int:
        """A fresh page with ref count 1: the lowest free one, after evicting the policy's victim if none is free
        (its event names ``for_request``, the request the page is for). ``key``: the chain key the page will be
        registered under, where the caller knows it; the policy hears of the miss before it picks a victim."""
        if key is not None:
            self.policy.missed(key)
        if not self.free:
            self.evict(for_request, incoming=key)
        page = heapq.heappop(self.free)
        self.ref_count[page] = 1
        self._used += 1
        self.touch(page)
        return page

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page, tail-first, so a request's tail pages are evicted before its head."""
        ref_count, key, hits, cached, touch = self.ref_count, self.key, self.hits, self.policy.cached, self.touch
        for page in reversed(pages):
            if ref_count[page] <= 0:
                raise RuntimeError(f"page {page} released more often than acquired")
            ref_count[page] -= 1
            touch(page)
            if ref_count[page] == 0:
                self._used -= 1
                if key[page] is not None:
                    cached(page, hits[page])
                else:
                    self._reset(page)
                    heapq.heappush(self.free, page)

    # ----- the prefix index -----------------------------------------------------------------------------
    def register(
        self,
        page: int,
        key: PageKey,
        tokens: Sequence[int],
        chain_pos: int,
        parent: PageKey | None = None,
        request: int | None = None,
        namespace: bytes | None = None,
    ) -> bool:
        """Index a page whose KV was just written by ``request``, chained after ``parent``, in ``namespace`` (as
        ``namespace_id`` names it; only its event carries it). False if the key is taken (another page already
        holds these tokens after this prefix)."""
        if self.ref_count[page] <= 0:
            raise RuntimeError(f"only an in-use page can be registered, page {page} is not")
        if self.key[page] is not None or key in self.index:
            return False
        token_ids = tuple(tokens)
        self.index[key] = page
        self.key[page] = key
        self.tokens[page] = token_ids
        self.chain_pos[page] = chain_pos
        self.parent_key[page] = parent
        self.stored_by[page] = request
        self.stats.stored += 1
        self.policy.stored(page, key, chain_pos)
        self.touch(page)
        if self._emit is not None:
            self._emit(
                PageStored,
                page=page,
                key=key,
                parent_key=parent,
                chain_pos=chain_pos,
                request=request,
                token_ids=token_ids,
                namespace=namespace,
            )
        return True

    def clear(self) -> int:
        """Empty the prefix cache: cached pages go free, in-use pages are unindexed. Returns pages freed."""
        freed = len(self.policy)
        for page in self.policy:
            heapq.heappush(self.free, page)
        for page in self.index.values():
            self._reset(page)
            self.touch(page)
        self.policy.clear()
        self.index.clear()
        return freed

    def evict(self, for_request: int | None = None, incoming: PageKey | None = None) -> int:
        """Evict the page the policy picks (one must be cached): its KV is forgotten and it goes free. Returns it.

        ``incoming``: the key of the page the eviction makes room for, if known (ARC's REPLACE reads it). The event
        says for which request (None: on demand) and how many pages were evictable then, it the first."""
        if not self.policy:
            raise MemoryError("no free or evictable page left")
        evictable = len(self.policy)
        page = self.policy.victim(incoming)
        key, parent, tokens, chain_pos = self.key[page], self.parent_key[page], self.tokens[page], self.chain_pos[page]
        if key is not None and self.index.get(key) == page:
            del self.index[key]
        self._reset(page)
        heapq.heappush(self.free, page)
        self.stats.evictions += 1
        self.touch(page)
        if self._emit is not None:
            self._emit(
                PageEvicted,
                page=page,
                key=key,
                parent_key=parent,
                token_ids=tokens or (),
                for_request=for_request,
                evictable=evictable,
            )
        if self.on_evict is not None and key is not None and tokens is not None:
            self.on_evict(page, key, tokens, parent, chain_pos)
        return page

    def _reset(self, page: int) -> None:
        self.key[page] = None
        self.tokens[page] = None
        self.chain_pos[page] = -1
        self.parent_key[page] = None
        self.stored_by[page] = None
        self.hits[page] = 0

    def touch(self, page: int) -> None:
        """Mark a page changed: its state, refs or key moved (here), or its KV grew (the engine says so)."""
        self.touched.pop(page, None)
        self.touched[page] = None

    # ----- introspection --------------------------------------------------------------------------------
    def take_touched(self) -> list[int]:
        """The pages changed since the last call, oldest change first; a page's moves in the policy keep this order."""
        pages = list(self.touched)
        self.touched.clear()
        return pages

    def lru_rank(self) -> dict[int, int]:
        """Eviction rank of each cached page under the pool's policy: 0 is the next to be evicted (the name is the
        LRU's, which the page records keep)."""
        return {page: rank for rank, page in enumerate(self.policy)}

    def check_invariants(self, live_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the structures disagree. Used by tests and the soak; O(n_pages)."""
        free, lru = set(self.free), set(self.policy)
        assert len(free) == len(self.free), "free list holds duplicates"
        assert len(lru) == len(self.policy), "the policy's count and its pages disagree"
        assert not free & lru, "a page is both free and cached"
        for page in range(self.n_pages):
            ref = self.ref_count[page]
            assert ref >= 0, f"page {page} has negative ref count"
            in_states = (page in free) + (page in lru) + (ref > 0)
            assert in_states == 1, f"page {page} is in {in_states} states"
            if page in lru:
                assert self.key[page] is not None, f"cached page {page} is not indexed"
            if page in free:
                assert self.key[page] is None, f"free page {page} still has a key"
            if live_refs is not None:
                assert ref == live_refs.get(page, 0), f"page {page}: ref {ref} != live refs {live_refs.get(page, 0)}"
        for key, page in self.index.items():
            assert self.key[page] == key, f"index entry for page {page} disagrees with the page"
        indexed = {p for p in range(self.n_pages) if self.key[p] is not None}
        assert indexed == set(self.index.values()), "pages with keys and the index differ"
        referenced = sum(ref > 0 for ref in self.ref_count)
        assert self.used_pages == referenced, f"used_pages {self.used_pages} != {referenced} referenced pages"
        assert self.free_pages + self.cached_pages + self.used_pages == self.n_pages, "the states do not add up"
