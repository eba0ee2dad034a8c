"""KV-cache event batches into a :class:`~tracker.BlockTracker`: live from a vLLM server's ZMQ sockets, or recorded.

The server's publisher is a PUB socket (``--kv-events-config``'s ``endpoint``); its optional ROUTER socket (the
``replay_endpoint``) sends buffered batches again: a DEALER sends ``(b"", start_seq as 8 bytes)`` and receives
``(b"", topic, seq, payload)`` for each buffered batch with ``seq >= start_seq``, then ``(b"", b"", -1, b"")``.
A replay fills what the live socket missed (a late join, a gap, a restart); the tracker drops what it already holds,
so a batch seen both live and replayed is applied once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from astrai.playground.backends.vllm.encoding import END_SEQ, EventDecodeError, KVEventBatch, decode_batch, parse_frames
from astrai.playground.backends.vllm.tracker import BlockTracker, SeqStatus, TrackerSnapshot


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
        """``state``: starting, listening, replaying (catching up from the replay endpoint), failed or stopped;
        ``resyncing``: a resync was asked and has not finished (its replay included)."""
        with self._state_lock:
            return {
                "state": self._state,
                "resyncing": self._resync_event.is_set() or self._state in ("starting", "replaying"),
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
                    self._set_state("replaying")  # status() says resyncing throughout
                    self._resync_event.clear()
                    self.tracker.reset()
                    if self.replay_endpoint:
                        self._replay(ctx, 0)
                    self._set_state("listening")
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
        applied = received = 0
        ended = False
        self._set_state("replaying")
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
                    ended = True
                    break
                received += 1
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
            if ended and start_seq == 0 and not received:
                self.tracker.confirm_empty()  # its buffer is empty: it has published nothing, its cache is empty
            with self._state_lock:
                self._replays += 1
        finally:
            dealer.close(linger=0)
            with self._state_lock:
                if self._state == "replaying":
                    self._state = "listening"
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


__all__ = ["KvEventSubscriber", "replay_frames"]
