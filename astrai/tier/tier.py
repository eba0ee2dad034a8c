"""``SecondTier``: full pages the pool stored or evicted live on in a larger, slower store, and load back from it.

Bookkeeping mirrors the pool's: a slot of the store holds one full page's KV under its chain key (``page_key``) and
tokens (compared again at lookup, so a hash collision never serves wrong KV); an index maps keys to slots; a free
list (a min-heap) and an eviction policy of ``astrai.eviction`` (LRU: ``POLICIES["lru"]``) order the slots held.
A slot held is evictable except while a lookup loads it (``reserve`` to ``loaded``, within one admission): the
pool's evictions that make room for the load may write pages here, and must not take the slots being read.

Pages move in runs (``store.py``): consecutive slots to or from consecutive pool pages, in as few copies or system
calls as the store's layout allows, whatever the run's length. So the pages of one load or one write are paired
lowest slot to lowest page (``by_rank``): the pool's pages for a load are fresh, and a write's slots are free or
evicted ones, so any pairing is correct, and this one keeps runs whole wherever both sides are consecutive (a chain
written together, or evicted tail first into the free list's lowest slots, loads back as one run).

Write policies (``write_policy``):

* ``"through"``: every page the pool stores (registers after the forward that wrote it) is written here too, and is
  touched as most recent again whenever a lookup loads it;
* ``"on_evict"``: a page is written when the pool evicts it, and leaves this tier when a lookup loads it back.

A key already held is not written again (it is touched). Pages written together become evictable tail first, as the
pool releases a request's pages, so a chain's head is its most recent page here too. Nothing here takes a lock: the
engine's loop thread drives it under the engine's lock, between forwards, so the KV pages it copies are not being
written.

Failure: any error of the store after construction (a disk that filled up, an I/O error) switches the tier off
(``enabled`` False, ``error`` says why, a warning is logged): it answers no lookup and takes no page from then on,
so a request never fails because of it; the requests that would have loaded compute instead.

Events (``emit``, the engine's): ``TierPageWritten`` when a page is written, ``TierPageLoaded`` when one is loaded
into a pool page, ``TierPageEvicted`` when the policy takes a slot for another page.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from astrai.eviction import make_policy
from astrai.observation import TierPageEvicted, TierPageLoaded, TierPageWritten

if TYPE_CHECKING:  # types only: the lab replays through the tier without importing torch
    import torch

    from astrai.page_pool import Emit, PageKey
    from astrai.tier.store import TierStore

log = logging.getLogger("astrai")

WritePolicy = Literal["through", "on_evict"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("through", "on_evict")


@dataclass(frozen=True, slots=True)
class TierWrite:
    """A full, indexed pool page to keep in the tier: its page, chain key, tokens, parent's key and chain position."""

    page: int
    key: PageKey
    tokens: tuple[int, ...]
    parent: PageKey | None
    chain_pos: int


def by_rank(items: Sequence[int], partners: Sequence[int]) -> list[int]:
    """The partner of each item, in ``items``' order: the k-th lowest item gets the k-th lowest partner."""
    order = sorted(range(len(items)), key=items.__getitem__)
    out = [0] * len(items)
    for i, partner in zip(order, sorted(partners), strict=True):
        out[i] = partner
    return out


def runs(slots: Sequence[int], pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(first_slot, first_page, count)`` of the maximal runs where both slots and pages go up by one, in slot
    order."""
    pairs = sorted(zip(slots, pages, strict=True))
    i = 0
    while i < len(pairs):
        slot, page = pairs[i]
        count = 1
        while i + count < len(pairs) and pairs[i + count] == (slot + count, page + count):
            count += 1
        yield slot, page, count
        i += count


@dataclass
class TierCounters:
    """What the tier did, counted as it happened; they only grow."""

    written_pages: int = 0
    loaded_pages: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_loaded: int = 0
    write_seconds: float = 0.0
    load_seconds: float = 0.0  # reading the store into the pool's pages


class SecondTier:
    """The second tier over one ``TierStore``, bound to the pool's KV ``planes`` (``ModelRunner.kv_planes``); see
    the module docstring.

    Invariant (``check_invariants``): every slot is free (in ``free``, no key) or held (indexed), never both, and
    ``free + held == slots``; a held slot is in the policy or reserved for a load, never both. The policy hears the
    events a pool sends its own (a slot is a page to it: ``missed`` before a write takes a slot, ``stored`` and
    ``cached`` once written, ``hit`` when a load reserves it or a write touches it, ``cached`` again after), so any
    policy of ``astrai.eviction`` can order the slots.
    """

    def __init__(
        self,
        store: TierStore,
        planes: Sequence[torch.Tensor],
        write_policy: str = "through",
        emit: Emit | None = None,
        eviction: str = "lru",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"offload_policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
        store.bind(planes)
        self.store, self._emit = store, emit
        self.write_policy: WritePolicy = write_policy
        self.n_pages = store.slots
        self.key: list[PageKey | None] = [None] * store.slots
        self.tokens: list[tuple[int, ...] | None] = [None] * store.slots
        self.parent_key: list[PageKey | None] = [None] * store.slots
        self.hits = [0] * store.slots  # loads served since written (an LFU policy's order)
        self.index: dict[PageKey, int] = {}
        self.free: list[int] = list(range(store.slots))  # a heap
        self.policy = make_policy(eviction, store.slots)  # the slots held and not reserved, in eviction order
        self.reserved: set[int] = set()  # held slots a load is reading: out of the policy until ``loaded``
        self.counters = TierCounters()
        self.enabled = True
        self.error: str | None = None

    @property
    def held_pages(self) -> int:
        return len(self.index)

    # ----- lookup and load --------------------------------------------------------------------------
    def find(self, key: PageKey, tokens: Sequence[int]) -> int | None:
        """The slot holding exactly these tokens under this key, or None (always None once switched off)."""
        slot = self.index.get(key) if self.enabled else None
        if slot is None or self.tokens[slot] != tuple(tokens):
            return None
        return slot

    def reserve(self, slots: Sequence[int]) -> None:
        """Take these slots (found for one lookup) out of the eviction order until ``loaded``: the pool's evictions
        that make room for their pages may write here, and must not take them."""
        for slot in slots:
            self.policy.hit(slot)
            self.reserved.add(slot)

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> float | None:
        """Read each reserved slot into its pool page (paired ``by_rank``, the runs stay whole); the seconds it took, or
        None if the store failed (the tier is off then, its slots forgotten: the caller computes those pages)."""
        started = time.perf_counter()
        try:
            for run in runs(slots, pages):
                self.store.read(*run)
        except Exception as exc:  # noqa: BLE001 - any store failure switches the tier off, never the request
            self._switch_off("reading", exc)
            return None
        return time.perf_counter() - started

    def loaded(self, slots: Sequence[int], pages: Sequence[int], request: int | None, seconds: float) -> None:
        """Count a ``load`` whose pool pages are registered now, and end the slots' reservation: under ``on_evict``
        they leave the tier; under ``through`` they are touched as most recent (the last first, so a chain's head is
        the most recent)."""
        page_bytes, kept = self.store.page_bytes, self.write_policy == "through"
        counters = self.counters
        counters.loaded_pages += len(slots)
        counters.bytes_loaded += len(slots) * page_bytes
        counters.load_seconds += seconds
        if self._emit is not None:
            share = seconds / len(slots)  # a run is read whole, not page by page: each page takes its share
            for slot, page in zip(slots, pages, strict=True):
                key = self.key[slot]
                assert key is not None, "a reserved slot is held"
                self._emit(
                    TierPageLoaded,
                    page=page,
                    key=key,
                    slot=slot,
                    request=request,
                    nbytes=page_bytes,
                    seconds=share,
                    kept=kept,
                )
        for slot in reversed(slots):
            self.reserved.discard(slot)
            self.hits[slot] += 1
            if kept:
                self.policy.cached(slot, self.hits[slot])
            else:
                self._forget(slot)

    # ----- writes -----------------------------------------------------------------------------------
    def evicted(self, page: int, key: PageKey, tokens: tuple[int, ...], parent: PageKey | None, pos: int) -> None:
        """The pool's ``on_evict``: keep the page it just evicted (its KV still intact)."""
        self.write([TierWrite(page, key, tokens, parent, pos)])

    def write(self, pages: Sequence[TierWrite]) -> None:
        """Copy these pool pages (full, indexed, one chain's in chain order where they are one's) into the tier:
        free slots, else the policy's victims. A key already held is touched instead; where every held slot is
        reserved by a load and none is free, the rest are not kept. Nothing happens once the tier is off."""
        if not self.enabled:
            return
        fresh: list[TierWrite] = []
        for entry in pages:
            held = self.index.get(entry.key)
            if held is None:
                fresh.append(entry)
            elif held not in self.reserved:
                self.policy.hit(held)
                self.policy.cached(held, self.hits[held])
        slots: list[int] = []
        for entry in fresh:
            self.policy.missed(entry.key)
            if self.free:
                slots.append(heapq.heappop(self.free))
            elif self.policy:
                slots.append(self._evict(entry.key))
            else:
                break
        if not slots:
            return
        fresh = fresh[: len(slots)]
        slots = by_rank([entry.page for entry in fresh], slots)  # lowest page to lowest slot, as a load pairs them
        started = time.perf_counter()
        try:
            for run in runs(slots, [entry.page for entry in fresh]):
                self.store.write(*run)
        except Exception as exc:  # noqa: BLE001 - see ``load``
            for slot in slots:
                heapq.heappush(self.free, slot)
            self._switch_off("writing", exc)
            return
        counters = self.counters
        counters.write_seconds += time.perf_counter() - started
        counters.written_pages += len(fresh)
        counters.bytes_written += len(fresh) * self.store.page_bytes
        for slot, entry in zip(slots, fresh, strict=True):
            self.index[entry.key] = slot
            self.key[slot], self.tokens[slot], self.parent_key[slot] = entry.key, entry.tokens, entry.parent
            self.hits[slot] = 0
            self.policy.stored(slot, entry.key, entry.chain_pos)
            if self._emit is not None:
                self._emit(
                    TierPageWritten,
                    page=entry.page,
                    key=entry.key,
                    parent_key=entry.parent,
                    token_ids=entry.tokens,
                    slot=slot,
                    nbytes=self.store.page_bytes,
                )
        for slot in reversed(slots):
            self.policy.cached(slot, 0)

    def _evict(self, incoming: PageKey) -> int:
        slot = self.policy.victim(incoming)
        key, parent, tokens = self.key[slot], self.parent_key[slot], self.tokens[slot]
        assert key is not None and tokens is not None, "a slot the policy holds is indexed"
        del self.index[key]
        self._reset(slot)
        self.counters.evictions += 1
        if self._emit is not None:
            self._emit(TierPageEvicted, key=key, parent_key=parent, token_ids=tokens, slot=slot)
        return slot

    # ----- the tier as a whole ----------------------------------------------------------------------
    def clear(self) -> int:
        """Forget every page (the engine's ``clear()``: a cleared cache is cleared in both tiers; reserved slots
        too). Returns them."""
        held = list(self.index.values())
        self.policy.clear()
        self.reserved.clear()
        for slot in held:
            self._forget(slot)
        return len(held)

    def close(self) -> None:
        self.store.close()

    def _forget(self, slot: int) -> None:
        """Unindex a slot the policy no longer holds and free it."""
        key = self.key[slot]
        assert key is not None, "only a held slot is forgotten"
        del self.index[key]
        self._reset(slot)
        heapq.heappush(self.free, slot)

    def _reset(self, slot: int) -> None:
        self.key[slot] = self.tokens[slot] = self.parent_key[slot] = None
        self.hits[slot] = 0

    def _switch_off(self, doing: str, exc: BaseException) -> None:
        self.enabled = False
        self.error = f"{doing} the {self.store.medium} store failed: {exc!r}"
        log.warning("astrai: the second tier is switched off (%s); requests compute what it held", self.error)
        self.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError where the slots' states disagree; O(slots), for tests."""
        free, evictable, held = set(self.free), set(self.policy), set(self.index.values())
        assert len(free) == len(self.free), "a slot is free twice"
        assert len(held) == len(self.index), "a slot is indexed twice"
        assert not free & held, "a slot is both free and held"
        assert len(free) + len(held) == self.n_pages, "the slots do not add up"
        assert not evictable & self.reserved and evictable | self.reserved == held, "evictable + reserved != held"
        for key, slot in self.index.items():
            assert self.key[slot] == key, f"slot {slot}'s key disagrees with the index"
        for slot in free:
            assert self.key[slot] is None, f"free slot {slot} still has a key"
