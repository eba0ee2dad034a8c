"""The observation API: typed counters that never lie, events and step history that never block the loop."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from astrai import InferenceEngine
from astrai.observation import (
    CacheCleared,
    PageEvicted,
    PageStored,
    RequestAdmitted,
    RequestFinished,
    RequestPreempted,
)
from tests.support.tiny_models import make_model
from tests.support.waiting import wait_until

SHARED = "Once upon a time there was a little cat. "
PROMPTS = [SHARED + "The dog", SHARED + "Lily and Tom", SHARED + "The sun"]


@pytest.fixture
def tight(model, tokenizer):
    """A pool too small for three long generations: they evict and preempt each other."""
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=24, max_seq_len=200, compile=False) as engine:
        yield engine


def test_hits_count_each_prompt_once_under_preemption(tight, tokenizer):
    """A re-admitted request is counted apart, so hits can never exceed the prompt tokens submitted."""
    tight.generate(PROMPTS, max_tokens=40)
    stats = tight.cache_stats()
    assert stats.preemptions > 0, "the scenario must preempt to test anything"
    submitted = sum(len(tokenizer(p).input_ids) for p in PROMPTS)
    assert stats.query_tokens == submitted
    assert 0 < stats.hit_tokens <= stats.query_tokens and 0 < stats.hit_rate <= 1
    assert stats.readmitted_query_tokens > 0  # the re-admissions are there, counted apart


def test_a_readmission_never_reports_more_cached_prompt_tokens_than_the_prompt_has(tight):
    """A re-admitted request looks up its prompt and its output so far: the event reports the two apart, so its
    ``cached_tokens`` stays within the prompt, and the events add up to the counters."""
    tight.generate(PROMPTS, max_tokens=40)
    admitted = [e for e in tight.events() if isinstance(e, RequestAdmitted)]
    assert all(e.cached_tokens <= e.prompt_tokens for e in admitted), [e for e in admitted if e.readmission]
    readmitted = [e for e in admitted if e.readmission]
    assert any(e.cached_output_tokens for e in readmitted), "the scenario must bring output pages back from cache"
    assert not any(e.cached_output_tokens for e in admitted if not e.readmission)
    stats = tight.cache_stats()
    assert sum(e.cached_tokens for e in admitted if not e.readmission) == stats.hit_tokens
    readmitted_hits = sum(e.cached_tokens + e.cached_output_tokens for e in readmitted)
    assert readmitted_hits == stats.readmitted_hit_tokens < stats.readmitted_query_tokens


def test_events_are_typed_numbered_and_stamped_with_their_step(tight):
    tight.generate(PROMPTS, max_tokens=40)
    tight.clear()
    events = tight.events()
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))
    assert all(0 < e.step <= tight.steps + 1 for e in events)
    assert [e.step for e in events] == sorted(e.step for e in events)
    kinds = {type(e) for e in events}
    assert {PageStored, PageEvicted, RequestAdmitted, RequestPreempted, RequestFinished, CacheCleared} <= kinds
    stored = next(e for e in events if isinstance(e, PageStored))
    assert len(stored.token_ids) == 4 and stored.chain_pos >= 0 and stored.key
    readmitted = [e for e in events if isinstance(e, RequestAdmitted) and e.readmission]
    assert readmitted and len(readmitted) == sum(isinstance(e, RequestPreempted) for e in events)
    assert {e.status for e in events if isinstance(e, RequestFinished)} == {"finished"}
    assert tight.events(after=events[-1].seq) == []


def test_evictions_name_the_request_they_made_room_for_and_pages_their_namespace(tight):
    """What the explainer reads: an eviction's requester and the eviction order's length then, and the namespace
    (a digest of the salt, never the salt) of each stored page and admitted request."""
    tight.generate(PROMPTS, max_tokens=40)
    tight.generate(PROMPTS[:1], max_tokens=2, cache_salt="alice")
    events = tight.events()
    admitted = {e.request: e for e in events if isinstance(e, RequestAdmitted) and not e.readmission}
    evicted = [e for e in events if isinstance(e, PageEvicted)]
    assert evicted and all(e.for_request in admitted and e.evictable >= 1 for e in evicted)
    stored = [e for e in events if isinstance(e, PageStored)]
    assert all(e.namespace == admitted[e.request].namespace for e in stored)
    namespaces = {e.namespace for e in admitted.values()}
    assert len(namespaces) == 2 and all(len(n) == 8 and b"alice" not in n for n in namespaces)


def test_step_history_has_one_sample_per_step_that_adds_up(tight, tokenizer):
    states: list[tuple[int, int, int]] = []  # (free, in use, cached) pages of a snapshot taken with each sample
    record = tight._record_step

    def record_and_count(*args):
        record(*args)
        pages = tight.cache_snapshot().pages
        states.append(tuple(sum(p.state == state for p in pages) for state in ("free", "in_use", "cached")))

    tight._record_step = record_and_count
    tight.generate(PROMPTS, max_tokens=40)
    history = tight.history()
    stats = tight.cache_stats()
    assert [s.step for s in history] == list(range(1, stats.steps + 1))
    assert sum(s.hit_tokens for s in history) == stats.hit_tokens
    assert sum(s.query_tokens for s in history) == stats.query_tokens
    assert sum(s.evictions for s in history) == stats.evictions > 0
    assert sum(s.preemptions for s in history) == stats.preemptions
    assert all(s.free_pages + s.used_pages + s.cached_pages == stats.n_pages for s in history)
    assert [(s.free_pages, s.used_pages, s.cached_pages) for s in history] == states  # each counted on its own
    assert sum(s.decode_tokens for s in history) > 0 and sum(s.prefill_tokens for s in history) > 0
    assert tight.history(after_step=history[-2].step) == history[-1:]


def test_readers_of_events_and_history_never_wait_for_the_engine_lock(tight):
    tight.generate(PROMPTS[0], max_tokens=4)
    answered = threading.Event()
    with tight._lock:  # as if the loop were in a long schedule
        reader = threading.Thread(target=lambda: (tight.events(), tight.history(), answered.set()), daemon=True)
        reader.start()
        assert answered.wait(2), "events()/history() blocked on the engine lock"


def test_request_info_stays_bounded_while_an_old_request_runs(model, tokenizer, monkeypatch):
    """The oldest remembered request still running must not stop finished ones from being forgotten."""
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=128, keep_finished=8, compile=False) as engine:
        long = engine.generate("Once upon a time", max_tokens=400, stream=True)
        next(long)
        for _ in range(30):
            engine.generate("The dog", max_tokens=1)
        assert len(engine._ended) <= 8 and len(engine._live) == 1
        assert engine.request_info(long.request_ids)[0].status == "running"
        long.close()


def test_shutdown_with_a_forward_still_running_waits_for_it_before_freeing(model, tokenizer):
    engine = InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False)
    real_step = engine.runner.step
    in_forward, finish = threading.Event(), threading.Event()
    held_at_end: list[int] = []

    def slow_step(work):
        in_forward.set()
        finish.wait(10)
        held_at_end.append(min(engine.pool.ref_count[p] for req, _ in work for p in req.pages))
        return real_step(work)

    engine.runner.step = slow_step
    stream = engine.generate("Once upon a time", max_tokens=50, stream=True)
    assert in_forward.wait(5)
    started = time.monotonic()
    assert engine.shutdown(timeout=0.3) is False  # the forward is still running
    assert time.monotonic() - started < 2
    with pytest.raises(Exception, match="shut down"):  # the consumer is told at once
        list(stream)
    assert engine.runner.model.config._attn_implementation == "astrai_paged"  # not handed back under a forward
    finish.set()
    assert wait_until(lambda: not engine._thread.is_alive(), timeout=10)
    assert held_at_end == [1], "pages were freed while the forward still used them"
    assert engine.request_info(stream.request_ids)[0].status == "failed"
    assert engine.cache_stats().used_pages == 0
    assert engine.runner.model.config._attn_implementation != "astrai_paged"


def test_the_model_is_handed_back_with_its_dtype_mode_and_exact_weights(tokenizer):
    model = make_model("llama", len(tokenizer)).train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=32, dtype="bfloat16", compile=False) as engine:
        assert engine.generate("Once upon a time", max_tokens=4)
        assert not model.training and next(model.parameters()).dtype == torch.bfloat16
    assert model.training
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)


def test_importing_astrai_imports_no_ui_library():
    code = "import sys, astrai, astrai.playground; print(sorted({'gradio', 'plotly', 'pandas'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_history_counts_every_prompt_token_as_prefill_and_every_later_token_as_decode(model, tokenizer):
    """A request's last decode token was counted as prefill: the loop ended the request (which resets its progress)
    before it counted the step. Counted before, a run of N prompt tokens and G generated ones is N prefill tokens and
    G - 1 decode tokens (the last sampled token is never computed), whatever ends the request."""
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False) as engine:
        prompts = ["Once upon a time there was a cat", "The dog"]
        engine.generate(prompts, max_tokens=5, temperature=0.0)
        infos = engine.request_info(list(range(0, 10**6)))[-2:]
        history = engine.history()
        assert sum(s.prefill_tokens for s in history) == sum(i.prompt_tokens for i in infos)
        assert sum(s.decode_tokens for s in history) == sum(i.generated_tokens - 1 for i in infos)
        assert history[-1].decode_tokens == len(prompts) and history[-1].prefill_tokens == 0


def test_a_preempted_request_counts_what_it_computes_again(tight, tokenizer):
    """Recomputation after a preemption is real prefill work: each request says how many tokens it computed again,
    and they add up to the history's prefill tokens beyond the prompts' uncached tokens."""
    tight.generate(PROMPTS, max_tokens=40)
    infos = [i for i in tight.request_info(list(range(0, 10**6))) if i.status == "finished"][-len(PROMPTS) :]
    assert any(i.preemptions for i in infos), "the scenario must preempt to test anything"
    assert all((i.recomputed_tokens > 0) == (i.preemptions > 0) for i in infos), infos
    first_pass = sum(i.prompt_tokens - i.cached_tokens for i in infos)
    assert sum(s.prefill_tokens for s in tight.history()) == first_pass + sum(i.recomputed_tokens for i in infos)
