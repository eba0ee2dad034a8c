"""Tenants in one engine: each its own pool, prefix index, eviction order, batch limit and observation, every
tenant's tokens computed in the engine's one shared forward per step."""

from __future__ import annotations

import threading
import time

import pytest

from astrai import EngineClosedError, InferenceEngine, RequestFailedError, TenantReserveFull
from astrai.engine import PageRanges, Tenant
from astrai.observation import PageStored, RequestAdmitted
from astrai.playground.views.replay import Recording, pages_at
from tests.support.tiny_models import make_model, make_tokenizer, reference_generate
from tests.test_equivalence import NEW_TOKENS, PAGE
from tests.test_equivalence import PROMPTS as EQUIVALENCE_PROMPTS

# the equivalence tests' prompts in their order, the ASCII ones (their tokens size these tests' pools)
PROMPTS = [p for p in EQUIVALENCE_PROMPTS if p.isascii()]


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama, its tokenizer, transformers' greedy outputs for PROMPTS, and the pages the longest takes."""
    tokenizer = make_tokenizer()
    model = make_model("llama", len(tokenizer))
    refs = [reference_generate(model, tokenizer, p, NEW_TOKENS) for p in PROMPTS]
    longest = max(len(tokenizer(p).input_ids) for p in PROMPTS) + NEW_TOKENS
    return model, tokenizer, refs, -(-longest // PAGE)


def collect(stream, n: int) -> list[str]:
    texts = [""] * n
    for index, delta in stream:
        texts[index] += delta
    return texts


def run_together(runs: dict[str, tuple[Tenant, list[str]]]) -> dict[str, list[list[int]]]:
    """Submit every run first, then read them all at once: their requests are in the engine together."""
    streams = {name: (t, t.generate(p, max_tokens=NEW_TOKENS, stream=True), len(p)) for name, (t, p) in runs.items()}
    errors: list[BaseException] = []

    def read(stream, n):
        try:
            collect(stream, n)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(s, n)) for _, s, n in streams.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return {name: [list(i.output_ids) for i in t.request_info(s.request_ids)] for name, (t, s, _) in streams.items()}


def test_greedy_in_tight_tenants_equals_transformers_while_all_share_the_forward(llama):
    """Two tenants each too small for the batch (it must evict and preempt inside them) and the roomy default pool
    run the same prompts in the same steps: every output equals transformers', and the engine ran fewer forwards
    than the three pools' steps together."""
    model, tokenizer, refs, pages_per_request = llama
    tight = pages_per_request + 2
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=256, tenant_pages=2 * tight, max_batch_size=6, compile=False
    ) as engine:
        first = engine.add_tenant(tight, max_batch_size=6)
        second = engine.add_tenant(tight, max_batch_size=6, eviction="fifo")
        assert second.page_offset == 256 + tight  # the reserve comes after the engine's own pages
        for _ in range(2):  # the second round with every cache warm
            outputs = run_together(
                {"default": (engine, PROMPTS), "first": (first, PROMPTS), "second": (second, PROMPTS)}
            )
            assert outputs == {"default": refs, "first": refs, "second": refs}
        for tenant in (first, second):
            stats = tenant.cache_stats()
            assert stats.preemptions > 0 and stats.evictions > 0, "the tenant's pool must be under pressure"
            assert stats.used_pages == 0 and stats.n_pages == tight
            tenant.pool.check_invariants()
        steps = engine.steps + first.steps + second.steps
        assert engine.forwards < steps - max(engine.steps, first.steps, second.steps)  # most steps were shared
        engine.pool.check_invariants()


def test_tenants_with_second_tiers_of_their_own_equal_transformers(llama, tmp_path):
    """Two tight tenants, each with a six-page tier of its own (one in memory, one a file), beside the default pool:
    every tier evicts and loads back, and every output is still transformers'. A tier bound to the engine's pages
    0.. instead of its tenant's would copy another pool's KV (the default pool's, here), and the outputs would
    differ. Closing a tenant deletes its tier's file."""
    model, tokenizer, refs, pages_per_request = llama
    tight = pages_per_request + 2
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=256, tenant_pages=2 * tight, max_batch_size=6, compile=False
    ) as engine:
        in_memory = engine.add_tenant(tight, max_batch_size=6, offload_pages=6, offload_policy="on_evict")
        on_disk = engine.add_tenant(tight, max_batch_size=6, offload_pages=6, offload_to=tmp_path)
        for _ in range(2):
            outputs = run_together(
                {"default": (engine, PROMPTS), "memory": (in_memory, PROMPTS), "file": (on_disk, PROMPTS)}
            )
            assert outputs == {"default": refs, "memory": refs, "file": refs}
        for prompt, ref in zip(PROMPTS[::-1], refs[::-1], strict=True):  # alone: what the tier kept is looked up
            assert run_together({"memory": (in_memory, [prompt]), "file": (on_disk, [prompt])}) == {
                "memory": [ref],
                "file": [ref],
            }
        assert engine.cache_stats().second_tier is None  # the default pool has none: the tiers are the tenants'
        for tenant, medium in ((in_memory, "memory"), (on_disk, "file")):
            tier = tenant.cache_stats().second_tier
            assert tier is not None and tier.enabled and tier.medium == medium and tier.capacity_pages == 6
            assert tier.loaded_pages > 0 and tier.evictions > 0
            tenant.pool.check_invariants()
            tenant.cache.tier.check_invariants()
        assert list(tmp_path.iterdir())  # the file tier's file
        on_disk.close()
        assert not list(tmp_path.iterdir())


def test_a_tenant_with_a_tier_that_cannot_be_made_takes_no_pages(model, tokenizer, tmp_path):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=16, tenant_pages=8, compile=False) as engine:
        with pytest.raises(ValueError, match="is not a directory"):
            engine.add_tenant(8, offload_pages=4, offload_to=tmp_path / "missing")
        with pytest.raises(ValueError, match="offload_policy"):
            engine.add_tenant(8, offload_pages=4, offload_policy="sometimes")
        with pytest.raises(ValueError, match="needs prefix_caching"):
            engine.add_tenant(8, offload_pages=4, prefix_caching=False)
        assert engine.add_tenant(8).pool.n_pages == 8  # the refused ones took no pages
        assert not list(tmp_path.iterdir())


def test_a_tenant_sees_only_its_own_pages_requests_and_counts(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=64, tenant_pages=40, compile=False) as engine:
        mine, theirs = engine.add_tenant(20, max_batch_size=2), engine.add_tenant(20)
        engine.generate(PROMPTS[3], max_tokens=4)  # the default pool's pages stay out of both
        out = run_together({"mine": (mine, PROMPTS[:2]), "theirs": (theirs, PROMPTS[2:])})
        assert set(out) == {"mine", "theirs"}
        # request ids are the process's (a suite has made thousands before): these come after the default pool's
        (first,) = {e.request for e in engine.events() if isinstance(e, RequestAdmitted)}
        ids = list(range(first, first + 100))
        mine_ids = {i.id for i in mine.request_info(ids)}
        theirs_ids = {i.id for i in theirs.request_info(ids)}
        assert len(mine_ids) == 2 and len(theirs_ids) == 4 and not mine_ids & theirs_ids
        admitted = {e.request for e in mine.events() if isinstance(e, RequestAdmitted)}
        stored_by = {e.request for e in mine.events() if isinstance(e, PageStored)}
        assert admitted == mine_ids and stored_by and stored_by <= mine_ids
        in_default = {e.request for e in engine.events() if isinstance(e, (RequestAdmitted, PageStored))}
        assert in_default and not in_default & (mine_ids | theirs_ids), "the default pool's log holds its own only"
        assert {r for s in mine.history() for r in s.requests} == mine_ids
        assert [s.step for s in mine.history()] == list(range(1, mine.steps + 1))  # numbered by its own steps
        snapshot = mine.cache_snapshot()
        assert len(snapshot.pages) == 20 and {p.page for p in snapshot.pages} == set(range(20))
        assert {p.stored_by for p in snapshot.pages if p.stored_by is not None} <= mine_ids
        prompt_tokens = sum(len(tokenizer(p).input_ids) for p in PROMPTS[:2])
        assert mine.cache_stats().query_tokens == prompt_tokens
        assert mine.cache_stats().finished == 2 and theirs.cache_stats().finished == 4
        assert [e.request for e in mine.explain(sorted(mine_ids))] == sorted(mine_ids)
        assert mine.explain(sorted(theirs_ids)) == []
        cached = theirs.cache_stats().cached_pages
        assert mine.clear() > 0 and theirs.cache_stats().cached_pages == cached  # its clear empties its pool only
        mine.cancel(sorted(theirs_ids))  # ids of another tenant are not its to cancel
        assert theirs.cache_stats().cancelled == 0


def test_closing_a_tenant_mid_run_ends_its_requests_and_returns_its_pages(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=64, tenant_pages=30, compile=False) as engine:
        doomed, other = engine.add_tenant(20), engine.add_tenant(10)
        with pytest.raises(TenantReserveFull, match="0 of 30 free"):
            engine.add_tenant(1)
        long_run = doomed.generate([PROMPTS[0], PROMPTS[2]], max_tokens=60, stream=True)
        beside = other.generate([PROMPTS[4]], max_tokens=NEW_TOKENS, stream=True)
        next(iter(long_run))  # it is running
        doomed.close()
        started = time.monotonic()
        with pytest.raises(EngineClosedError, match="tenant was closed"):
            collect(long_run, 2)
        assert time.monotonic() - started < 2
        with pytest.raises(EngineClosedError, match="tenant is closed"):
            doomed.generate(PROMPTS[0], max_tokens=2)
        assert collect(beside, 1)[0]  # the other tenant's run went on to its end
        again = engine.add_tenant(20)  # the closed tenant's pages are back in the reserve
        assert again.page_offset == 64 and again.generate(PROMPTS[0], max_tokens=4)
        assert engine.tenants == [other, again]
        assert engine.generate(PROMPTS[0], max_tokens=4)


def test_a_failing_step_of_one_tenant_fails_only_its_requests(model, tokenizer, monkeypatch):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=64, tenant_pages=40, compile=False) as engine:
        broken, fine = engine.add_tenant(20), engine.add_tenant(20)
        expected = engine.generate(PROMPTS[2], max_tokens=8)

        def schedule(*args):
            raise AssertionError("injected scheduler bug")

        monkeypatch.setattr(broken.scheduler, "schedule", schedule)
        failing = broken.generate(PROMPTS[2], max_tokens=8, stream=True)
        assert fine.generate(PROMPTS[2], max_tokens=8) == expected
        with pytest.raises(RequestFailedError, match="injected scheduler bug"):
            collect(failing, 1)
        assert engine.generate(PROMPTS[2], max_tokens=8) == expected


def test_a_tenants_replay_rebuilds_its_pool_at_every_step_of_its_own(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=64, tenant_pages=16, compile=False) as engine:
        tenant = engine.add_tenant(16, max_batch_size=3)
        truth = {}
        real_record = tenant._record_step

        def record_and_snapshot(*args, **kwargs):
            real_record(*args, **kwargs)
            truth[tenant.steps] = tenant.cache_snapshot()

        tenant._record_step = record_and_snapshot
        base = tenant.cache_snapshot()
        background = engine.generate(PROMPTS, max_tokens=20, stream=True)  # the default pool in the same steps
        stream = tenant.generate(PROMPTS[:3], max_tokens=20, stream=True)
        collect(stream, 3)
        collect(background, len(PROMPTS))
        recording = Recording(base, tuple(tenant.history(after_step=base.step)), tuple(stream.request_ids))
        assert tenant.cache_stats().evictions > 0
    assert [s.step for s in recording.samples] == sorted(truth)
    for index, step in enumerate((s.step for s in recording.samples), start=1):
        assert pages_at(recording, index) == list(truth[step].pages), f"step {step}"


def test_the_reserve_hands_out_ranges_and_merges_them_back():
    reserve = PageRanges(100, 50)
    a, b, c = reserve.take(20), reserve.take(20), reserve.take(10)
    assert (a, b, c) == (100, 120, 140)
    reserve.release(a, 20)
    with pytest.raises(TenantReserveFull, match="20 of 50 free, the largest range 20"):
        reserve.take(21)
    reserve.release(b, 20)
    assert reserve.take(40) == 100 and reserve.free_pages == 0


def test_bad_tenant_settings_get_a_clear_error(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=16, tenant_pages=8, compile=False) as engine:
        with pytest.raises(ValueError, match="n_pages must be an integer >= 1"):
            engine.add_tenant(0)
        with pytest.raises(ValueError, match="eviction"):
            engine.add_tenant(4, eviction="random")
        with pytest.raises(ValueError, match="keep_finished must be an integer >= 1"):
            engine.add_tenant(4, keep_finished=0)
        assert engine.add_tenant(8).pool.n_pages == 8  # the refused ones took no pages


def test_a_tenant_keeps_its_own_observation_bounds(model, tokenizer):
    """A visitor's own pool keeps records sized to it (the playground's ``OWN_POOL_OBSERVATION``), not the
    engine's: its ended requests and its step history are bounded by what it was given."""
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=16, tenant_pages=16, compile=False) as engine:
        tenant = engine.add_tenant(16, keep_finished=2, history_size=3)
        for prompt in ("Once upon a time", "The cat sat", "A little girl", "The sun was"):
            tenant.generate([prompt], max_tokens=4)
        admitted = sorted({e.request for e in tenant.events() if isinstance(e, RequestAdmitted)})
        assert len(admitted) == 4
        known = tenant.request_info(admitted)
        assert len(known) == 2 and all(info.status == "finished" for info in known)
        assert len(tenant.history()) == 3
        with pytest.raises(TypeError, match="shutdown"):
            engine.close()
