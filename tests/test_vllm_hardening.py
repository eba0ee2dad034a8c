"""The single-server attach, hardened (issue 23, section 1), its server side: restarts, /tokenize and /metrics.
Each defect found in review is reproduced here; tests/test_vllm_kv_events.py has the KV-event side (resyncs, an
incomplete page map, both event encodings).

No vLLM server is needed except for the ``vllm``-marked check: a fake answers HTTP in this process
(tests/support/fake_vllm.py), and KV events come from the payloads recorded from a real vLLM 0.32 server
(tests/data/vllm/README.md), fed by hand to a stub subscriber or published by a fake ZMQ publisher
(tests/support/fake_kv.py) to the real ``KvEventSubscriber``.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from astrai.observation import CacheCleared
from astrai.playground.backends.protocol import BackendUnavailable
from astrai.playground.backends.vllm import sampler as sampler_module
from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.playground.backends.vllm.encoding import decode_batch
from astrai.playground.backends.vllm.metrics import parse_metrics
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber
from tests.support import fake_vllm
from tests.support.fake_kv import BEFORE_CLEAR, DATA, FakePublisher, StubSubscriber, held, recorded
from tests.support.needs import NO_VLLM
from tests.support.waiting import wait_until


@pytest.fixture
def fake():
    with fake_vllm.serve() as server:
        yield server


# --- 1. a slow scrape is not a restart ---------------------------------------------------------------------


def test_a_failed_or_slow_scrape_keeps_pages_owners_and_generation(fake, monkeypatch):
    url, handler = fake
    stub = StubSubscriber()
    backend = VllmBackend(url, subscriber=stub, sample_every_s=3600)  # the test ticks by hand
    try:
        for seq, payload in recorded()[:BEFORE_CLEAR]:
            stub.tracker.apply(seq, decode_batch(payload))
        backend._tick()
        pages, events, generation = held(backend), backend.events(0), backend.generation
        assert len(pages) == 7 and backend.stats().cached_pages == 15
        handler.metrics_status = 503  # one scrape fails
        backend._tick()
        with pytest.raises(BackendUnavailable, match="HTTPStatusError"):
            backend.stats()
        handler.metrics_status, handler.metrics_delay = 200, 0.5  # one is slower than the scrape's timeout
        monkeypatch.setattr(sampler_module, "METRICS_TIMEOUT", httpx.Timeout(0.2, connect=1.0))
        backend._tick()
        with pytest.raises(BackendUnavailable, match="ReadTimeout"):
            backend.stats()
        handler.metrics_delay = 0.0
        backend._tick()  # the same server answers again
        assert backend.stats().cached_pages == 15 and backend.unreachable is None
        assert backend.generation == generation, "no restart without evidence"
        assert stub.resyncs == 0, "no resync without evidence"
        assert held(backend) == pages and backend.events(0) == events
        assert not any(isinstance(e, CacheCleared) for e in backend.events(0))
    finally:
        backend.shutdown()


def test_a_restart_is_seen_by_the_server_start_time_and_resyncs_once(fake):
    url, handler = fake
    stub = StubSubscriber()
    handler.metrics_text = fake_vllm.recorded_metrics(1000.0)
    backend = VllmBackend(url, subscriber=stub, sample_every_s=3600)
    try:
        generation = backend.generation
        backend._tick()
        assert (backend.generation, stub.resyncs) == (generation, 0)
        handler.metrics_status = 503  # away a while ...
        backend._tick()
        handler.metrics_status, handler.metrics_text = 200, fake_vllm.recorded_metrics(2000.0)  # ... back as another
        backend._tick()
        assert (backend.generation, stub.resyncs) == (generation + 1, 1)
        backend._tick()
        assert (backend.generation, stub.resyncs) == (generation + 1, 1), "once per restart"
        handler.metrics_text = fake_vllm.recorded_metrics(3000.0)  # restarted between two scrapes, no outage seen
        backend._tick()
        assert (backend.generation, stub.resyncs) == (generation + 2, 2)
    finally:
        backend.shutdown()


def test_without_a_start_time_counters_going_back_are_the_evidence():
    def without_start(name: str) -> str:
        text = (DATA / f"metrics_{name}.txt").read_text()
        return "\n".join(line for line in text.splitlines() if "process_start_time_seconds" not in line) + "\n"

    names = ("after_hits", "after_reset", "after_evictions")
    hits, reset, evict = (parse_metrics((DATA / f"metrics_{n}.txt").read_text()) for n in names)
    assert hits.process_start == pytest.approx(1796227986.8) and evict.process_start != hits.process_start
    assert not reset.restarted_since(hits) and evict.restarted_since(hits), "another process: a restart"
    before, after = parse_metrics(without_start("before")), parse_metrics(without_start("after_hits"))
    assert before.process_start is None
    assert not after.restarted_since(before) and before.restarted_since(after), "counters went back"


def test_a_slow_scrape_loses_no_block_beyond_the_replay_buffer(fake, tmp_path):
    """The review's reproduction: a replay buffer of 6 batches, 12 published. A resync from seq 0 would get only the
    last 6, i.e. 4 of the 7 blocks (8 of 15 copies); a failed scrape must not cause one."""
    url, handler = fake
    publisher = FakePublisher(tmp_path, buffer_steps=6)
    subscriber = KvEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, poll_ms=50)
    backend = VllmBackend(url, subscriber=subscriber, sample_every_s=3600)
    try:
        assert wait_until(lambda: subscriber.status()["replays"] >= 1, timeout=10)
        time.sleep(0.3)  # the SUB connection settles before the live batches
        for _, payload in recorded()[:BEFORE_CLEAR]:
            publisher.publish(payload)
        assert wait_until(lambda: subscriber.snapshot().last_seq == BEFORE_CLEAR - 1, timeout=10)
        backend._tick()
        assert len(held(backend)) == 7 and backend.stats().cached_pages == 15
        replays = subscriber.status()["replays"]
        handler.metrics_status = 500
        backend._tick()
        handler.metrics_status = 200
        backend._tick()
        time.sleep(0.5)  # a resync, had one been asked, would have replayed by now
        backend._tick()
        assert (len(held(backend)), backend.stats().cached_pages) == (7, 15)
        assert subscriber.status()["replays"] == replays
        assert subscriber.snapshot().complete
    finally:
        backend.shutdown()
        publisher.close()


# --- 2. a transient /tokenize error is not "no chat template" ----------------------------------------------------


@pytest.fixture
def no_local_tokenizer(monkeypatch):
    """The served model's tokenizer is not on this machine: the server applies the chat template."""
    monkeypatch.setattr("astrai.playground.backends.vllm.backend.load_tokenizer", lambda root: None)


def test_a_transient_tokenize_error_fails_that_run_and_is_asked_again(fake, no_local_tokenizer):
    url, handler = fake
    backend = VllmBackend(url, sample_every_s=3600)
    try:
        for status in (503, 429, 500, 408):
            handler.tokenize_errors = [status]
            prompt = f"Hello {status}"
            with pytest.raises(BackendUnavailable, match=f"/tokenize with HTTP {status}"):
                backend.format_prompt("Be kind. ", prompt)
            templated = f"<system>Be kind. <user>{prompt}<assistant>"  # the fake's template
            assert backend.format_prompt("Be kind. ", prompt) == templated, "asked again, not cached as untemplated"
            calls = handler.tokenize_calls
            assert backend.format_prompt("Be kind. ", prompt) == templated and handler.tokenize_calls == calls
        handler.tokenize_errors = [404]  # another refusal: the text as it is, for this run only
        assert backend.format_prompt("", "Hi") == "Hi"
        assert backend.format_prompt("", "Hi") == "<user>Hi<assistant>"
        handler.tokenize_errors = [400]  # vLLM's answer for a model without a chat template: that one is kept
        assert backend.format_prompt("A. ", "B") == "A. B"
        calls = handler.tokenize_calls
        assert backend.format_prompt("A. ", "B") == "A. B" and handler.tokenize_calls == calls
    finally:
        backend.shutdown()


def test_the_chat_template_cache_is_a_bounded_lru(fake, no_local_tokenizer, monkeypatch):
    from astrai.playground.backends.vllm import prompts

    assert 100 <= prompts.CHAT_CACHE <= 1000, "a few hundred prompts"
    monkeypatch.setattr(prompts, "CHAT_CACHE", 8)  # the same rule, in fewer HTTP calls
    url, handler = fake
    backend = VllmBackend(url, sample_every_s=3600)
    try:
        backend.format_prompt("", "prompt 0")
        for i in range(1, 20):
            backend.format_prompt("", f"prompt {i}")
            backend.format_prompt("", "prompt 0")  # used all along: the most recent, never dropped
        calls = handler.tokenize_calls
        assert calls == 20
        backend.format_prompt("", "prompt 0")
        backend.format_prompt("", "prompt 19")
        assert handler.tokenize_calls == calls, "the recent ones are kept"
        backend.format_prompt("", "prompt 1")
        assert handler.tokenize_calls == calls + 1, "the oldest was dropped: at most CHAT_CACHE are kept"
    finally:
        backend.shutdown()


# --- 3. a series /metrics lacks is shown as not reported, never as 0 --------------------------------------------


def without(text: str, *series: str) -> str:
    """A /metrics payload without these series (their samples and their HELP/TYPE lines)."""
    return "\n".join(line for line in text.splitlines() if not any(name in line for name in series)) + "\n"


POOL = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:num_requests_")


def draw_everything(backend: VllmBackend) -> str:
    """The stats line, after every chart and view the live page draws was drawn from the backend (none may fail)."""
    import dataclasses

    from astrai.playground.views import charts, series, text

    stats = backend.stats()
    data = series.series(backend.history(0), stats, time.time())
    for chart in (charts.occupancy_chart, charts.lru_chart, charts.hit_rate_chart):
        chart(data)
    assert json.dumps(dataclasses.asdict(stats))  # what /cache_stats answers
    return text.stats_line(stats, backend.derived, backend.caveat)


def test_missing_metrics_are_not_reported_rather_than_zero(fake):
    from astrai.playground.views import charts, series

    url, handler = fake
    handler.metrics_text = without(fake_vllm.recorded_metrics(1000.0), *POOL, *COUNTERS)
    stub = StubSubscriber()
    backend = VllmBackend(url, subscriber=stub, sample_every_s=3600)
    try:
        for seq, payload in recorded()[:BEFORE_CLEAR]:  # 15 cached copies by the events
            stub.tracker.apply(seq, decode_batch(payload))
        backend._tick()
        stats = backend.stats()
        assert (stats.n_pages, stats.used_pages, stats.cached_pages, stats.free_pages) == (None,) * 4
        assert stats.page_size == 32, "the events carry the block size"
        assert (stats.query_tokens, stats.hit_tokens, stats.hit_rate, stats.recent_hit_rate) == (None,) * 4
        assert (stats.preemptions, stats.running, stats.waiting) == (None,) * 3
        line = draw_everything(backend)
        assert "**0**" not in line and " 0 " not in line.replace("· 0 evictions", ""), line  # (the events' count)
        assert "n/a pages in use" in line and "of n/a pages × 32 tokens" in line
        assert "Reuse so far:** n/a" in line and "n/a (vLLM does not report it) preemptions" in line
        data = series.series(backend.history(0), stats, time.time())
        assert all(r is None for r in data.hit_rate) and data.used[-1] is None
        assert "n/a" in charts.occupancy_chart(data).layout.title.text
        # the pool back, the counters still absent: occupancy is known again, reuse is still not
        handler.metrics_text = without(fake_vllm.recorded_metrics(1000.0), *COUNTERS)
        backend._tick()
        stats = backend.stats()
        assert (stats.n_pages, stats.used_pages, stats.cached_pages, stats.free_pages) == (21845, 0, 15, 21830)
        assert stats.hit_rate is None and "Reuse so far:** n/a" in draw_everything(backend)
        assert backend.generation == 1, "series coming and going is no restart"
    finally:
        backend.shutdown()
    handler.metrics_text = None  # the whole recorded payload: every number is reported
    backend = VllmBackend(url, sample_every_s=3600)
    try:
        stats = backend.stats()
        assert (stats.n_pages, stats.used_pages, stats.query_tokens, stats.hit_rate) == (21845, 0, 0, 0.0)
        assert "**0** pages in use" in draw_everything(backend)
    finally:
        backend.shutdown()


@pytest.mark.vllm
def test_vllm_real_server_reports_a_steady_start_time():
    """What restart detection reads is there on the real server, and two scrapes agree on it."""
    url = os.environ.get("ASTRAI_VLLM_URL")
    if not url:
        pytest.skip(NO_VLLM)
    first, second = (parse_metrics(httpx.get(url.rstrip("/") + "/metrics", timeout=5).text) for _ in range(2))
    assert first.process_start is not None and first.process_start < time.time()
    assert second.process_start == first.process_start and not second.restarted_since(first)
