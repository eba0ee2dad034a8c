"""Per-request page bookkeeping on top of the pool: prefix lookup, allocation, registration, release.

Pages are registered in the prefix index only after the forward pass that wrote them. Within one step, a page
that an earlier-scheduled request is about to complete is "pending": a request admitted later in the same step
may share it, because attention writes every new K/V of a layer before any request reads. That is how prompts
submitted together compute their shared prefix once.

Hit accounting follows vLLM's ``PrefixCacheStats``: a request's prompt is counted once, at its first admission;
a preempted request that comes back is counted apart (``readmitted_*``), so the hit rate can never exceed 1. With
prefix caching off nothing is looked up, and nothing is counted: the counters stay 0 rather than show a 0% hit rate.

A second tier (``attach_tier``, ``astrai.tier``) continues the lookup: each page of the chain is looked up in the
pool, then among this step's pending pages, then in the tier, and the hit is the longest leading run found in any
of them, under the same cap. A tier's pages are read into fresh pool pages and registered there during the
admission, before the forward that reads them; they count as hits (and apart, in ``tier_hit_tokens``).
"""

from __future__ import annotations

from collections import deque

from astrai.page_pool import PageKey, PagePool, namespace_id, page_key
from astrai.request import Request
from astrai.tier import SecondTier, TierWrite, by_rank

HIT_WINDOW = 32  # lookups in the "recent" hit rate


class KVCacheManager:
    def __init__(self, pool: PagePool, prefix_caching: bool):
        self.pool = pool
        self.page_size = pool.page_size
        self.prefix_caching = prefix_caching
        self._pending: dict[PageKey, tuple[int, int]] = {}  # key -> (page, owner request id), this step only
        self.query_tokens = 0  # first admissions only
        self.hit_tokens = 0
        self.readmitted_query_tokens = 0  # admissions after a preemption
        self.readmitted_hit_tokens = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=HIT_WINDOW)
        self.tier: SecondTier | None = None
        self.tier_hit_tokens = 0  # of ``hit_tokens``, those the second tier served (first admissions)

    def attach_tier(self, tier: SecondTier) -> None:
        """Continue every lookup into ``tier`` and write pages to it as its write policy says: at registration
        (``commit``) for "through", as the pool evicts them (the pool's ``on_evict``) for "on_evict"."""
        if not self.prefix_caching:
            raise ValueError("a second tier needs prefix caching: with it off nothing is looked up")
        self.tier = tier
        if tier.write_policy == "on_evict":
            self.pool.on_evict = tier.evicted

    # ----- keys -----------------------------------------------------------------------------------------
    def _keys(self, req: Request, n_pages: int) -> list[PageKey]:
        """Chain keys of the request's first ``n_pages`` full pages, extending the memo as tokens allow."""
        keys, size = req.page_keys, self.page_size
        while len(keys) < n_pages:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else None, req.token_ids[i * size : (i + 1) * size], req.cache_salt))
        return keys[:n_pages]

    def _page_tokens(self, req: Request, i: int) -> list[int]:
        return req.token_ids[i * self.page_size : (i + 1) * self.page_size]

    # ----- admission ------------------------------------------------------------------------------------
    def admit(self, req: Request, token_budget: int) -> int:
        """Attach the longest cached prefix and allocate pages for the first chunk.

        Returns how many tokens to compute this step, or 0 when the pool cannot fit the chunk. The fit is checked
        before any page is taken, so a refused admission changes nothing: no ref, no LRU move, no page hit, no load
        from the second tier and no query counted (as in vLLM). A request waiting under pressure is looked up at
        every step, but only the admission that succeeds counts. The hit is capped at ``len(tokens) - 1``: the last
        token is always recomputed for its logits. Pages found in the second tier take fresh pool pages (counted in
        the fit) and are loaded into them here; if its store fails, the tier switches itself off, the pages this
        admission took are given back, and the lookup is made again without it.
        """
        hits, slots = self._match_prefix(req)
        hit = len(hits) * self.page_size
        count = min(len(req.token_ids) - hit, token_budget)
        shared = [page for page in hits if page is not None]
        need = self._pages_for(hit + count) - len(shared)
        revived = sum(self.pool.ref_count[page] == 0 for page in shared)  # cached hits leave the LRU: not evictable
        if need + revived > self.pool.available:
            return 0
        for page in shared:  # before any allocation: a shared cached page must not be evicted for a load
            self.pool.acquire(page)
        pages = self._load(req, hits, slots) if slots else shared
        if pages is None:  # its store failed: the tier is off now, so nothing is loaded
            self.pool.release(shared)
            return self.admit(req, token_budget)
        req.pages = pages
        self._allocate(req, need - len(slots))
        req.indexed_pages = len(hits)
        req.num_computed = hit
        readmission = req.cached_tokens is not None
        if not readmission:
            req.cached_tokens = hit
        if not self.prefix_caching:
            return count  # nothing was looked up, so no query and no hit is counted
        if readmission:
            self.readmitted_query_tokens += len(req.token_ids)
            self.readmitted_hit_tokens += hit
        else:  # the first admission: the one the hit rate counts
            self.query_tokens += req.prompt_len
            self.hit_tokens += hit
            self.tier_hit_tokens += len(slots) * self.page_size
            self._recent.append((req.prompt_len, hit))
        return count

    def _match_prefix(self, req: Request) -> tuple[list[int | None], list[int]]:
        """The hit: per leading page, its pool page (cached or pending), or None where the second tier holds it;
        and the tier's slots of those, in order."""
        if not self.prefix_caching:
            return [], []
        hits: list[int | None] = []
        slots: list[int] = []
        for i, key in enumerate(self._keys(req, (len(req.token_ids) - 1) // self.page_size)):
            tokens = self._page_tokens(req, i)
            page = self.pool.lookup(key, tokens)
            if page is None and key in self._pending:
                page = self._pending[key][0]
            if page is None:
                slot = self.tier.find(key, tokens) if self.tier is not None else None
                if slot is None:
                    break
                slots.append(slot)
            hits.append(page)
        return hits, slots

    def _load(self, req: Request, hits: list[int | None], slots: list[int]) -> list[int] | None:
        """``hits`` with a fresh pool page in place of each page the second tier holds (``slots``, in order), read
        from it and registered: the request's leading pages. None if the store failed (the fresh pages are freed)."""
        tier = self.tier
        assert tier is not None, "only a tier holds slots"
        keys = self._keys(req, len(hits))
        positions = [i for i, page in enumerate(hits) if page is None]
        tier.reserve(slots)  # before the allocations: their evictions may write to the tier, never over these
        fresh = [self.pool.allocate(req.id, keys[i]) for i in positions]  # named: the policy hears each miss first
        pages = by_rank(slots, fresh)  # the k-th lowest slot into the k-th lowest page: a run of slots stays one
        seconds = tier.load(slots, pages)
        if seconds is None:
            self.pool.release(fresh)
            return None
        namespace = namespace_id(req.cache_salt)
        for i, page in zip(positions, pages, strict=True):
            parent = keys[i - 1] if i else None
            stored = self.pool.register(page, keys[i], self._page_tokens(req, i), i, parent, req.id, namespace)
            assert stored, "a key the tier served is in no pool page"
        tier.loaded(slots, pages, req.id, seconds)
        loaded = iter(pages)
        return [page if page is not None else next(loaded) for page in hits]

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, req: Request, total_tokens: int) -> bool:
        """Make room for ``total_tokens`` of KV; all-or-nothing, so a failure leaves the request as it was."""
        need = self._pages_for(total_tokens) - len(req.pages)
        if need > self.pool.available:
            return False
        if need > 0:  # a decode step mostly has a page to write into already
            self._allocate(req, need)
        return True

    def _allocate(self, req: Request, need: int) -> None:
        """Append ``need`` fresh pages, each named to the pool by the chain key it will be registered under where its
        tokens are known to fill it (a prompt's full pages): the eviction policy hears of the miss before it picks a
        victim (ARC adapts to its ghosts so)."""
        first = len(req.pages)
        full = min(len(req.token_ids) // self.page_size, first + need) if self.prefix_caching else 0
        keys = self._keys(req, full) if full > first else []
        for i in range(first, first + need):
            req.pages.append(self.pool.allocate(req.id, keys[i] if i < full else None))

    def mark_pending(self, req: Request, total_tokens: int) -> None:
        """Offer the pages this step's forward will complete to requests admitted later in the same step."""
        first, last = req.indexed_pages, total_tokens // self.page_size
        if not self.prefix_caching or last <= first:  # most decode steps complete no page: no keys to build
            return
        for i, key in enumerate(self._keys(req, last)[first:], start=first):
            self._pending.setdefault(key, (req.pages[i], req.id))

    # ----- after the forward ----------------------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Register the request's pages that became full in this step's forward."""
        full = req.num_computed // self.page_size
        if self.prefix_caching and full > req.indexed_pages:  # most decode steps fill no page: no keys to build
            keys, namespace = self._keys(req, full), namespace_id(req.cache_salt)
            through = self.tier is not None and self.tier.write_policy == "through"
            written: list[TierWrite] = []
            for i in range(req.indexed_pages, full):
                parent = keys[i - 1] if i else None
                tokens = tuple(self._page_tokens(req, i))
                stored = self.pool.register(
                    req.pages[i], keys[i], tokens, i, parent, request=req.id, namespace=namespace
                )
                if stored and through:
                    written.append(TierWrite(req.pages[i], keys[i], tokens, parent, i))
            if written and self.tier is not None:
                self.tier.write(written)  # together: the pages of one commit go out in runs
        req.indexed_pages = max(req.indexed_pages, full)

    def end_step(self) -> None:
        self._pending.clear()

    def free(self, req: Request) -> None:
        """Release the request's pages tail-first. Its chain keys stay memoized for a later re-admission."""
        if self._pending:
            self._pending = {k: v for k, v in self._pending.items() if v[1] != req.id}
        self.pool.release(req.pages)
        req.pages = []
        req.num_computed = 0
        req.indexed_pages = 0

    # ----- stats ----------------------------------------------------------------------------------------
    def hit_rates(self) -> tuple[float, float]:
        """Token-weighted prefix hit rate of first admissions: cumulative, and over the last ``HIT_WINDOW``."""
        recent_q = sum(q for q, _ in self._recent)
        recent_h = sum(h for _, h in self._recent)
        return (
            self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            recent_h / recent_q if recent_q else 0.0,
        )

    def clear(self) -> int:
        """Empty the prefix cache, the second tier's pages included. Returns the pool's pages freed."""
        self._pending.clear()
        if self.tier is not None:
            self.tier.clear()
        return self.pool.clear()
