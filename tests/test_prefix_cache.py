"""Prefix caching through the engine: exact hit counts, the chained hash, sharing, follow-ups, salt, clear."""

from __future__ import annotations

import pytest

from astrai import InferenceEngine
from astrai.kv_cache_manager import KVCacheManager
from astrai.observation import PageStored, RequestAdmitted, RequestFinished
from astrai.page_pool import PagePool
from astrai.request import Request, Status
from astrai.sampling import SamplingParams
from astrai.scheduler import Scheduler

PAGE = 4


@pytest.fixture
def engine(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=128, compile=False) as eng:
        yield eng


def computed_request(manager: KVCacheManager, tokens: list[int]) -> Request:
    """A request whose whole prompt was admitted, computed and committed, as one step would do."""
    req = Request(prompt_ids=tokens, params=SamplingParams())
    count = manager.admit(req, 1000)
    req.num_computed += count
    manager.commit(req)
    manager.end_step()
    return req


def test_equal_page_under_different_prefix_is_not_shared():
    manager = KVCacheManager(PagePool(16, PAGE), prefix_caching=True)
    computed_request(manager, [1, 2, 3, 4, 9, 9, 9, 9, 5])
    other = Request(prompt_ids=[5, 6, 7, 8, 9, 9, 9, 9, 5], params=SamplingParams())
    assert manager.admit(other, 1000) == 9  # page 1 holds equal tokens, but after another page 0: no hit
    same = Request(prompt_ids=[1, 2, 3, 4, 9, 9, 9, 9, 6], params=SamplingParams())
    assert manager.admit(same, 1000) == 1  # both pages hit; only the last token is computed


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = KVCacheManager(PagePool(16, PAGE), prefix_caching=True)
    computed_request(manager, list(range(8)))
    again = Request(prompt_ids=list(range(8)), params=SamplingParams())
    assert manager.admit(again, 1000) == 4  # page 1 is cached, but it holds the last token: recompute it
    assert again.cached_tokens == 4


def step(scheduler: Scheduler) -> None:
    """One engine step without a model: schedule, "compute" the scheduled tokens, register the full pages."""
    for req, count in scheduler.schedule():
        req.num_computed += count
        scheduler.cache.commit(req)
    scheduler.cache.end_step()


def test_an_admission_refused_for_lack_of_pages_takes_and_counts_nothing():
    """A request that waits for pages is looked up at every step, but only the admission that succeeds counts: its
    prefix pages serve one hit each, its tokens are queried once, and a refused try leaves the pool untouched."""
    pool = PagePool(6, PAGE)
    manager = KVCacheManager(pool, prefix_caching=True)
    scheduler = Scheduler(manager, max_batch_size=4, max_batched_tokens=1000, emit=lambda *_, **__: None)
    first = Request(prompt_ids=list(range(9)), params=SamplingParams())
    scheduler.add(first)
    step(scheduler)
    prefix = first.pages[:2]
    scheduler.remove(first)  # its two full pages stay cached, its third goes free
    hog = Request(prompt_ids=list(range(100, 116)), params=SamplingParams())  # takes the 4 free pages and keeps them
    scheduler.add(hog)
    step(scheduler)
    late = Request(prompt_ids=list(range(8)) + [50, 51, 52, 53], params=SamplingParams())  # the prefix + one page
    scheduler.add(late)
    pool.take_touched()
    for _ in range(12):
        step(scheduler)
        assert late.status is Status.WAITING and not late.pages
    assert [pool.hits[page] for page in prefix] == [0, 0]
    assert not pool.take_touched(), "a refused admission moved pages"
    scheduler.remove(hog)
    step(scheduler)
    assert late.status is Status.RUNNING and late.pages[:2] == prefix
    assert [pool.hits[page] for page in prefix] == [1, 1]
    assert manager.query_tokens == 9 + 16 + 12 and manager.hit_tokens == late.cached_tokens == 8


def shared_full_pages(a: list[int], b: list[int], a_computed: int) -> int:
    """Tokens of ``b`` a prefix cache can serve from ``a``: equal leading full pages, below b's last token."""
    n = 0
    while (n + 1) * PAGE <= min(a_computed, len(b) - 1) and a[n * PAGE : (n + 1) * PAGE] == b[
        n * PAGE : (n + 1) * PAGE
    ]:
        n += 1
    return n * PAGE


def test_hit_tokens_equal_the_shared_full_pages(engine, tokenizer):
    first = "Once upon a time there was a little cat. The cat sat on the mat."
    a = tokenizer(first).input_ids
    engine.generate(first, max_tokens=1)  # computes exactly the prompt's KV
    for second in [
        "Once upon a time there was a little cat. The cat sat on the mat and looked at the sun.",
        "Once upon a time there was a little dog.",
        "Lily and Tom went to the park.",
        first,
    ]:
        b = tokenizer(second).input_ids
        stream = engine.generate(second, max_tokens=1, stream=True)
        list(stream)
        info = engine.request_info(stream.request_ids)[0]
        assert info.cached_tokens == shared_full_pages(a, b, len(a)), second


def test_prompts_submitted_together_compute_their_shared_prefix_once(engine, tokenizer):
    prefix = "Lily and Tom went to the park. They played with a big red ball all day long. "
    prompts = [prefix + tail for tail in ("The dog was happy.", "The cat sat.", "小猫在花园里玩。", "The end.")]
    stream = engine.generate(prompts, max_tokens=4, stream=True)
    list(stream)
    infos = engine.request_info(stream.request_ids)
    ids = [tokenizer(p).input_ids for p in prompts]
    assert infos[0].cached_tokens == 0
    for i in range(1, len(prompts)):
        expected = shared_full_pages(ids[0], ids[i], len(ids[0]))
        assert expected >= 16
        assert infos[i].cached_tokens == expected
    stats = engine.cache_stats()
    assert stats.hit_tokens == sum(info.cached_tokens for info in infos)
    assert stats.query_tokens == sum(len(i) for i in ids)


def test_follow_up_turn_hits_the_answer_pages(engine, tokenizer):
    """Pages filled by generated tokens are registered too, so prompt + answer + more hits them."""
    prompt = tokenizer("Once upon a time there was a little cat.").input_ids
    stream = engine.generate_ids([prompt], max_tokens=12, stream=True)
    list(stream)
    info = engine.request_info(stream.request_ids)[0]
    computed = prompt + list(info.output_ids[:-1])  # the last sampled token is never computed
    follow_up = prompt + list(info.output_ids) + tokenizer("The end.").input_ids
    stream = engine.generate_ids([follow_up], max_tokens=1, stream=True)
    list(stream)
    cached = engine.request_info(stream.request_ids)[0].cached_tokens
    assert cached == len(computed) // PAGE * PAGE
    assert cached > len(prompt) // PAGE * PAGE


def test_prefix_caching_off_indexes_nothing(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=PAGE, n_pages=64, prefix_caching=False, compile=False) as eng:
        for _ in range(2):
            eng.generate(["Once upon a time there was a little cat."] * 3, max_tokens=4)
        stats = eng.cache_stats()
        assert stats.hit_tokens == 0 and stats.cached_pages == 0 and stats.free_pages == 64
        assert not eng.pool.index


def test_prefix_caching_off_counts_no_lookups(model, tokenizer):
    """Nothing is looked up with prefix caching off, so no query and no hit is counted (as vLLM records none): the
    hit rate has nothing to show, rather than a 0% of lookups never made; ``prefix_caching`` says why."""
    shared = "Once upon a time there was a little cat. "
    prompts = [shared + tail for tail in ("The dog", "Lily and Tom", "The sun")]
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=24, max_seq_len=200, prefix_caching=False, compile=False
    ) as eng:
        eng.generate(prompts, max_tokens=40)
        stats = eng.cache_stats()
        assert stats.preemptions > 0, "re-admissions must be there to be left uncounted"
        assert stats.prefix_caching is False
        assert (stats.query_tokens, stats.hit_tokens) == (0, 0)
        assert (stats.readmitted_query_tokens, stats.readmitted_hit_tokens) == (0, 0)
        assert not any(s.query_tokens for s in eng.history())


def test_cache_salt_isolates_namespaces(engine):
    prompt = "Once upon a time there was a little cat. The cat sat on the mat."
    engine.generate(prompt, max_tokens=1, cache_salt="alice")
    for salt, hit in (("bob", False), ("alice", True), (None, False)):
        stream = engine.generate(prompt, max_tokens=1, cache_salt=salt, stream=True)
        list(stream)
        assert (engine.request_info(stream.request_ids)[0].cached_tokens > 0) is hit, salt


def test_clear_empties_the_cache_while_requests_run(engine):
    prompt = "Lily and Tom went to the park. They played with a big red ball all day long."
    engine.generate(prompt, max_tokens=2)
    stream = engine.generate([prompt, "The dog"], max_tokens=40, stream=True)
    next(stream)
    engine.clear()
    assert engine.cache_stats().cached_pages == 0
    list(stream)
    assert engine.cache_stats().used_pages == 0
    after = engine.generate(prompt, max_tokens=1, stream=True)
    list(after)
    assert engine.request_info(after.request_ids)[0].cached_tokens == 0
    engine.pool.check_invariants()


def test_snapshot_and_stats_agree(engine):
    stream = engine.generate(
        ["Once upon a time there was a little cat.", "Once upon a time"], max_tokens=30, stream=True
    )
    next(stream)
    snapshot = engine.cache_snapshot().pages
    stats = engine.cache_stats()
    by_state = {s: sum(r.state == s for r in snapshot) for s in ("free", "in_use", "cached")}
    assert by_state == {"free": stats.free_pages, "in_use": stats.used_pages, "cached": stats.cached_pages}
    last_page = {}  # request -> the chain position of its last page
    for record in snapshot:
        for request in record.requests:
            last_page[request] = max(last_page.get(request, -1), record.chain_pos)
    for record in snapshot:
        assert (record.lru_rank is not None) == (record.state == "cached")
        if record.state == "in_use":
            assert record.ref_count == len(record.requests) >= 1
            assert set(record.requests) <= set(stream.request_ids)
            assert record.chain_pos >= 0 and len(record.token_ids) <= PAGE
            if not record.token_ids:  # only the page the running step reserved for a request's next token
                assert all(record.chain_pos == last_page[r] for r in record.requests), record
    stream.close()


def test_events_report_stores_admissions_and_finishes(engine):
    start = engine.events()[-1].seq if engine.events() else 0
    engine.generate(["Once upon a time there was a little cat."], max_tokens=3)
    kinds = {type(e) for e in engine.events(after=start)}
    assert {RequestAdmitted, PageStored, RequestFinished} <= kinds
