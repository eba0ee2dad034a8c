"""Failures stay contained: cancellation, injected faults, bad input, threads, shutdown."""

from __future__ import annotations

import math
import threading
import time

import pytest

from astrai import EngineClosedError, InferenceEngine, RequestFailedError
from astrai.testing import make_model, make_tokenizer

PROMPT = "Once upon a time there was a little cat."


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model("llama", len(tokenizer))


@pytest.fixture
def engine(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, max_seq_len=200) as eng:
        yield eng


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_closing_a_stream_cancels_and_releases_pages(engine):
    stream = engine.generate([PROMPT, "The dog"], max_tokens=150, stream=True)
    next(stream)
    assert engine.cache_stats()["used_pages"] > 0
    stream.close()
    assert wait_until(lambda: engine.cache_stats()["used_pages"] == 0, timeout=2)
    assert {i["status"] for i in engine.request_info(stream.request_ids)} == {"cancelled"}


def test_leaving_a_for_loop_cancels(engine):
    for _ in engine.generate(PROMPT, max_tokens=150, stream=True):
        break
    assert wait_until(lambda: engine.cache_stats()["used_pages"] == 0, timeout=2)
    assert engine.cache_stats()["running"] == 0


def test_a_faulty_step_fails_only_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    expected = engine.generate(PROMPT, max_tokens=8)
    real_step = engine.runner.step
    calls = {"n": 0}

    def flaky(work):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault in the forward")
        return real_step(work)

    monkeypatch.setattr(engine.runner, "step", flaky)
    with pytest.raises(RequestFailedError, match="injected fault"):
        engine.generate(PROMPT, max_tokens=8)
    assert engine.cache_stats()["used_pages"] == 0
    assert engine.generate(PROMPT, max_tokens=8) == expected
    engine.pool.check_invariants()


def test_a_faulty_scheduler_step_does_not_kill_the_loop(engine, monkeypatch):
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("injected scheduler bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    with pytest.raises(RequestFailedError, match="injected scheduler bug"):
        engine.generate(PROMPT, max_tokens=4)
    assert engine.generate(PROMPT, max_tokens=4)


BAD_CALLS = [
    ("", {}, ValueError, "empty"),
    ("   \n", {}, ValueError, "empty"),
    ([], {}, ValueError, "empty list"),
    (["ok", 3], {}, TypeError, "prompt 1 must be a str"),
    (42, {}, TypeError, "must be a str or a list"),
    ("bad \udc80 surrogate", {}, ValueError, "not valid UTF-8"),
    (PROMPT, {"max_tokens": 0}, ValueError, "max_tokens"),
    (PROMPT, {"max_tokens": -5}, ValueError, "max_tokens"),
    (PROMPT, {"max_tokens": 10**9}, ValueError, "max_seq_len"),
    (PROMPT * 40, {"max_tokens": 8}, ValueError, "max_seq_len"),
    (PROMPT, {"temperature": math.nan}, ValueError, "temperature"),
    (PROMPT, {"temperature": -1.0}, ValueError, "temperature"),
    (PROMPT, {"top_p": 0.0}, ValueError, "top_p"),
    (PROMPT, {"top_p": 1.5}, ValueError, "top_p"),
    (PROMPT, {"top_p": math.nan}, ValueError, "top_p"),
    (PROMPT, {"top_k": -1}, ValueError, "top_k"),
    (PROMPT, {"seed": -1}, ValueError, "seed"),
    (PROMPT, {"seed": 2**64}, ValueError, "seed"),
    (PROMPT, {"cache_salt": 5}, TypeError, "cache_salt"),
]


@pytest.mark.parametrize(("prompts", "kwargs", "error", "message"), BAD_CALLS)
def test_bad_input_gets_a_clear_error_and_loses_nothing(engine, prompts, kwargs, error, message):
    with pytest.raises(error, match=message):
        engine.generate(prompts, **kwargs)
    assert engine.cache_stats()["running"] == engine.cache_stats()["waiting"] == 0
    assert engine.generate(PROMPT, max_tokens=2)


def test_a_prompt_larger_than_the_pool_is_rejected_at_submit(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=4) as small, pytest.raises(ValueError, match="pool"):
        small.generate(PROMPT, max_tokens=8)


def test_eight_threads_generate_at_once(engine):
    prompts = [PROMPT, "The dog", "Lily and Tom", "小猫在花园里玩。"]
    expected = {p: engine.generate(p, max_tokens=12) for p in prompts}
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = engine.generate(prompts[i % len(prompts)], max_tokens=12)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 8
    assert all(results[i] == expected[prompts[i % len(prompts)]] for i in range(8))
    assert engine.cache_stats()["used_pages"] == 0


def test_shutdown_fails_running_requests_promptly_and_later_calls_raise(model, tokenizer):
    engine = InferenceEngine(model, tokenizer, page_size=4, n_pages=256)
    stream = engine.generate([PROMPT, "The dog"], max_tokens=500, stream=True)
    next(stream)
    started = time.monotonic()
    engine.shutdown()
    with pytest.raises(EngineClosedError):
        list(stream)
    assert time.monotonic() - started < 5
    assert not engine._thread.is_alive()
    with pytest.raises(EngineClosedError, match="shut down"):
        engine.generate(PROMPT)
