"""The second KV tier (``astrai.tier``): its stores copy pages exactly, its slots follow LRU under both write
policies, a failing store switches it off without failing a request, bad settings are refused at construction,
and the engine reports it: events, ``CacheStats.second_tier`` and the explainer's "loaded" / "evicted from both".
(Greedy output with the tier on equals transformers': tests/test_equivalence.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from astrai import InferenceEngine
from astrai.explain import Cause
from astrai.observation import TierPageEvicted, TierPageLoaded, TierPageWritten
from astrai.page_pool import page_key
from astrai.tier import FileStore, MemoryStore, SecondTier, TierStore, TierWrite, by_rank, open_store
from astrai.tier.tier import runs
from tests.support.tiny_models import reference_generate

PAGE = 4
PROMPT_A = "Once upon a time there was a little cat. The cat sat on the mat and looked at the sun."
PROMPT_B = "Lily and Tom went to the park. They played with a big red ball all day long. The dog was happy."
PROMPT_C = "The dog was happy. It ran to the tree and barked at a bird. Once upon a time there was a dog."


# ----- stores ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "file"])
def make_store(request, tmp_path):
    def make(slots: int, page_bytes: int) -> TierStore:
        return open_store("memory" if request.param == "memory" else tmp_path, slots, page_bytes)

    return make


def planes_of(pool: torch.Tensor) -> list[torch.Tensor]:
    """A fake pool's KV ``[planes, n_pages, elements]`` as the planes a store binds to (``ModelRunner.kv_planes``)."""
    return [plane.view(torch.uint8) for plane in pool]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_trip_through_a_store_is_an_exact_copy(make_store, dtype):
    pool = torch.randn(3, 8, 10).to(dtype)  # 3 planes, 8 pages, 10 elements of each page per plane
    page_bytes = 3 * 10 * pool.element_size()
    original = pool.clone()
    store = make_store(6, page_bytes)
    try:
        store.bind(planes_of(pool))
        store.write(1, 0, 3)  # pages 0-2 into slots 1-3, one run
        store.write(5, 6, 1)
        pool.zero_()
        store.read(1, 4, 3)  # back into pages 4-6
        store.read(5, 0, 1)
        assert torch.equal(pool[:, 4:7].view(torch.uint8), original[:, 0:3].view(torch.uint8))
        assert torch.equal(pool[:, 0].view(torch.uint8), original[:, 6].view(torch.uint8))
        with pytest.raises(IndexError, match="slots"):
            store.write(4, 0, 3)
        with pytest.raises(IndexError, match="pages"):
            store.read(0, 7, 2)
        with pytest.raises(ValueError, match="bytes"):
            store.bind(planes_of(pool[:2]))
    finally:
        store.close()


def counted(store: FileStore, calls: list[tuple[str, int]], short: int = 0) -> None:
    """Count a file store's system calls as (name, iovecs); ``short``: each moves that many bytes too few."""
    for name in ("_preadv", "_pwritev"):
        real = getattr(store, name)

        def call(fd: int, table: int, iovecs: int, at: int, _real=real, _name=name[1:]) -> int:
            calls.append((_name, iovecs))
            return _real(fd, table, iovecs, at) - short

        setattr(store, name, call)


def test_a_file_store_moves_a_run_in_one_call_split_only_past_the_iovec_limit(tmp_path, monkeypatch):
    """The load bandwidth's reason: however long a run, a file store makes one system call for it, with one iovec a
    (page, plane) segment, and splits it only where it has more segments than one call takes."""
    pool = torch.randn(4, 16, 8)  # 4 planes, 16 pages
    original = pool.clone()
    store = FileStore(tmp_path, 16, 4 * 8 * 4)
    try:
        store.bind(planes_of(pool))
        calls: list[tuple[str, int]] = []
        counted(store, calls)
        store.write(0, 3, 12)
        store.read(2, 0, 1)
        assert calls == [("pwritev", 48), ("preadv", 4)]
        assert torch.equal(pool[:, 0], original[:, 5])
        calls.clear()
        monkeypatch.setattr("astrai.tier.store.IOV_MAX", 5)
        pool.zero_()
        store.read(0, 2, 12)  # 48 segments: 9 calls of 5 and one of 3, in order through one range of the file
        assert calls == [("preadv", 5)] * 9 + [("preadv", 3)]
        assert torch.equal(pool[:, 2:14].view(torch.uint8), original[:, 3:15].view(torch.uint8))
        assert not pool[:, :2].any() and not pool[:, 14:].any()
    finally:
        store.close()


def test_a_short_read_or_write_of_a_file_store_raises(tmp_path):
    store = FileStore(tmp_path, 4, 2 * 8 * 4)
    try:
        store.bind(planes_of(torch.randn(2, 4, 8)))
        counted(store, [], short=1)
        with pytest.raises(OSError, match="short write of the second tier's file: 63 of 64 bytes"):
            store.write(0, 0, 1)
        with pytest.raises(OSError, match="short read of the second tier's file: 127 of 128 bytes"):
            store.read(0, 1, 2)
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_store_bound_to_row_slices_of_the_planes_copies_only_their_pages(make_store, dtype):
    """A tenant's pool is rows ``offset .. offset + n`` of each plane: its page ``p`` is the plane's row ``offset
    + p``, and no copy touches a row outside its slice."""
    kv = torch.randn(3, 10, 6).to(dtype)  # 3 planes of 10 pages; the tenant holds pages 4-7
    original = kv.clone()
    store = make_store(4, 3 * 6 * kv.element_size())
    try:
        store.bind([plane.view(torch.uint8)[4:8] for plane in kv])
        store.write(0, 0, 4)  # the tenant's pages 0-3: rows 4-7
        kv.zero_()
        store.read(1, 1, 2)  # slots 1-2 into the tenant's pages 1-2: rows 5-6
        store.read(3, 0, 1)  # slot 3 into the tenant's page 0: row 4
        assert torch.equal(kv[:, 5:7].view(torch.uint8), original[:, 5:7].view(torch.uint8))
        assert torch.equal(kv[:, 4].view(torch.uint8), original[:, 7].view(torch.uint8))
        assert not kv[:, :4].view(torch.uint8).any() and not kv[:, 7:].view(torch.uint8).any()
        with pytest.raises(IndexError, match="pages"):
            store.read(0, 3, 2)  # page 4 of the tenant would be row 8: outside its slice
    finally:
        store.close()


def test_pages_pair_by_rank_and_move_in_runs():
    assert by_rank([7, 3, 5], [10, 2, 4]) == [10, 2, 4]  # the lowest slot, 3, gets the lowest page, 2
    assert by_rank([9, 8, 7], [4, 5, 6]) == [6, 5, 4]  # a chain evicted tail first loads back as one run
    assert list(runs([9, 8, 7], [6, 5, 4])) == [(7, 4, 3)]
    assert list(runs([1, 2, 4, 5], [0, 1, 2, 3])) == [(1, 0, 2), (4, 2, 2)]


def test_a_file_store_is_one_preallocated_file_deleted_on_close(tmp_path):
    store = FileStore(tmp_path, 5, 64)
    assert store.path.parent == tmp_path and store.path.stat().st_size == 5 * 64
    with pytest.raises(RuntimeError, match="not bound"):
        store.read(0, 0, 1)
    store.bind(planes_of(torch.zeros(1, 2, 16)))
    store.close()
    assert not store.path.exists()
    with pytest.raises(RuntimeError, match="closed"):
        store.read(0, 0, 1)


def test_a_file_store_that_cannot_be_made_says_why(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        FileStore(tmp_path / "missing", 4, 64)
    with pytest.raises(ValueError, match="cannot create the second tier's file in '/proc'"):
        FileStore("/proc", 4, 64)  # no file can be created there, even by root
    with pytest.raises(ValueError, match=r"cannot allocate the second tier's .* MiB"):
        FileStore(tmp_path, 2**30, 2**30)  # an exbibyte: no disk holds it
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    with pytest.raises(ValueError, match="offload_to"):
        open_store(3, 4, 64)  # type: ignore[arg-type]


# ----- the tier's slots -----------------------------------------------------------------------------------
class FlakyStore(MemoryStore):
    """A memory store whose reads or writes raise once told to: a disk that failed."""

    fail_reads = False
    fail_writes = False

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        if self.fail_reads:
            raise OSError(5, "Input/output error")
        super().read(first_slot, first_page, count)

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        if self.fail_writes:
            raise OSError(28, "No space left on device")
        super().write(first_slot, first_page, count)


def keyed(i: int) -> tuple[bytes, tuple[int, ...]]:
    tokens = (i,) * PAGE
    return page_key(None, tokens), tokens


def put(tier: SecondTier, page: int) -> None:
    """Write pool page ``page`` into the tier as the first page of a chain whose tokens are all ``page``."""
    tier.write([TierWrite(page, *keyed(page), None, 0)])


def load(tier: SecondTier, slots: list[int], pages: list[int], request: int | None = None) -> bool:
    """What an admission does: reserve the slots, read them into these pool pages, count the load."""
    tier.reserve(slots)
    seconds = tier.load(slots, pages)
    if seconds is None:
        return False
    tier.loaded(slots, pages, request, seconds)
    return True


def tier_of(slots: int, policy: str, events: list | None = None) -> tuple[SecondTier, torch.Tensor]:
    """A tier over a fake pool of 8 pages of two floats each, so a page's content names it."""
    kv = torch.arange(16, dtype=torch.float32).view(8, 2)

    def emit(event: type, **fields: object) -> None:
        if events is not None:
            events.append((event, fields))

    return SecondTier(FlakyStore(slots, 8), [kv.view(torch.uint8)], policy, emit=emit), kv


@pytest.mark.parametrize("policy", ["through", "on_evict"])
def test_the_tier_evicts_least_recently_used_first_and_loads_exact_copies(policy):
    events: list = []
    tier, kv = tier_of(2, policy, events)
    for page in (0, 1, 2):  # a third page into two slots: the first written goes
        put(tier, page)
    assert tier.find(*keyed(0)) is None and tier.counters.evictions == 1
    assert [e for e, _ in events] == [TierPageWritten, TierPageWritten, TierPageEvicted, TierPageWritten]
    slot = tier.find(*keyed(1))
    assert slot is not None
    assert load(tier, [slot], [5], request=7)
    assert torch.equal(kv[5], kv[1])  # pool page 5 now holds page 1's KV
    assert tier.counters.loaded_pages == 1 and tier.counters.bytes_loaded == 8
    loaded = events[-1]
    assert loaded[0] is TierPageLoaded and loaded[1]["request"] == 7 and loaded[1]["kept"] == (policy == "through")
    if policy == "on_evict":  # a page loaded back leaves the tier: its slot is free for the next
        assert tier.find(*keyed(1)) is None and tier.held_pages == 1
    else:  # it stays, touched as the most recent: page 2 goes first now
        put(tier, 3)
        assert tier.find(*keyed(2)) is None and tier.find(*keyed(1)) is not None
    put(tier, 2)
    written = tier.counters.written_pages
    put(tier, 2)  # a key held is touched, not written again
    assert tier.counters.written_pages == written
    tier.check_invariants()
    held = tier.held_pages
    assert held > 0 and tier.clear() == held and tier.held_pages == 0 and len(tier.free) == tier.n_pages
    tier.check_invariants()


def test_slots_being_loaded_are_never_taken_by_a_write():
    """An admission reserves the slots it loads before it allocates their pool pages: the pool's evictions for
    those pages may write into the tier, and must not land on them (here every slot is reserved: not kept)."""
    tier, kv = tier_of(2, "on_evict")
    put(tier, 0)
    put(tier, 1)
    slots = [slot for slot in (tier.find(*keyed(0)), tier.find(*keyed(1))) if slot is not None]
    assert len(slots) == 2
    tier.reserve(slots)
    put(tier, 2)
    assert tier.find(*keyed(2)) is None and tier.counters.written_pages == 2
    tier.check_invariants()
    seconds = tier.load(slots, [5, 6])
    assert seconds is not None
    tier.loaded(slots, [5, 6], None, seconds)
    assert torch.equal(kv[5], kv[0]) and torch.equal(kv[6], kv[1]) and tier.held_pages == 0
    tier.check_invariants()


def test_a_tier_whose_store_fails_switches_off_and_serves_nothing(caplog):
    tier, _ = tier_of(4, "through")
    put(tier, 0)
    slot = tier.find(*keyed(0))
    assert slot is not None
    tier.store.fail_reads = True  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="astrai"):
        assert not load(tier, [slot], [3])
    assert not tier.enabled and "Input/output error" in (tier.error or "")
    assert "switched off" in caplog.text
    assert tier.find(*keyed(0)) is None and tier.held_pages == 0
    put(tier, 1)  # nothing is written once it is off
    assert tier.counters.written_pages == 1
    tier.check_invariants()

    tier, _ = tier_of(4, "on_evict")
    tier.store.fail_writes = True  # type: ignore[attr-defined]
    put(tier, 0)
    assert not tier.enabled and "No space left" in (tier.error or "")
    tier.check_invariants()


# ----- the engine -----------------------------------------------------------------------------------------
def engine_with_tier(model, tokenizer, **options) -> InferenceEngine:
    settings = dict(page_size=PAGE, n_pages=12, max_batch_size=1, compile=False, offload_pages=16)
    return InferenceEngine(model, tokenizer, **{**settings, **options})


def test_bad_tier_settings_are_refused_at_construction(model, tokenizer, tmp_path):
    for options, message in (
        ({"offload_pages": -1}, "offload_pages must be an integer >= 0"),
        ({"offload_pages": True}, "offload_pages must be an integer >= 0"),
        ({"offload_policy": "write_back"}, "offload_policy must be one of"),
        ({"prefix_caching": False}, "needs prefix_caching"),
        ({"offload_to": tmp_path / "nowhere"}, "not a directory"),
        ({"offload_to": "/proc"}, "cannot create the second tier's file"),
        ({"offload_to": tmp_path, "offload_pages": 2**40}, "cannot allocate the second tier's"),
    ):
        with pytest.raises(ValueError, match=message):
            engine_with_tier(model, tokenizer, **options)
    assert list(tmp_path.iterdir()) == []


def test_a_request_never_fails_because_of_the_tier(model, tokenizer, caplog):
    """Pages of A go to the tier as B evicts them; then the store fails as A is looked up again: the tier switches
    off with a warning and A computes what it would have loaded, with transformers' tokens."""
    expected = reference_generate(model, tokenizer, PROMPT_A, 6)  # before the engine takes the model
    with engine_with_tier(model, tokenizer, offload_policy="on_evict") as engine:
        tier = engine.cache.tier
        assert tier is not None
        tier.store = flaky = FlakyStore(tier.n_pages, tier.store.page_bytes)
        flaky.bind(engine.runner.kv_planes())
        engine.generate([PROMPT_A], max_tokens=2)
        engine.generate([PROMPT_B], max_tokens=2)
        assert tier.held_pages > 0
        flaky.fail_reads = True
        with caplog.at_level(logging.WARNING, logger="astrai"):
            stream = engine.generate(PROMPT_A, max_tokens=6, stream=True)
            "".join(stream)
        (info,) = engine.request_info(stream.request_ids)
        assert info.status == "finished" and list(info.output_ids) == expected
        stats = engine.cache_stats().second_tier
        assert stats is not None and not stats.enabled and "Input/output error" in (stats.error or "")
        assert stats.loaded_pages == 0 and "switched off" in caplog.text


def test_a_bfloat16_page_loads_back_bit_for_bit(model, tokenizer):
    """Under "through" every stored page is in the tier: each slot equals its pool page's KV byte for byte, and a
    load into another page copies it exactly."""
    with engine_with_tier(model, tokenizer, dtype="bfloat16", n_pages=64, offload_pages=64) as engine:
        engine.generate([PROMPT_A, PROMPT_B], max_tokens=4)
        tier, pool, runner = engine.cache.tier, engine.pool, engine.runner
        assert tier is not None and tier.held_pages == pool.stats.stored > 0
        planes, free = runner.kv_planes(), pool.free[0]
        for key, slot in list(tier.index.items()):
            page = pool.index[key]
            assert load(tier, [slot], [free])
            assert all(torch.equal(plane[free], plane[page]) for plane in planes)
            assert any(plane[page].any() for plane in planes)  # a page of KV, not zeros compared with zeros
        model.float()


def test_the_tier_is_observed_and_explained(model, tokenizer):
    """A's pages go to the tier as B evicts them from the pool ("on_evict"), and A asked again loads them: typed
    events, the stats per tier, and the explainer's "loaded from the second tier"."""
    with engine_with_tier(model, tokenizer, offload_policy="on_evict") as engine:
        engine.generate([PROMPT_A], max_tokens=2)
        engine.generate([PROMPT_B], max_tokens=2)
        before = engine.cache_stats()
        stream = engine.generate([PROMPT_A], max_tokens=2, stream=True)
        list(stream)
        (request,) = stream.request_ids
        stats = engine.cache_stats()
        tier = stats.second_tier
        assert tier is not None and before.second_tier is not None
        events = engine.events()
        written = [e for e in events if isinstance(e, TierPageWritten)]
        loaded = [e for e in events if isinstance(e, TierPageLoaded)]
        assert len(written) == tier.written_pages > 0 and len(loaded) == tier.loaded_pages > 0
        assert {e.request for e in loaded} == {request}
        assert tier.bytes_loaded == tier.loaded_pages * engine.cache.tier.store.page_bytes > 0
        assert tier.bytes_written == tier.written_pages * engine.cache.tier.store.page_bytes
        assert tier.load_seconds > 0 and tier.medium == "memory" and tier.write_policy == "on_evict"
        served = tier.hit_tokens - before.second_tier.hit_tokens
        assert served == len(loaded) * PAGE and tier.evictions == 0
        # loaded pages left the tier, and the pages A's own allocation evicted from the pool entered it
        assert (
            tier.pages == before.second_tier.pages - len(loaded) + tier.written_pages - before.second_tier.written_pages
        )
        assert engine.history()[-1].tier_pages == tier.pages  # the occupancy chart's tier line
        (why,) = engine.explain([request])
        assert why.counts[Cause.LOADED] == served
        assert (
            why.counts[Cause.CACHED] + why.counts[Cause.LOADED]
            == why.cached_tokens
            == stats.hit_tokens - before.hit_tokens
        )


def test_a_page_evicted_from_the_pool_and_the_tier_reads_evicted_from_both(model, tokenizer):
    """A two-page tier: B and C push A's pages out of the pool and out of the tier; A asked again computes them,
    "evicted from both"."""
    with engine_with_tier(model, tokenizer, offload_pages=2, offload_policy="through") as engine:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_C):
            engine.generate([prompt], max_tokens=2)
        stream = engine.generate([PROMPT_A], max_tokens=2, stream=True)
        list(stream)
        (why,) = engine.explain(stream.request_ids)
        assert engine.cache_stats().second_tier.evictions > 0
        assert why.counts[Cause.EVICTED_BOTH] > 0 and why.counts[Cause.LOADED] == 0


def test_a_chain_loads_back_as_one_run_and_arc_hears_each_load_as_a_miss(model, tokenizer):
    """A's pages enter the tier as B evicts them (tail first, into the lowest free slots); A asked again loads them
    with one read of the store (one run: consecutive slots into consecutive pool pages, paired by rank), and the
    pool's ARC hears each loaded page's key as a miss before the eviction that makes room for it."""
    with engine_with_tier(model, tokenizer, eviction="arc", offload_policy="on_evict") as engine:
        engine.generate([PROMPT_A], max_tokens=2)
        engine.generate([PROMPT_B], max_tokens=2)
        tier, policy = engine.cache.tier, engine.pool.policy
        assert tier is not None
        heard: list[tuple[str, object]] = []
        missed, victim, read = policy.missed, policy.victim, tier.store.read
        policy.missed = lambda key: heard.append(("missed", key)) or missed(key)  # type: ignore[method-assign]
        policy.victim = lambda incoming=None: heard.append(("victim", incoming)) or victim(incoming)  # type: ignore[method-assign]
        reads: list[tuple[int, int, int]] = []
        tier.store.read = lambda *run: reads.append(run) or read(*run)  # type: ignore[method-assign]
        stream = engine.generate([PROMPT_A], max_tokens=2, stream=True)
        list(stream)
        loaded = [e for e in engine.events() if isinstance(e, TierPageLoaded) and e.request in stream.request_ids]
        assert len(loaded) > 1 and len(reads) == 1 and reads[0][2] == len(loaded)
        assert any(("victim", event.key) in heard for event in loaded)  # the pool was full: loads evicted
        for event in loaded:  # each load's allocation named its key first; the eviction it made was for that key
            assert ("missed", event.key) in heard
            if ("victim", event.key) in heard:
                assert heard.index(("missed", event.key)) < heard.index(("victim", event.key))
