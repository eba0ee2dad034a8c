"""Follow a vLLM server's prefix cache through its KV-cache events (ZMQ + msgpack).

vLLM (``vllm/distributed/kv_events.py``, 0.32) publishes, for each scheduler step that changed the cache, a
multipart message ``(topic, seq, payload)`` on a PUB socket: ``seq`` is an 8-byte big-endian counter from 0 per
publisher (one publisher per data-parallel rank), ``payload`` is msgpack of ``KVEventBatch`` encoded array-like
(``[ts, events, data_parallel_rank]``), each event a map tagged by ``"type"``. An optional ROUTER socket (the
``replay_endpoint``) sends buffered batches again: a DEALER sends ``(b"", start_seq as 8 bytes)`` and receives
``(b"", topic, seq, payload)`` for each buffered batch with ``seq >= start_seq``, then ``(b"", b"", -1, b"")``.

What the events say, and what they do not (checked against vLLM 0.32's block pool and recorded payloads):

- ``BlockStored`` is sent when full blocks enter the prefix cache. vLLM does not de-duplicate: the same content
  computed twice (e.g. a prompt's last, partly generated block, recomputed by the next identical request) is held
  in two physical blocks, and each is stored and later removed with its own event. :class:`BlockTracker` counts
  these copies per hash.
- With ``vllm_xargs: {"kv_cache_report_mode": "full"}`` a request also reports the prefix-cache blocks it reused:
  a ``BlockStored`` with ``parent_block_hash`` None whose hashes are all already held. These reports change no
  state, and vLLM repeats them each time a request waiting for memory is tried again, so they are counted as
  "hit reports", not as hits (``/metrics`` and ``cached_tokens`` count hits).
- ``BlockRemoved`` is an eviction of one copy; ``AllBlocksCleared`` (``POST /reset_prefix_cache``) empties the
  cache. vLLM publishes queued events with the next scheduler step, so a reset shows up with the next request.
- Not in the events: which request holds a block now (ref counts), the LRU order, free-but-cached vs in-use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

import msgspec

BlockHash = int | bytes  # int unless the server sets VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
END_SEQ = -1  # the replay's end marker


# --- vLLM's wire structs (mirrors of vllm.distributed.kv_events; unknown fields are ignored) ----------------------


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Base of the tagged events: encoded as a map with ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """``[ts, events, data_parallel_rank]`` as vLLM sends it; ``skipped`` (ours, never on the wire) counts events
    :func:`decode_batch` could not read (an event type newer than this module, or a malformed one)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    skipped: int = 0


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload. Events of unknown type are skipped and counted, so a newer server does not break us."""
    try:
        wire = _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise EventDecodeError(f"not a KV-event batch: {error}") from error
    events: list[Event] = []
    skipped = 0
    for raw in wire.events:
        try:
            events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    return KVEventBatch(ts=wire.ts, events=events, data_parallel_rank=wire.data_parallel_rank, skipped=skipped)


def parse_frames(parts: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` from a PUB message (3 frames) or a replay reply (4, led by an empty frame)."""
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3 or len(parts[1]) != 8:
        raise EventDecodeError(f"expected (topic, 8-byte seq, payload), got {len(parts)} frames")
    topic, seq_bytes, payload = parts
    return topic, int.from_bytes(seq_bytes, "big", signed=True), payload


# --- the tracker ------------------------------------------------------------------------------------------------


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


class BlockTracker:
    """The prefix cache of one publisher (one data-parallel rank), rebuilt from its event batches.

    ``apply(seq, batch)`` is the only writer. Reads go through :meth:`snapshot`; both hold a lock, so one thread can
    feed while others read.
    """

    def __init__(self, recent_removed: int = 512, remember_seqs: int = 16384) -> None:
        self._lock = threading.Lock()
        self._recent_limit = recent_removed
        self._remember_limit = remember_seqs
        self._reset_state()
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "batches",
                "stored_blocks",
                "duplicate_stores",
                "hit_reports",
                "removed_blocks",
                "unknown_removals",
                "clears",
                "gaps",
                "missed_batches",
                "restarts",
                "duplicates",
                "resets",
                "skipped_events",
            ),
            0,
        )

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


# --- the subscriber ---------------------------------------------------------------------------------------------


class KvEventSubscriber(threading.Thread):
    """A daemon thread: SUB socket on ``endpoint`` -> :class:`BlockTracker`, with replay to fill gaps.

    ``endpoint`` is where the server's publisher binds (``ipc://PATH``, or ``tcp://HOST:PORT`` when the server was
    given ``tcp://*:PORT``). ZMQ reconnects by itself when the server restarts; the restart shows as ``seq`` going
    back, and the tracker starts over. With ``replay_endpoint``, a late join, a gap or a restart is filled from the
    server's replay buffer; without it, the view stays marked incomplete until the next ``AllBlocksCleared`` or
    restart. :meth:`stop` returns within about ``poll_ms`` (plus one replay slice).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        tracker: BlockTracker | None = None,
        poll_ms: int = 200,
        replay_timeout_s: float = 2.0,
        on_batch: Callable[[int, KVEventBatch, SeqStatus], None] | None = None,
    ) -> None:
        super().__init__(daemon=True, name=f"kv-events {endpoint}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.tracker = tracker or BlockTracker()
        self.poll_ms = poll_ms
        self.replay_timeout_s = replay_timeout_s
        self.on_batch = on_batch
        self._stop_event = threading.Event()
        self._resync_event = threading.Event()
        self._state_lock = threading.Lock()
        self._state = "starting"
        self._last_message_at: float | None = None
        self._replays = 0
        self._bad_messages = 0
        self._errors: list[str] = []
        self._lags_s: deque[float] = deque(maxlen=256)

    # -- control --

    def stop(self, timeout: float = 1.5) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def resync(self) -> None:
        """Forget the tracker's state and replay from seq 0 (e.g. after the app saw the server restart)."""
        self._resync_event.set()

    def status(self) -> dict[str, Any]:
        with self._state_lock:
            return {
                "state": self._state,
                "last_message_at": self._last_message_at,
                "replays": self._replays,
                "bad_messages": self._bad_messages,
                "errors": tuple(self._errors[-5:]),
                "lag_ms": _lag_summary(self._lags_s),
            }

    def _set_state(self, state: str, error: str | None = None) -> None:
        with self._state_lock:
            self._state = state
            if error:
                self._errors.append(error)
                del self._errors[:-20]

    # -- thread --

    def run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self._set_state("listening")
            if self.replay_endpoint:
                self._replay(ctx, 0)  # catch up with what the server published before we joined
            while not self._stop_event.is_set():
                if self._resync_event.is_set():
                    self._resync_event.clear()
                    self.tracker.reset()
                    if self.replay_endpoint:
                        self._replay(ctx, 0)
                if not sub.poll(self.poll_ms):
                    continue
                parts = sub.recv_multipart(zmq.NOBLOCK)
                self._handle(ctx, parts)
        except Exception as error:  # a subscriber must not take the app down
            self._set_state("failed", f"{type(error).__name__}: {error}")
            return
        finally:
            sub.close(linger=0)
            ctx.term()
        self._set_state("stopped")

    def _handle(self, ctx: Any, parts: list[bytes]) -> None:
        try:
            _, seq, payload = parse_frames(parts)
            batch = decode_batch(payload)
        except EventDecodeError as error:
            with self._state_lock:
                self._bad_messages += 1
            self._set_state("listening", str(error))
            return
        with self._state_lock:
            self._last_message_at = time.monotonic()
        status = self.tracker.classify(seq, batch.ts)
        if self.replay_endpoint and status is not SeqStatus.NEXT and status is not SeqStatus.DUPLICATE:
            if status is SeqStatus.RESTART:
                self.tracker.reset(restart=True)
                start = 0
            else:
                last = self.tracker.last_seq
                start = 0 if last is None else last + 1
            self._replay(ctx, start)
        status = self.tracker.apply(seq, batch)
        if status is SeqStatus.NEXT:  # a live batch (a replayed one is late by design)
            with self._state_lock:
                self._lags_s.append(time.time() - batch.ts)
        if self.on_batch is not None:
            self.on_batch(seq, batch, status)

    def _replay(self, ctx: Any, start_seq: int) -> int:
        """Ask the replay endpoint for batches from ``start_seq`` and apply the ones the tracker lacks."""
        import zmq

        assert self.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        applied = 0
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDTIMEO, 1000)  # a DEALER without a peer would block on send
            dealer.connect(self.replay_endpoint)
            try:
                dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            except zmq.Again:
                self._set_state("listening", f"replay endpoint {self.replay_endpoint} did not accept a request")
                return 0
            deadline = time.monotonic() + self.replay_timeout_s
            while not self._stop_event.is_set() and time.monotonic() < deadline:
                if not dealer.poll(min(self.poll_ms, 200)):
                    continue
                parts = dealer.recv_multipart()
                try:
                    _, seq, payload = parse_frames(parts)
                except EventDecodeError:
                    continue
                if seq == END_SEQ:
                    break
                deadline = time.monotonic() + self.replay_timeout_s  # still streaming: extend
                try:
                    batch = decode_batch(payload)
                except EventDecodeError:
                    continue
                status = self.tracker.classify(seq, batch.ts)
                if status in (SeqStatus.DUPLICATE, SeqStatus.RESTART):
                    continue
                self.tracker.apply(seq, batch)
                applied += 1
            with self._state_lock:
                self._replays += 1
        finally:
            dealer.close(linger=0)
        return applied

    # -- reads --

    def snapshot(self) -> TrackerSnapshot:
        return self.tracker.snapshot()


def _lag_summary(lags_s: deque[float]) -> dict[str, float] | None:
    """Median and max of the recent live batches' lag, from the server's time stamp to applied in the tracker.

    Both clocks are wall clocks: on one host the figure is exact; across hosts it includes their clock offset.
    """
    if not lags_s:
        return None
    ordered = sorted(lags_s)
    return {"median": ordered[len(ordered) // 2] * 1000, "max": ordered[-1] * 1000, "batches": len(ordered)}


def replay_frames(records: Iterable[list[bytes]], tracker: BlockTracker | None = None) -> BlockTracker:
    """Feed recorded multipart messages to a tracker (tests, offline analysis); END markers are skipped, a bad
    message raises :class:`EventDecodeError`."""
    tracker = tracker or BlockTracker()
    for parts in records:
        _, seq, payload = parse_frames(parts)
        if seq == END_SEQ:
            continue
        tracker.apply(seq, decode_batch(payload))
    return tracker


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTracker",
    "CachedBlock",
    "EventDecodeError",
    "KVCacheEvent",
    "KVEventBatch",
    "KvEventSubscriber",
    "RemovedBlock",
    "SeqStatus",
    "TrackerSnapshot",
    "decode_batch",
    "parse_frames",
    "replay_frames",
]
