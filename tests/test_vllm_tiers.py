"""A vLLM server's offloading tier, from the ``medium`` its KV events carry (issue 45).

vLLM's block pool sends ``medium`` "GPU" (older servers: none), its ``OffloadingConnector`` "CPU" or "STORAGE"
(``vllm/distributed/kv_events.py``: ``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``). No server runs here: the
events are encoded as vllm 0.32 sends them (``[ts, [event maps], rank]``, tests/support/kv_wire.py) and decoded by
``decode_batch``, then fed to a tracker, or to a backend through a stub subscriber (its HTTP side a fake).
"""

from __future__ import annotations

import time
from itertools import count

import msgspec
import pytest

from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.playground.backends.vllm.encoding import decode_batch
from astrai.playground.backends.vllm.tracker import BlockTracker
from astrai.playground.views import charts
from astrai.playground.views import series as chart_series
from astrai.playground.views import text as views
from tests.support import fake_vllm
from tests.support.fake_kv import StubSubscriber

BS = 4  # tokens per block
FIRST, SECOND = 101, 102  # a chain of two blocks
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


def stored(hashes: list[int], medium: str | None, parent: int | None = None, tokens: list[int] = TOKENS) -> dict:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
    return event | {"block_size": BS, "medium": medium}


def removed(hashes: list[int], medium: str | None) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class Server:
    """Publishes batches as a vLLM 0.32 server encodes them, from seq 0, into a tracker."""

    def __init__(self, tracker: BlockTracker) -> None:
        self.tracker = tracker
        self._seq = count()

    def send(self, *events: dict) -> None:
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        self.tracker.apply(next(self._seq), decode_batch(payload))


@pytest.fixture
def server() -> Server:
    return Server(BlockTracker())


def test_a_block_on_gpu_and_cpu_leaves_the_pool_on_its_gpu_removal_and_stays_in_the_tier(server):
    server.send(stored([FIRST, SECOND], "GPU"))
    server.send(stored([FIRST, SECOND], "CPU"))  # offloaded: the same hashes, in the CPU tier too
    snap = server.tracker.snapshot()
    assert set(snap.blocks) == {FIRST, SECOND} and snap.cached_copies == 2, "the CPU copies are not pool pages"
    assert snap.stored_blocks == 2 and snap.duplicate_stores == 0 and snap.hit_reports == 0
    (tier,) = snap.tiers
    assert tier.medium == "CPU" and set(tier.blocks) == {FIRST, SECOND} and tier.written_blocks == 2

    server.send(removed([SECOND], "GPU"))  # the pool evicts it: the tier keeps its copy
    snap = server.tracker.snapshot()
    assert set(snap.blocks) == {FIRST} and snap.cached_copies == 1 and snap.removed_blocks == 1
    assert [r.block_hash for r in snap.recently_removed] == [SECOND]
    (tier,) = snap.tiers
    assert set(tier.blocks) == {FIRST, SECOND} and tier.evicted_blocks == 0

    server.send(removed([SECOND], "CPU"))  # then the tier evicts it too
    snap = server.tracker.snapshot()
    (tier,) = snap.tiers
    assert set(tier.blocks) == {FIRST} and tier.evicted_blocks == 1 and tier.unknown_removals == 0
    assert set(snap.blocks) == {FIRST} and snap.removed_blocks == 1 and snap.unknown_removals == 0


def test_a_removal_of_the_cpu_copy_leaves_the_pools_block(server):
    server.send(stored([FIRST, SECOND], "GPU"), stored([FIRST, SECOND], "CPU"))
    server.send(removed([FIRST, SECOND], "CPU"))
    snap = server.tracker.snapshot()
    assert set(snap.blocks) == {FIRST, SECOND} and snap.removed_blocks == 0 and snap.recently_removed == ()
    (tier,) = snap.tiers
    assert dict(tier.blocks) == {} and tier.evicted_blocks == 2, "an emptied tier is still the server's tier"
    server.send(removed([FIRST], "CPU"))  # not held there any more: the tier's unknown removal, not the pool's
    snap = server.tracker.snapshot()
    assert snap.tiers[0].unknown_removals == 1 and snap.unknown_removals == 0 and FIRST in snap.blocks


def test_a_tiers_repeated_announcements_are_counted_not_read_as_reuse_reports(server):
    """The connector announces a hash once per offloaded chunk that holds it, and expects consumers to count them
    (vllm ``offloading/events.py``); a placeholder store (no tokens, block size 0) leaves the pool's block size."""
    server.send(stored([FIRST], "GPU", tokens=TOKENS[:BS]))
    placeholder = {"type": "BlockStored", "block_hashes": [FIRST], "parent_block_hash": None, "token_ids": []}
    server.send(placeholder | {"block_size": 0, "medium": "CPU"}, placeholder | {"block_size": 0, "medium": "CPU"})
    server.send(removed([FIRST], "CPU"))
    snap = server.tracker.snapshot()
    (tier,) = snap.tiers
    assert tier.blocks[FIRST].copies == 1 and tier.written_blocks == 1 and tier.evicted_blocks == 0
    assert snap.hit_reports == 0 and snap.block_size == BS and snap.blocks[FIRST].copies == 1


def test_a_server_without_media_is_tracked_as_before(server):
    """Older servers send no medium; the pool's own "GPU" is the same pool: a copy, a reuse report, a removal."""
    server.send(stored([FIRST, SECOND], None))
    server.send(stored([SECOND], "GPU", parent=FIRST, tokens=TOKENS[BS:]))  # a second copy, in the same pool
    server.send(stored([FIRST], "GPU", tokens=TOKENS[:BS]))  # all held, no parent: a reuse report
    snap = server.tracker.snapshot()
    assert snap.tiers == () and snap.blocks[SECOND].copies == 2 and snap.duplicate_stores == 1
    assert snap.hit_reports == 1 and snap.cached_copies == 3
    server.send(removed([SECOND], None))
    server.send(removed([SECOND], "GPU"))
    snap = server.tracker.snapshot()
    assert set(snap.blocks) == {FIRST} and snap.removed_blocks == 2 and snap.tiers == ()
    assert [r.block_hash for r in snap.recently_removed] == [SECOND]


def test_the_pools_reset_empties_the_pool_only_and_a_late_join_leaves_the_tier_incomplete():
    """``AllBlocksCleared`` is vLLM's ``BlockPool.reset_prefix_cache``; the connector's own reset sends no event."""
    late = BlockTracker()
    payload = msgspec.msgpack.encode([1.0, [stored([FIRST], "GPU", tokens=TOKENS[:BS]), stored([FIRST], "CPU")], 0])
    late.apply(5, decode_batch(payload))  # joined late: batches 0 to 4 were missed
    late.apply(6, decode_batch(msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared"}], 0])))
    snap = late.snapshot()
    assert dict(snap.blocks) == {} and snap.complete, "the pool is empty, so whole"
    assert set(snap.tiers[0].blocks) == {FIRST} and not snap.tiers_complete, "the tier keeps what it held"
    late.reset()  # a resync: the tier's blocks are gone until replayed, the tier itself is still the server's
    assert [dict(t.blocks) for t in late.snapshot().tiers] == [{}]


# --- the backend's stats and history, and what the page says ------------------------------------------------


@pytest.fixture
def fake_http():
    with fake_vllm.serve() as (url, _):
        yield url


def test_the_backend_reports_the_tier_with_what_vllm_does_not_tell_as_not_reported(fake_http):
    stub = StubSubscriber()
    backend = VllmBackend(fake_http, subscriber=stub, sample_every_s=3600)  # the test ticks by hand
    server = Server(stub.tracker)
    try:
        server.send(stored([FIRST, SECOND], None))
        backend._tick()
        assert backend.stats().second_tier is None, "no tier seen: nothing changes"
        assert "Second tier" not in views.stats_line(backend.stats(), backend.derived)
        cached_before = backend.stats().cached_pages
        server.send(stored([FIRST, SECOND], "CPU"))
        server.send(removed([SECOND], "GPU"))
        backend._tick()
        stats = backend.stats()
        tier = stats.second_tier
        assert tier is not None and (tier.medium, tier.pages, tier.written_pages, tier.evictions) == ("CPU", 2, 2, 0)
        assert stats.cached_pages == cached_before - 1, "the pool lost one block; the tier's copies are not its"
        not_told = ("write_policy", "capacity_pages", "hit_tokens", "loaded_pages", "bytes_written", "bytes_loaded")
        assert all(getattr(tier, name) is None for name in (*not_told, "write_seconds", "load_seconds"))
        line = views.stats_line(stats, backend.derived, backend.caveat)
        assert line.endswith(
            "**Second tier** (CPU): **2** pages held · 2 written · 0 evicted from it · write policy, capacity, tokens "
            "loaded from it, pages loaded, bytes loaded, load time, bytes written: n/a (vLLM does not report it)"
        ), line
        history = backend.history(0)
        assert history[-1].tier_pages == 2, "the step that saw the tier"
        assert {s.tier_pages for s in history[:-1]} == {None}, "the steps before it had none"
        data = chart_series.series(history, stats, time.time())
        drawn = [t for t in charts.occupancy_chart(data).data if t.name == charts.TIER_LINE]
        assert len(drawn) == 1 and list(drawn[0].y)[-1] == 2
    finally:
        backend.shutdown()


def test_a_tier_seen_after_a_late_join_is_said_to_be_maybe_incomplete(fake_http):
    stub = StubSubscriber()
    backend = VllmBackend(fake_http, subscriber=stub, sample_every_s=3600)
    try:
        late = msgspec.msgpack.encode([1.0, [stored([FIRST], "CPU", tokens=TOKENS[:BS])], 0])
        stub.tracker.apply(3, decode_batch(late))
        stub.tracker.apply(4, decode_batch(msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared"}], 0])))
        backend._tick()
        assert backend.caveat is not None and backend.caveat.startswith("The second tier's count may be incomplete")
    finally:
        backend.shutdown()


def test_the_tier_line_names_what_is_not_reported_and_keeps_the_engines_figures():
    from astrai.observation import TierStats

    engine = TierStats("file", "through", 64, 12, 48, 20, 3, 1, 2_000_000, 300_000, 0.01, 0.0004, True)
    assert views.tier_line(engine) == (
        "**Second tier** (file, written through: every page the pool stores): **12** of 64 pages held · **48** of the "
        "reused prompt tokens loaded from it · 3 pages loaded (0.3 MB) in 0.4 ms · 20 written (2.0 MB) · 1 evicted "
        "from it"
    ), "an engine reports everything: no n/a"
    vllm = TierStats("CPU", None, None, 5, None, 7, None, 2, None, None, None, None, True)
    assert views.tier_line(vllm) == (
        "**Second tier** (CPU): **5** pages held · 7 written · 2 evicted from it · write policy, capacity, tokens "
        "loaded from it, pages loaded, bytes loaded, load time, bytes written: n/a (vLLM does not report it)"
    )


def test_a_fleets_merged_stats_and_history_carry_no_replicas_tier():
    """A replica's tier is its own: the fleet's one cache must not show the first replica's as the fleet's."""
    import dataclasses

    from astrai.observation import CacheStats, StepSample, TierStats
    from astrai.playground.backends.vllm import fleet

    tier = TierStats("CPU", None, None, 5, None, 7, None, 2, None, None, None, None, True)
    base = dict.fromkeys(f.name for f in dataclasses.fields(CacheStats))
    base |= dict(finished=0, cancelled=0, failed=0, generated_tokens=0, steps=1, prefix_caching=True)
    replicas = [CacheStats(**(base | {"second_tier": tier})), CacheStats(**base)]
    assert fleet.merge_stats(replicas).second_tier is None
    sample = StepSample(1, 0.0, 0.0, None, None, None, None, None, 0, 0, None, 0, (), (), (), tier_pages=5)
    assert [s.tier_pages for s in fleet.merge_history([[sample], []])] == [None]
