"""A vLLM server's prefix cache, rebuilt from its KV-cache event batches (decoded by ``encoding``).

What the events say, and what they do not (checked against vLLM 0.32's block pool and recorded payloads):

- ``BlockStored`` is sent when full blocks enter the prefix cache. vLLM does not de-duplicate: the same content
  computed twice (e.g. a prompt's last, partly generated block, recomputed by the next identical request) is held
  in two physical blocks, and each is stored and later removed with its own event. :class:`BlockTracker` counts
  these copies per hash.
- With ``vllm_xargs: {"kv_cache_report_mode": "full"}`` a request also reports the prefix-cache blocks it reused:
  a ``BlockStored`` with ``parent_block_hash`` None whose hashes are all already held. These reports change no
  state, and vLLM repeats them each time a request waiting for memory is tried again, so they are counted as
  "hit reports", not as hits (``/metrics`` and ``cached_tokens`` count hits). One ambiguity: two requests that
  compute the same first blocks in one step store them twice, and the second store looks like such a report.
- ``BlockRemoved`` is an eviction of one copy; ``AllBlocksCleared`` (``POST /reset_prefix_cache``) empties the
  cache. vLLM publishes queued events with the next scheduler step, so a reset shows up with the next request.
- Not in the events: which request holds a block now (ref counts), the LRU order, free-but-cached vs in-use.

Media (``medium``; vLLM's ``MEDIUM_GPU`` / ``MEDIUM_CPU`` / ``MEDIUM_STORAGE`` in ``vllm/distributed/kv_events.py``):
the block pool's events say "GPU" (older servers: None), an offloading tier's (``OffloadingConnector``) "CPU" or
"STORAGE". The same hash can be held in the pool and in a tier at once, so each tier's blocks are kept apart from the
pool's (``TierBlocks``): a store or removal with a tier's medium touches that tier only, one with the pool's medium
(or none) the pool only. The connector announces a hash again for each offloaded chunk that holds it, and expects
consumers to count these announcements (``CachedBlock.copies`` does); it names every pool block of a chunk only with
``self_describing_kv_events``, else one placeholder hash per chunk (no tokens), so a tier's "blocks" are chunks then.
``AllBlocksCleared`` is the block pool's reset (``BlockPool.reset_prefix_cache``): it empties the pool only. The
tier is reset only by ``POST /reset_prefix_cache?reset_external=true``, which sends no event: the tracker cannot see
it, and a tier's view is whole only when every batch since the publisher started was applied (``tiers_complete``).

``seq`` (per publisher, from 0) is what tells a gap, a duplicate (the same batch live and replayed) and a restarted
server apart: :meth:`BlockTracker.classify`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from types import MappingProxyType

from astrai.playground.backends.vllm.encoding import (
    AllBlocksCleared,
    BlockHash,
    BlockStored,
    Event,
    KVEventBatch,
)

POOL_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the block pool's medium (older servers send None)


def tier_medium(medium: str | None) -> str | None:
    """The tier an event's ``medium`` names; None for the block pool (its own medium, or none from older servers)."""
    return None if medium is None or medium == POOL_MEDIUM else medium


class SeqStatus(StrEnum):
    """How a batch's ``seq`` relates to what the tracker has applied."""

    NEXT = "next"  # the one expected (or seq 0 on a fresh tracker)
    LATE_JOIN = "late_join"  # the first batch seen, and not seq 0: earlier batches were missed
    GAP = "gap"  # batches between the last applied one and this one were missed
    DUPLICATE = "duplicate"  # already applied (same seq, same timestamp), e.g. live and replayed
    RESTART = "restart"  # seq went backwards with another timestamp: a new publisher, i.e. a restarted server


@dataclass(frozen=True, slots=True)
class CachedBlock:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    copies: int = 1  # physical blocks holding this content (vLLM does not de-duplicate)
    hit_reports: int = 0  # "full"-mode reports of a reuse (repeat while a request waits; not a hit count)
    stored_seq: int = -1  # seq of the batch that first stored it
    last_seq: int = -1  # seq of the last batch that stored or reported it
    stored_ts: float = 0.0  # the batch's wall-clock time on the server
    session_id: str | None = None  # of the request that first stored it
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlock:
    block_hash: BlockHash
    seq: int
    ts: float
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TierBlocks:
    """One offloading tier's blocks (by medium, apart from the pool's), and what its events counted."""

    medium: str  # as the events name it: "CPU", "STORAGE"
    blocks: MappingProxyType[BlockHash, CachedBlock]
    written_blocks: int = 0  # stores of a hash the tier did not hold (a repeated announcement is not one)
    evicted_blocks: int = 0  # removals of a hash's last announced copy
    unknown_removals: int = 0  # BlockRemoved for a hash the tier did not hold


@dataclass(frozen=True)
class TrackerSnapshot:
    """An immutable view of the tracker at one moment."""

    blocks: MappingProxyType[BlockHash, CachedBlock] = field(default_factory=lambda: MappingProxyType({}))
    recently_removed: tuple[RemovedBlock, ...] = ()  # oldest first; a hash stored again leaves this list
    complete: bool = False  # True when every batch since the cache was last empty was applied
    last_seq: int | None = None
    last_ts: float | None = None
    data_parallel_rank: int | None = None
    block_size: int | None = None  # the pool's
    tiers: tuple[TierBlocks, ...] = ()  # every non-pool medium seen, in the order first seen
    tiers_complete: bool = False  # True when every batch since the publisher started was applied
    batches: int = 0
    stored_blocks: int = 0  # new physical copies
    duplicate_stores: int = 0  # of those, copies of a hash already held
    hit_reports: int = 0  # blocks reported reused ("full" mode)
    removed_blocks: int = 0
    unknown_removals: int = 0  # BlockRemoved for a hash not held (only expected while not complete)
    clears: int = 0
    gaps: int = 0
    missed_batches: int = 0
    restarts: int = 0
    duplicates: int = 0
    resets: int = 0
    skipped_events: int = 0

    @property
    def cached_copies(self) -> int:
        """Physical blocks in the prefix cache (in use or free-but-cached), by the events."""
        return sum(b.copies for b in self.blocks.values())

    @property
    def resync_needed(self) -> bool:
        return not self.complete


_FIELDS = [f.name for f in fields(TrackerSnapshot)]
_COUNTERS = _FIELDS[_FIELDS.index("batches") :]  # the snapshot's counters: its fields from ``batches`` on


class _Tier:
    """A tier's live state in the tracker: its blocks, and its counters (kept across resets, as the pool's are)."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, CachedBlock] = {}
        self.counters = {"written_blocks": 0, "evicted_blocks": 0, "unknown_removals": 0}


class BlockTracker:
    """The prefix cache of one publisher (one data-parallel rank), rebuilt from its event batches: the block pool's
    blocks, and each offloading tier's apart (the module docstring).

    ``apply(seq, batch)`` is the only writer. Reads go through :meth:`snapshot`; both hold a lock, so one thread can
    feed while others read.
    """

    def __init__(self, recent_removed: int = 512, remember_seqs: int = 16384, remember_sessions: int = 4096) -> None:
        self._lock = threading.Lock()
        self._recent_limit = recent_removed
        self._remember_limit = remember_seqs
        self._sessions_limit = remember_sessions
        # session id -> seq of the last batch whose BlockStored named it (a store, or a "full"-mode reuse report):
        # which requests this publisher's engine served. Kept across resets: a restart does not undo what was served.
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._tiers: dict[str, _Tier] = {}  # medium -> its tier; a medium once seen stays (the server has that tier)
        self._reset_state()
        self._counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    def _reset_state(self) -> None:
        self._blocks: dict[BlockHash, CachedBlock] = {}
        self._removed: OrderedDict[BlockHash, RemovedBlock] = OrderedDict()
        self._seen: OrderedDict[int, float] = OrderedDict()  # seq -> ts of recently applied batches
        self._last_seq: int | None = None
        self._last_ts: float | None = None
        self._complete = False
        self._tiers_complete = False
        for tier in self._tiers.values():
            tier.blocks.clear()
        self._rank: int | None = None
        self._block_size: int | None = None

    # -- sequencing --

    def classify(self, seq: int, ts: float) -> SeqStatus:
        with self._lock:
            return self._classify(seq, ts)

    def _classify(self, seq: int, ts: float) -> SeqStatus:
        if self._last_seq is None:
            return SeqStatus.NEXT if seq == 0 else SeqStatus.LATE_JOIN
        if seq == self._last_seq + 1:
            return SeqStatus.NEXT
        if seq > self._last_seq + 1:
            return SeqStatus.GAP
        if self._seen.get(seq) == ts:
            return SeqStatus.DUPLICATE
        return SeqStatus.RESTART

    @property
    def last_seq(self) -> int | None:
        with self._lock:
            return self._last_seq

    def reset(self, *, restart: bool = False) -> None:
        """Forget everything (the caller will resync, e.g. by a replay from seq 0); ``restart``: count it as a
        server restart the caller detected (see :meth:`classify`)."""
        with self._lock:
            self._reset_state()
            self._counters["restarts" if restart else "resets"] += 1

    def confirm_empty(self) -> None:
        """The publisher has published nothing yet (a replay from seq 0 answered no batch): the empty view is the
        whole cache. No effect once a batch was applied."""
        with self._lock:
            if self._last_seq is None and not self._blocks:
                self._complete = self._tiers_complete = True

    def apply(self, seq: int, batch: KVEventBatch) -> SeqStatus:
        """Apply one batch. A gap or a late join marks the view incomplete (it is applied all the same); a restart
        (seq backwards) starts over; a duplicate is dropped. Returns what ``seq`` was."""
        with self._lock:
            status = self._classify(seq, batch.ts)
            counters = self._counters
            if status is SeqStatus.DUPLICATE:
                counters["duplicates"] += 1
                return status
            if status is SeqStatus.RESTART:
                counters["restarts"] += 1
                self._reset_state()
                self._complete = self._tiers_complete = seq == 0
            elif status is SeqStatus.GAP:
                counters["gaps"] += 1
                counters["missed_batches"] += seq - self._last_seq - 1  # type: ignore[operator]
                self._complete = self._tiers_complete = False
            elif status is SeqStatus.LATE_JOIN:
                self._complete = self._tiers_complete = False
            elif self._last_seq is None:  # seq 0 on a fresh tracker: we have seen everything
                self._complete = self._tiers_complete = True
            counters["batches"] += 1
            counters["skipped_events"] += batch.skipped
            for event in batch.events:
                self._apply_event(event, seq, batch.ts)
            self._last_seq = seq
            self._last_ts = batch.ts
            if batch.data_parallel_rank is not None:
                self._rank = batch.data_parallel_rank
            self._seen[seq] = batch.ts
            while len(self._seen) > self._remember_limit:
                self._seen.popitem(last=False)
            return status

    # -- events --

    def _apply_event(self, event: Event, seq: int, ts: float) -> None:
        if isinstance(event, AllBlocksCleared):  # the block pool's reset: a tier keeps its blocks
            self._counters["clears"] += 1
            self._blocks.clear()
            self._removed.clear()
            self._complete = True  # the pool is empty: from here on we know all of it
            return
        medium = tier_medium(event.medium)
        if medium is not None:
            tier = self._tiers.setdefault(medium, _Tier())
            if isinstance(event, BlockStored):
                self._stored_in_tier(tier, event, seq, ts)
            else:
                for block_hash in event.block_hashes:
                    self._removed_from_tier(tier, block_hash, seq)
        elif isinstance(event, BlockStored):
            self._stored(event, seq, ts)
        else:
            for block_hash in event.block_hashes:
                self._removed_one(block_hash, seq, ts)

    def _stored_in_tier(self, tier: _Tier, event: BlockStored, seq: int, ts: float) -> None:
        """A tier's store: each hash's announcement counted, never read as a reuse report (those are the pool's)."""
        tier.counters["written_blocks"] += sum(held is None for held, _ in _stored_blocks(tier.blocks, event, seq, ts))

    def _removed_from_tier(self, tier: _Tier, block_hash: BlockHash, seq: int) -> None:
        gone = _remove_copy(tier.blocks, block_hash, seq)
        if gone is None:
            tier.counters["unknown_removals"] += 1
        elif block_hash not in tier.blocks:
            tier.counters["evicted_blocks"] += 1

    def _stored(self, event: BlockStored, seq: int, ts: float) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        if event.session_id:
            self._sessions.pop(event.session_id, None)
            self._sessions[event.session_id] = seq
            while len(self._sessions) > self._sessions_limit:
                self._sessions.popitem(last=False)
        self._block_size = event.block_size
        blocks = self._blocks
        if event.parent_block_hash is None and all(h in blocks for h in hashes):
            # A reuse report ("full" mode): vLLM changed nothing. See the module docstring for the one ambiguity
            # (two requests computing the same first blocks in one step look the same).
            for h in hashes:
                blocks[h] = replace(blocks[h], hit_reports=blocks[h].hit_reports + 1, last_seq=seq)
                self._counters["hit_reports"] += 1
            return
        for held, block in _stored_blocks(blocks, event, seq, ts):
            self._counters["stored_blocks"] += 1
            if held is not None:
                self._counters["duplicate_stores"] += 1
            self._removed.pop(block.block_hash, None)

    def _removed_one(self, block_hash: BlockHash, seq: int, ts: float) -> None:
        held = _remove_copy(self._blocks, block_hash, seq)
        if held is None:
            self._counters["unknown_removals"] += 1
            return
        self._counters["removed_blocks"] += 1
        if block_hash in self._blocks:  # another copy is still held
            return
        self._removed.pop(block_hash, None)
        self._removed[block_hash] = RemovedBlock(block_hash, seq, ts, held.token_ids)
        while len(self._removed) > self._recent_limit:
            self._removed.popitem(last=False)

    # -- reads --

    def sessions_seen(self, session_ids: Iterable[str]) -> set[str]:
        """Those of ``session_ids`` that a ``BlockStored`` of this publisher named (the newest
        ``remember_sessions``): the requests whose blocks this engine stored or reused."""
        with self._lock:
            return {s for s in session_ids if s in self._sessions}

    def snapshot(self) -> TrackerSnapshot:
        with self._lock:
            return TrackerSnapshot(
                blocks=MappingProxyType(dict(self._blocks)),
                recently_removed=tuple(self._removed.values()),
                complete=self._complete,
                last_seq=self._last_seq,
                last_ts=self._last_ts,
                data_parallel_rank=self._rank,
                block_size=self._block_size,
                tiers=tuple(
                    TierBlocks(medium, MappingProxyType(dict(tier.blocks)), **tier.counters)
                    for medium, tier in self._tiers.items()
                ),
                tiers_complete=self._tiers_complete,
                **self._counters,
            )


def _stored_blocks(
    blocks: MutableMapping[BlockHash, CachedBlock], event: BlockStored, seq: int, ts: float
) -> list[tuple[CachedBlock | None, CachedBlock]]:
    """Store ``event``'s blocks in ``blocks`` (the pool's or a tier's): a hash already held gains a copy, a new one
    is recorded with its tokens and parent. Returns ``(held before, held now)`` for each hash, in order."""
    tokens = event.token_ids
    size = event.block_size
    parent = event.parent_block_hash
    stored = []
    for i, h in enumerate(event.block_hashes):
        chunk = tuple(tokens) if len(event.block_hashes) == 1 else tuple(tokens[i * size : (i + 1) * size])
        held = blocks.get(h)
        if held is not None:
            blocks[h] = replace(held, copies=held.copies + 1, last_seq=seq)
        else:
            blocks[h] = CachedBlock(
                block_hash=h,
                parent_hash=parent,
                token_ids=chunk,
                block_size=size,
                stored_seq=seq,
                last_seq=seq,
                stored_ts=ts,
                session_id=event.session_id,
                medium=event.medium,
                group_idx=event.group_idx,
            )
        stored.append((held, blocks[h]))
        parent = h
    return stored


def _remove_copy(blocks: MutableMapping[BlockHash, CachedBlock], block_hash: BlockHash, seq: int) -> CachedBlock | None:
    """Remove one copy of ``block_hash`` from ``blocks`` (the block leaves with its last copy); returns the block as
    it was held, None when it was not."""
    held = blocks.get(block_hash)
    if held is None:
        return None
    if held.copies > 1:
        blocks[block_hash] = replace(held, copies=held.copies - 1, last_seq=seq)
    else:
        del blocks[block_hash]
    return held


__all__ = [
    "POOL_MEDIUM",
    "BlockTracker",
    "CachedBlock",
    "RemovedBlock",
    "SeqStatus",
    "TierBlocks",
    "TrackerSnapshot",
    "tier_medium",
]
