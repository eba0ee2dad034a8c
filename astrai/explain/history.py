"""``KeyHistory``: what each replica's prefix cache held and when, rebuilt incrementally from observation events.

It reads only ``EngineEvent``s (the engine's, or the vLLM backend's ``PageStored`` / ``PageEvicted`` /
``CacheCleared``, which carry no request events), never a pool. Per stored key it keeps the chain it sits on (its
parent key, or for a chain's first page its namespace), its tokens, and its stays in the cache: stored (seq, step,
by which request) and ended (evicted for which request, or cleared). Per request it keeps its first admission: the
lookup's moment, its namespace, and its re-admissions. The explainer (``explainer.py``) asks it questions "as of" a
lookup's moment, so a page stored after the lookup (by the request's own earlier chunk, say) never reads as cached.

Invariants and bounds:

* One ``seq`` counter for everything fed (an engine's own; a fleet's one clock): an event at or below ``last_seq``
  was fed already and is skipped, so overlapping reads are harmless; one above ``last_seq + 1`` means events were
  lost (the engine's ring of ``event_log_size`` overflowed between two reads). That gap is recorded, and every
  answer a lost event could change says "events lost" rather than guess.
* At most ``max_keys`` keys are kept: past it, the evicted or cleared key whose last stay ended first is dropped.
  Keys of cached pages are never dropped, so every hit can name its storer; they are at most ``max_live`` per
  replica (its pool's pages), so the history never holds more than ``max_keys + max_live`` keys per replica,
  whatever was lost. A store past ``max_live`` proves an eviction was lost: the stay stored first among the cached
  ends there, ``lost`` (its end is unknown; an answer resting on it says "events lost"). Of each key the last
  ``LIVES_KEPT`` stays are kept.
* A dropped key leaves a fingerprint (a hash of its parent and tokens; the newest ``FINGERPRINTS_PER_KEY *
  max_keys``), so a page that was stored before the kept history reads "forgotten", while one never stored still
  reads new. A fingerprint dropped in turn is the history's horizon: a page stored only before it reads new, as far
  as the history goes back (the causes view says so). No lookup is tainted for good by the bound, so a Space that
  has run for weeks still tells a new prompt from an unknown one.
  First admissions: the newest ``max_requests``.
* A second tier (``astrai.tier``): a key's stays there (written, then evicted, or given up to the pool by a load)
  are kept beside its stays in the pool, the last ``LIVES_KEPT``, so a miss can read "evicted from both"; a pool stay
  that a load from the tier began is marked ``loaded``.
* Each event costs O(1) amortized (a clear: O(pages it ends)): the indexes are dicts by node, so dropping a key
  never scans its siblings.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from astrai.explain.records import Unknown
from astrai.observation import (
    CacheCleared,
    EngineEvent,
    PageEvicted,
    PageStored,
    RequestAdmitted,
    TierPageEvicted,
    TierPageLoaded,
    TierPageWritten,
)

LIVES_KEPT = 8  # stays kept per key: a lookup older than a key's kept stays is answered "forgotten"
FINGERPRINTS_PER_KEY = 4  # dropped keys remembered by fingerprint, per key kept (about 90 bytes each)

Tokens = tuple[int, ...]
Parent = tuple[int, bytes | None, bytes | None]  # (replica, parent key, namespace of a chain's first page)
Node = tuple[int, bytes]  # (replica, key): one record
Records = dict[Node, "KeyRecord"]  # records by node, in the order stored: removing one is O(1)

_NONE: Records = {}
_NO_CHILDREN: Mapping[Tokens, Records] = {}
_K = TypeVar("_K")


@dataclass(slots=True)
class Life:
    """One stay of a key in the cache. ``end_seq`` None: still cached."""

    stored_seq: int
    stored_step: int
    request: int | None
    end_seq: int | None = None
    end_step: int | None = None
    cleared: bool = False
    evicted_for: int | None = None
    evictable: int | None = None
    lost: bool = False  # ended by no event seen: ``max_live`` proved it gone by ``end_seq``, its true end is unknown
    loaded: bool = False  # its KV was loaded from the second tier for its storer's lookup, not computed


@dataclass(slots=True)
class TierStay:
    """One stay of a key in the second tier. ``end_seq`` None: still there."""

    written_seq: int
    end_seq: int | None = None
    evicted: bool = False  # ended by the tier's own eviction (else by a load that gave it to the pool)


@dataclass(slots=True)
class KeyRecord:
    """One key of one replica: where it sits in its chain, its tokens, and its kept stays, oldest first."""

    replica: int
    key: bytes
    parent: Parent
    tokens: Tokens
    namespace: bytes | None  # a first page's namespace; None for later pages, or where not reported
    lives: list[Life] = field(default_factory=list)
    dropped_from: int | None = None  # stays stored from this seq on, before the kept ones, were dropped
    tier_stays: list[TierStay] = field(default_factory=list)  # in the second tier, oldest first

    def evicted_from_tier_before(self, at: int) -> bool:
        """Whether the last stay in the second tier written before ``at`` was ended by its eviction before ``at``."""
        for stay in reversed(self.tier_stays):
            if stay.written_seq < at:
                return stay.evicted and stay.end_seq is not None and stay.end_seq < at
        return False

    def forgotten_before(self, at: int) -> bool:
        """Whether a dropped stay may have been the one in cache before ``at`` (no kept stay is stored before it)."""
        return self.dropped_from is not None and self.dropped_from < at and self.lives[0].stored_seq >= at

    def covering(self, at: int) -> Life | None:
        """The stay that held the page at lookup moment ``at``: stored before it, not ended before it."""
        for life in reversed(self.lives):
            if life.stored_seq < at:
                return life if life.end_seq is None or life.end_seq >= at else None
        return None

    def ended_before(self, at: int) -> Life | None:
        """The last stay stored and ended before ``at``, unless another stay covers ``at``."""
        for life in reversed(self.lives):
            if life.stored_seq < at:
                return life if life.end_seq is not None and life.end_seq < at else None
        return None

    def first_after(self, at: int) -> Life | None:
        """The first stay stored at or after ``at``."""
        found = None
        for life in reversed(self.lives):
            if life.stored_seq < at:
                break
            found = life
        return found


@dataclass(slots=True)
class Admission:
    """A request's first admission. ``seq``: its lookup moment (events below it happened before the lookup)."""

    request: int
    seq: int
    step: int
    replica: int
    cached_tokens: int
    namespace: bytes | None
    readmissions: int = 0
    readmitted_cached_tokens: int = 0  # prompt and output tokens the cache served back at re-admissions


class KeyHistory:
    """The prefix caches' history, fed in ``seq`` order; bounded (see the module docstring). Not thread-safe: its
    owner feeds and reads it under one lock."""

    def __init__(self, max_keys: int = 16384, max_requests: int = 4096, max_live: int | None = None) -> None:
        """``max_live``: the most pages a replica's cache can hold (None: not known, no bound on cached keys)."""
        if max_keys < 1 or max_requests < 1:
            raise ValueError(f"max_keys and max_requests must be >= 1, got {max_keys} and {max_requests}")
        if max_live is not None and max_live < 1:
            raise ValueError(f"max_live must be >= 1 or None, got {max_live}")
        self.max_keys = max_keys
        self.max_live = max_live
        self.max_requests = max_requests
        self.last_seq = 0
        self.gaps = 0  # how many times events were lost
        self.first_gap: tuple[int, int] | None = None  # (last seq read, next seq read) around the first loss
        self.forgotten = 0  # keys dropped by the bound
        self._dropped: OrderedDict[int, int] = OrderedDict()  # fingerprint of a dropped key -> its first stored seq
        self.namespaces_known = True  # False once a chain's first page came without its namespace (vLLM)
        self._records: Records = {}
        self._children: dict[Parent, dict[Tokens, Records]] = {}
        self._by_first: dict[tuple[Parent, int], Records] = {}  # children by their first token
        self._roots: dict[Tokens, Records] = {}  # first pages by tokens: every replica, every namespace
        self._live: dict[int, dict[bytes, KeyRecord]] = {}  # per replica: the keys cached now, in the order stored
        self._dead: OrderedDict[Node, None] = OrderedDict()  # not cached, by the end of their last stay
        self._admissions: OrderedDict[int, Admission] = OrderedDict()
        self._evicting: dict[int, int] = {}  # request -> first seq of an eviction for it, this step, before admission
        self._evicting_step = 0

    # ----- feeding ----------------------------------------------------------------------------------
    def feed(self, events: Iterable[EngineEvent], replica: int = 0) -> None:
        """Apply events of one replica, oldest first; those fed already are skipped, a gap is noted."""
        for event in events:
            self.feed_one(event, replica)

    def feed_fleet(self, per_replica: Sequence[Iterable[EngineEvent]]) -> None:
        """Apply several replicas' events numbered by one clock (a fleet's samplers share it): replica ``r`` is the
        ``r``-th list. They are merged by ``seq``, so a gap is one in the fleet's shared order."""
        tagged = [[(event.seq, r, event) for event in events] for r, events in enumerate(per_replica)]
        for _, replica, event in heapq.merge(*tagged, key=lambda t: (t[0], t[1])):
            self.feed_one(event, replica)

    def feed_one(self, event: EngineEvent, replica: int = 0) -> None:
        """Apply one event of ``replica`` (``feed``'s step): skipped if fed already, a gap noted."""
        if event.seq <= self.last_seq:
            return
        if event.seq != self.last_seq + 1:
            self.gaps += 1
            self.first_gap = self.first_gap or (self.last_seq, event.seq)
        self.last_seq = event.seq
        if isinstance(event, PageStored):
            self._stored(event, replica)
        elif isinstance(event, PageEvicted):
            self._evicted(event, replica)
        elif isinstance(event, CacheCleared):
            self._cleared(event, replica)
        elif isinstance(event, RequestAdmitted):
            self._admitted(event, replica)
        elif isinstance(event, (TierPageWritten, TierPageLoaded, TierPageEvicted)):
            self._tier(event, replica)

    def _stored(self, event: PageStored, replica: int) -> None:
        node = (replica, event.key)
        record = self._records.get(node)
        if record is None:
            if event.parent_key is None and event.namespace is None:
                self.namespaces_known = False
            namespace = event.namespace if event.parent_key is None else None
            parent: Parent = (replica, event.parent_key, namespace)
            record = KeyRecord(replica, event.key, parent, event.token_ids, namespace)
            record.dropped_from = self._dropped.pop(_fingerprint(parent, record.tokens), None)
            self._records[node] = record
            self._children.setdefault(parent, {}).setdefault(record.tokens, {})[node] = record
            if record.tokens:
                self._by_first.setdefault((parent, record.tokens[0]), {})[node] = record
            if event.parent_key is None:
                self._roots.setdefault(record.tokens, {})[node] = record
        elif record.lives and record.lives[-1].end_seq is None:
            return  # cached already: a second store of one key changes nothing
        record.lives.append(Life(event.seq, event.step, event.request))
        if len(record.lives) > LIVES_KEPT:
            dropped = record.lives.pop(0).stored_seq
            record.dropped_from = dropped if record.dropped_from is None else record.dropped_from
        live = self._live.setdefault(replica, {})
        live[event.key] = record
        self._dead.pop(node, None)
        if self.max_live is not None and len(live) > self.max_live:  # an eviction was lost: end the oldest stay
            key = next(iter(live))
            lost = live.pop(key).lives[-1]
            self._end(lost, event)
            lost.lost = True
            self._dead[(replica, key)] = None
        while len(self._records) > self.max_keys and self._dead:
            self._drop(self._dead.popitem(last=False)[0])

    @staticmethod
    def _end(life: Life, event: EngineEvent) -> None:
        life.end_seq, life.end_step = event.seq, event.step

    def _evicted(self, event: PageEvicted, replica: int) -> None:
        if event.for_request is not None and event.for_request not in self._admissions:
            if event.step != self._evicting_step:
                self._evicting.clear()
                self._evicting_step = event.step
            self._evicting.setdefault(event.for_request, event.seq)  # its admission's own allocation
        record = self._live.get(replica, {}).pop(event.key, None)
        if record is None:
            return  # stored before the history began: its stay is unknown, the gap says so
        life = record.lives[-1]
        self._end(life, event)
        life.evicted_for, life.evictable = event.for_request, event.evictable
        self._dead[(replica, event.key)] = None

    def _tier(self, event: TierPageWritten | TierPageLoaded | TierPageEvicted, replica: int) -> None:
        """A key's stay in the second tier begins (written) or ends (evicted, or loaded and not kept); a load marks
        the pool stay it began (its ``PageStored`` came before)."""
        record = self._records.get((replica, event.key))
        if record is None:
            return  # not in the kept history: its pool stays are unknown too
        stays = record.tier_stays
        if isinstance(event, TierPageWritten):
            stays.append(TierStay(event.seq))
            del stays[:-LIVES_KEPT]
            return
        if isinstance(event, TierPageLoaded) and record.lives and record.lives[-1].end_seq is None:
            record.lives[-1].loaded = True
        if stays and stays[-1].end_seq is None and not (isinstance(event, TierPageLoaded) and event.kept):
            stays[-1].end_seq = event.seq
            stays[-1].evicted = isinstance(event, TierPageEvicted)

    def _cleared(self, event: CacheCleared, replica: int) -> None:
        live = self._live.pop(replica, {})
        for key, record in live.items():
            life = record.lives[-1]
            self._end(life, event)
            life.cleared = True
            self._dead[(replica, key)] = None

    def _admitted(self, event: RequestAdmitted, replica: int) -> None:
        known = self._admissions.get(event.request)
        if event.readmission:
            if known is not None:
                known.readmissions += 1
                known.readmitted_cached_tokens += event.cached_tokens + event.cached_output_tokens
            return
        if known is not None:
            return
        lookup = event.seq
        if self._evicting_step == event.step:
            lookup = min(lookup, self._evicting.pop(event.request, lookup))
        self._admissions[event.request] = Admission(
            event.request, lookup, event.step, replica, event.cached_tokens, event.namespace
        )
        while len(self._admissions) > self.max_requests:
            self._admissions.popitem(last=False)

    def _drop(self, node: Node) -> None:
        record = self._records.pop(node)
        siblings = self._children[record.parent]
        _unindex(siblings, record.tokens, node)
        if not siblings:
            del self._children[record.parent]
        if record.tokens:
            _unindex(self._by_first, (record.parent, record.tokens[0]), node)
        if record.parent[1] is None:
            _unindex(self._roots, record.tokens, node)
        self.forgotten += 1
        stored = record.lives[0].stored_seq if record.dropped_from is None else record.dropped_from
        self._dropped[_fingerprint(record.parent, record.tokens)] = stored
        while len(self._dropped) > FINGERPRINTS_PER_KEY * self.max_keys:
            self._dropped.popitem(last=False)

    # ----- reading ----------------------------------------------------------------------------------
    def children(self, parent: Parent, tokens: Tokens) -> Collection[KeyRecord]:
        """The keys ever stored (and kept) after ``parent`` with these tokens."""
        return self._children.get(parent, _NO_CHILDREN).get(tokens, _NONE).values()

    def all_children(self, parent: Parent) -> Iterator[KeyRecord]:
        """Every key ever stored (and kept) after ``parent``."""
        for records in self._children.get(parent, _NO_CHILDREN).values():
            yield from records.values()

    def children_from(self, parent: Parent, first_token: int) -> Collection[KeyRecord]:
        """The keys after ``parent`` whose tokens start with ``first_token``."""
        return self._by_first.get((parent, first_token), _NONE).values()

    def roots(self, tokens: Tokens) -> Collection[KeyRecord]:
        """Chains' first pages holding ``tokens``, on every replica and in every namespace."""
        return self._roots.get(tokens, _NONE).values()

    def cached_keys(self, replica: int = 0) -> int:
        """The keys the history holds as cached now on ``replica`` (at most ``max_live``)."""
        return len(self._live.get(replica, {}))

    def was_dropped(self, parent: Parent, tokens: Tokens) -> bool:
        """Whether a key with these tokens after ``parent`` was stored and then dropped by the bound."""
        return _fingerprint(parent, tokens) in self._dropped

    def admission(self, request: int | None) -> Admission | None:
        return None if request is None else self._admissions.get(request)

    def incomplete_before(self, at: int) -> Unknown | None:
        """Why the history may miss any store before lookup moment ``at``: events lost; else None. (Keys dropped by
        the bound are told per key, by their fingerprints: ``was_dropped``.)"""
        if self.first_gap is not None and self.first_gap[0] + 1 < at:
            return Unknown.EVENTS_LOST
        return None

    def __len__(self) -> int:
        """Keys kept."""
        return len(self._records)


def _unindex(index: dict[_K, Records], at: _K, node: Node) -> None:
    """Remove ``node`` from ``index[at]`` (O(1)), and the entry once empty."""
    records = index[at]
    del records[node]
    if not records:
        del index[at]


def _fingerprint(parent: Parent, tokens: Tokens) -> int:
    """A dropped key's trace: Python's hash of its parent and tokens (a collision only reads a new page "forgotten")."""
    return hash((parent, tokens))
