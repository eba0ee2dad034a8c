"""``SecondTier``: full pages the pool stored or evicted live on in a larger, slower store, and load back from it.

Bookkeeping mirrors the pool's: a slot of the store holds one full page's KV under its chain key (``page_key``) and
tokens (compared again at lookup, so a hash collision never serves wrong KV); an index maps keys to slots; a free
list (a min-heap) and an eviction policy of ``astrai.eviction`` (LRU: ``POLICIES["lru"]``) order the slots held.
Every slot held is evictable: a load copies the page out at once (``take``), so nothing pins a slot.

Write policies (``write_policy``):

* ``"through"``: every page the pool stores (registers after the forward that wrote it) is written here too, and is
  touched as most recent again whenever a lookup loads it;
* ``"on_evict"``: a page is written when the pool evicts it, and leaves this tier when a lookup loads it back.

A key already held is not written again (it is touched). Nothing here takes a lock: the engine's loop thread drives
it under the engine's lock, between forwards, so the KV pages it copies are not being written.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from astrai.eviction import make_policy
from astrai.observation import TierPageEvicted, TierPageLoaded, TierPageWritten
from astrai.tier.store import TierStore

if TYPE_CHECKING:
    from astrai.page_pool import Emit, PageKey

log = logging.getLogger("astrai")

WritePolicy = Literal["through", "on_evict"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("through", "on_evict")


class KvPages(Protocol):
    """The engine's KV pages as the tier copies them (``ModelRunner``): one page at a time, to and from a host
    buffer of ``page_bytes`` bytes."""

    def page_buffer(self, count: int) -> torch.Tensor:
        """``count`` host buffers of one page each, stacked on the first dimension (contiguous)."""
        ...

    def copy_page_out(self, page: int, out: torch.Tensor) -> None:
        """Copy KV page ``page`` (every layer's K and V) into ``out``, one page's buffer."""
        ...

    def copy_page_in(self, page: int, src: torch.Tensor) -> None:
        """Write ``src``, one page's buffer, into KV page ``page``."""
        ...


@dataclass
class TierCounters:
    """What the tier did, counted as it happened; they only grow."""

    written_pages: int = 0
    loaded_pages: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_loaded: int = 0
    write_seconds: float = 0.0
    load_seconds: float = 0.0  # reading the store and copying into the pool's pages


@dataclass(frozen=True)
class Staged:
    """A page taken from the tier for one lookup: its KV in a host buffer, to go into a pool page (``install``)."""

    slot: int
    key: PageKey
    buffer: torch.Tensor
    read_seconds: float


class SecondTier:
    """The second tier over one ``TierStore``; see the module docstring.

    Invariant (``check_invariants``): every slot is free (in ``free``, no key) or held (indexed, in the policy),
    never both, and ``free + held == slots``. The policy hears the events a pool sends its own (a slot is a page to
    it: ``missed`` before a write takes a slot, ``stored`` and ``cached`` once written, ``hit`` and ``cached`` again
    when a load or a write touches it), so any policy of ``astrai.eviction`` can order the slots.
    """

    def __init__(
        self,
        store: TierStore,
        kv: KvPages,
        write_policy: str = "through",
        emit: Emit | None = None,
        eviction: str = "lru",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"offload_policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
        self.store, self._kv, self._emit = store, kv, emit
        self.write_policy: WritePolicy = write_policy
        self.n_pages = store.slots
        self.key: list[PageKey | None] = [None] * store.slots
        self.tokens: list[tuple[int, ...] | None] = [None] * store.slots
        self.parent_key: list[PageKey | None] = [None] * store.slots
        self.hits = [0] * store.slots  # loads served since written (an LFU policy's order)
        self.index: dict[PageKey, int] = {}
        self.free: list[int] = list(range(store.slots))  # a heap
        self.policy = make_policy(eviction, store.slots)  # the slots held, in eviction order
        self.counters = TierCounters()
        self.enabled = True
        self.error: str | None = None
        self._write_buffer = kv.page_buffer(1)[0]

    @property
    def held_pages(self) -> int:
        return len(self.policy)

    # ----- lookup and load --------------------------------------------------------------------------
    def find(self, key: PageKey, tokens: Sequence[int]) -> int | None:
        """The slot holding exactly these tokens under this key, or None (always None once switched off)."""
        slot = self.index.get(key) if self.enabled else None
        if slot is None or self.tokens[slot] != tuple(tokens):
            return None
        return slot

    def take(self, slots: Sequence[int]) -> list[Staged] | None:
        """Read these slots' pages into host buffers for one lookup, in order; None if the store failed (the tier is
        off then: the caller computes those pages). Under ``on_evict`` the slots leave the tier; under ``through``
        they are touched as most recent (the last slot first, so a chain's head stays the most recent)."""
        buffers = self._kv.page_buffer(len(slots))
        staged: list[Staged] = []
        for slot, buffer in zip(slots, buffers, strict=True):
            started = time.perf_counter()
            try:
                self.store.read(slot, buffer)
            except Exception as exc:  # noqa: BLE001 - any store failure switches the tier off, never the request
                self._switch_off("reading", exc)
                return None
            key = self.key[slot]
            assert key is not None, "a slot found by a lookup is held"
            staged.append(Staged(slot, key, buffer, time.perf_counter() - started))
        for slot in reversed(slots):
            self.policy.hit(slot)
            self.hits[slot] += 1
            if self.write_policy == "on_evict":
                self._forget(slot)
            else:
                self.policy.cached(slot, self.hits[slot])
        return staged

    def install(self, page: int, staged: Staged, request: int | None) -> None:
        """Copy a staged page into pool page ``page`` (the caller registers it in the pool) and count the load."""
        started = time.perf_counter()
        self._kv.copy_page_in(page, staged.buffer)
        seconds = staged.read_seconds + time.perf_counter() - started
        counters = self.counters
        counters.loaded_pages += 1
        counters.bytes_loaded += self.store.page_bytes
        counters.load_seconds += seconds
        if self._emit is not None:
            self._emit(
                TierPageLoaded,
                page=page,
                key=staged.key,
                slot=staged.slot,
                request=request,
                nbytes=self.store.page_bytes,
                seconds=seconds,
                kept=self.write_policy == "through",
            )

    # ----- writes -----------------------------------------------------------------------------------
    def write(self, page: int, key: PageKey, tokens: Sequence[int], parent: PageKey | None, chain_pos: int) -> None:
        """Copy pool page ``page`` (full, indexed under ``key`` at ``chain_pos``) into the tier: a free slot, else the
        policy's victim. A key already held is touched instead; nothing happens once the tier is off."""
        if not self.enabled:
            return
        held = self.index.get(key)
        if held is not None:
            self.policy.hit(held)
            self.policy.cached(held, self.hits[held])
            return
        started = time.perf_counter()
        self.policy.missed(key)
        slot = heapq.heappop(self.free) if self.free else self._evict(key)
        try:
            self._kv.copy_page_out(page, self._write_buffer)
            self.store.write(slot, self._write_buffer)
        except Exception as exc:  # noqa: BLE001 - see ``take``
            heapq.heappush(self.free, slot)
            self._switch_off("writing", exc)
            return
        token_ids = tuple(tokens)
        self.index[key] = slot
        self.key[slot], self.tokens[slot], self.parent_key[slot] = key, token_ids, parent
        self.hits[slot] = 0
        self.policy.stored(slot, key, chain_pos)
        self.policy.cached(slot, 0)
        counters = self.counters
        counters.written_pages += 1
        counters.bytes_written += self.store.page_bytes
        counters.write_seconds += time.perf_counter() - started
        if self._emit is not None:
            self._emit(
                TierPageWritten,
                page=page,
                key=key,
                parent_key=parent,
                token_ids=token_ids,
                slot=slot,
                nbytes=self.store.page_bytes,
            )

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
        """Forget every page (the engine's ``clear()``: a cleared cache is cleared in both tiers). Returns them."""
        held = list(self.policy)
        self.policy.clear()
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
        free, held = set(self.free), set(self.policy)
        assert len(free) == len(self.free), "a slot is free twice"
        assert not free & held, "a slot is both free and held"
        assert len(free) + len(held) == self.n_pages, "the slots do not add up"
        assert set(self.index.values()) == held, "the index and the held slots differ"
        for key, slot in self.index.items():
            assert self.key[slot] == key, f"slot {slot}'s key disagrees with the index"
        for slot in free:
            assert self.key[slot] is None, f"free slot {slot} still has a key"
