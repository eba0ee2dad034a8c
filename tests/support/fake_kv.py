"""Stand-ins for a vLLM server's KV-event side: a publisher speaking its ZMQ protocol, and a subscriber a test feeds.

``FakePublisher`` is PUB + ROUTER like ``vllm.distributed.kv_events.ZmqEventPublisher``: it publishes payloads with
its own seq from 0, keeps the last ``buffer_steps`` for replay (vLLM's ``buffer_steps``), and answers
``(b"", start_seq)`` with ``(b"", topic, seq, payload)``... then the end marker. ``StubSubscriber`` stands in for
``KvEventSubscriber`` inside a ``VllmBackend``: the test applies batches to its tracker and reads its resyncs.
``recorded`` reads the batches recorded from a real server.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import deque
from pathlib import Path

from astrai.playground.backends.vllm.encoding import END_SEQ, parse_frames
from astrai.playground.backends.vllm.tracker import BlockTracker

DATA = Path(__file__).parents[1] / "data" / "vllm"
BEFORE_CLEAR = 12  # kv_events_run: batches 0-11 hold 7 blocks in 15 physical copies; batch 12 clears the cache


def recorded(name: str = "kv_events_run") -> list[tuple[int, bytes]]:
    """``(seq, payload)`` of each batch in a recording of tests/data/vllm, end markers left out."""
    out = []
    for line in (DATA / f"{name}.jsonl").read_text().splitlines():
        _, seq, payload = parse_frames([base64.b64decode(p) for p in json.loads(line)["frames_b64"]])
        if seq != END_SEQ:
            out.append((seq, payload))
    return out


def held(backend) -> list:
    """A backend's pages that hold a block (in use or cached)."""
    return [p for p in backend.snapshot().pages if p.state != "free"]


class FakePublisher:
    def __init__(self, tmp_path: Path, name: str = "kv", buffer_steps: int | None = None) -> None:
        import zmq

        self.endpoint = f"ipc://{tmp_path}/{name}.sock"
        self.replay_endpoint = f"ipc://{tmp_path}/{name}-replay.sock"
        self.buffer_steps = buffer_steps
        self.ctx = zmq.Context()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._open()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        import zmq

        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.replay_endpoint)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)

    def restart(self) -> None:
        """A new server: sockets closed and bound again, seq from 0, empty buffer."""
        with self.lock:
            self.pub.close(linger=0)
            self.router.close(linger=0)
            time.sleep(0.1)
            self._open()

    def publish(self, payload: bytes) -> None:
        with self.lock:
            seq_bytes = self.seq.to_bytes(8, "big")
            self.pub.send_multipart([b"kv-events", seq_bytes, payload])
            self.buffer.append((self.seq, payload))
            self.seq += 1

    def _serve_replay(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                if self.router.poll(0):
                    client, _, start = self.router.recv_multipart()
                    start_seq = int.from_bytes(start, "big")
                    for seq, payload in self.buffer:
                        if seq >= start_seq:
                            self.router.send_multipart([client, b"", b"kv-events", seq.to_bytes(8, "big"), payload])
                    self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            time.sleep(0.01)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


class StubSubscriber:
    """Stands in for KvEventSubscriber: the test feeds its tracker; ``resyncs`` counts what the backend asked."""

    def __init__(self) -> None:
        self.tracker = BlockTracker()
        self.resyncs = 0
        self.resyncing = False  # what status() says (a test sets it)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def resync(self) -> None:
        self.resyncs += 1

    def status(self) -> dict:
        return {"resyncing": self.resyncing}

    def snapshot(self):
        return self.tracker.snapshot()
