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

``seq`` (per publisher, from 0) is what tells a gap, a duplicate (the same batch live and replayed) and a restarted
server apart: :meth:`BlockTracker.classify`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from types import MappingProxyType

from astrai.playground.backends.vllm.encoding import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)


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
class TrackerSnapshot:
    """An immutable view of the tracker at one moment."""

    blocks: MappingProxyType[BlockHash, CachedBlock] = field(default_factory=lambda: MappingProxyType({}))
    recently_removed: tuple[RemovedBlock, ...] = ()  # oldest first; a hash stored again leaves this list
    complete: bool = False  # True when every batch since the cache was last empty was applied
    last_seq: int | None = None
    last_ts: float | None = None
    data_parallel_rank: int | None = None
    block_size: int | None = None
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


class BlockTracker:
    """The prefix cache of one publisher (one data-parallel rank), rebuilt from its event batches.

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
        self._reset_state()
        self._counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    def _reset_state(self) -> None:
        self._blocks: dict[BlockHash, CachedBlock] = {}
        self._removed: OrderedDict[BlockHash, RemovedBlock] = OrderedDict()
        self._seen: OrderedDict[int, float] = OrderedDict()  # seq -> ts of recently applied batches
        self._last_seq: int | None = None
        self._last_ts: float | None = None
        self._complete = False
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
                self._complete = True

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
                self._complete = seq == 0
            elif status is SeqStatus.GAP:
                counters["gaps"] += 1
                counters["missed_batches"] += seq - self._last_seq - 1  # type: ignore[operator]
                self._complete = False
            elif status is SeqStatus.LATE_JOIN:
                self._complete = False
            elif self._last_seq is None:  # seq 0 on a fresh tracker: we have seen everything
                self._complete = True
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
        if isinstance(event, BlockStored):
            self._stored(event, seq, ts)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._removed_one(block_hash, seq, ts)
        elif isinstance(event, AllBlocksCleared):
            self._counters["clears"] += 1
            self._blocks.clear()
            self._removed.clear()
            self._complete = True  # the cache is empty: from here on we know all of it

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
        tokens = event.token_ids
        size = event.block_size
        parent = event.parent_block_hash
        for i, h in enumerate(hashes):
            chunk = tuple(tokens) if len(hashes) == 1 else tuple(tokens[i * size : (i + 1) * size])
            held = blocks.get(h)
            self._counters["stored_blocks"] += 1
            if held is not None:
                self._counters["duplicate_stores"] += 1
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
            self._removed.pop(h, None)
            parent = h

    def _removed_one(self, block_hash: BlockHash, seq: int, ts: float) -> None:
        held = self._blocks.get(block_hash)
        if held is None:
            self._counters["unknown_removals"] += 1
            return
        self._counters["removed_blocks"] += 1
        if held.copies > 1:
            self._blocks[block_hash] = replace(held, copies=held.copies - 1, last_seq=seq)
            return
        del self._blocks[block_hash]
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
                **self._counters,
            )


__all__ = ["BlockTracker", "CachedBlock", "RemovedBlock", "SeqStatus", "TrackerSnapshot"]
