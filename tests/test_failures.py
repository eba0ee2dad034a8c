"""Failures stay contained: cancellation, injected faults, bad input, threads, shutdown."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from astrai import EngineClosedError, InferenceEngine, RequestFailedError
from tests.support.waiting import wait_until
from tools.bad_inputs import BAD_CALLS, BAD_CHECKPOINTS, MAX_SEQ_LEN, PROMPT, report


@pytest.fixture
def engine(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, max_seq_len=MAX_SEQ_LEN, compile=False) as eng:
        yield eng


def slow_down(engine: InferenceEngine, monkeypatch, seconds: float = 0.02) -> None:
    """Make every step take ``seconds`` longer, so a long request cannot end on its own within a short wait."""
    real_step = engine.runner.step

    def slow(work):
        time.sleep(seconds)
        return real_step(work)

    monkeypatch.setattr(engine.runner, "step", slow)


def test_closing_a_stream_cancels_and_releases_pages(engine, monkeypatch):
    slow_down(engine, monkeypatch)  # 150 tokens now take over 3 s, longer than the waits below
    stream = engine.generate([PROMPT, "The dog"], max_tokens=150, stream=True)
    next(stream)
    assert engine.cache_stats().used_pages > 0
    stream.close()
    assert wait_until(lambda: engine.cache_stats().used_pages == 0, timeout=2)
    assert [i.status for i in engine.request_info(stream.request_ids)] == ["cancelled", "cancelled"]


def test_leaving_a_for_loop_cancels(engine, monkeypatch):
    slow_down(engine, monkeypatch)
    for _ in engine.generate(PROMPT, max_tokens=150, stream=True):
        break  # the stream is dropped here: dropping it cancels
    assert wait_until(lambda: engine.cache_stats().cancelled == 1, timeout=2)
    stats = engine.cache_stats()
    assert stats.used_pages == 0 and stats.running == 0 and stats.finished == 0


def test_cancel_from_another_thread_ends_the_stream_being_read(engine, monkeypatch):
    slow_down(engine, monkeypatch)
    stream = engine.generate([PROMPT, "The dog"], max_tokens=150, stream=True)
    next(stream)
    threading.Timer(0.1, engine.cancel, args=(stream.request_ids,)).start()
    started = time.monotonic()
    list(stream)  # ends instead of waiting forever for requests that will never produce again
    assert time.monotonic() - started < 2
    assert [i.status for i in engine.request_info(stream.request_ids)] == ["cancelled", "cancelled"]


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
    assert engine.cache_stats().used_pages == 0
    assert engine.generate(PROMPT, max_tokens=8) == expected
    engine.pool.check_invariants()


def test_a_faulty_scheduler_step_does_not_kill_the_loop(engine, monkeypatch):
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("injected scheduler bug")
        return real(*args)

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    with pytest.raises(RequestFailedError, match="injected scheduler bug"):
        engine.generate(PROMPT, max_tokens=4)
    assert engine.generate(PROMPT, max_tokens=4)


@pytest.mark.parametrize("bad", BAD_CALLS, ids=[b.case for b in BAD_CALLS])
def test_bad_input_gets_a_clear_error_and_loses_nothing(engine, bad):
    with pytest.raises(bad.error, match=bad.match):
        engine.generate(bad.prompts, **bad.kwargs)
    assert engine.cache_stats().running == engine.cache_stats().waiting == 0
    assert engine.generate(PROMPT, max_tokens=2)


def test_the_bad_input_report_lists_every_case_with_its_error():
    rows = report().splitlines()[2:]
    # + a model shared by two engines prepared differently + pool overflow + unknown model id
    assert len(rows) == len(BAD_CALLS) + 3 + len(BAD_CHECKPOINTS)
    assert all(re.search(r"\| `(ValueError|TypeError|ModelLoadError)`: \w", row) for row in rows), rows
    assert not any(row.endswith("| NO |") for row in rows)


def test_a_model_cannot_serve_two_engines_prepared_differently(engine):
    """A second engine in another dtype would re-wire the first one's layers under it; it is refused, and the first
    serves on (engines that agree share the model: tests/test_shared_weights.py)."""
    expected = engine.generate(PROMPT, max_tokens=6)
    with pytest.raises(ValueError, match="already serves another InferenceEngine.*dtype=bfloat16"):
        InferenceEngine(engine.runner.model, engine.tokenizer, page_size=4, n_pages=8, dtype="bfloat16", compile=False)
    assert engine.generate(PROMPT, max_tokens=6) == expected


def test_a_prompt_larger_than_the_pool_is_rejected_at_submit(model, tokenizer):
    with (
        InferenceEngine(model, tokenizer, page_size=4, n_pages=4, compile=False) as small,
        pytest.raises(ValueError, match="pool"),
    ):
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
    assert engine.cache_stats().used_pages == 0


def test_shutdown_fails_running_requests_promptly_and_later_calls_raise(model, tokenizer):
    engine = InferenceEngine(model, tokenizer, page_size=4, n_pages=256, compile=False)
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


def test_a_script_that_returns_while_its_engine_generates_exits_cleanly():
    """The loop is a daemon thread: a script that stops reading a stream and returns must not crash at exit.

    Without the engine's exit hook, the interpreter ended the loop mid-step, inside torch's C++ code, and the
    process aborted ("terminate called without an active exception", exit status 134) every time.
    """
    code = (
        "from astrai import InferenceEngine\n"
        "engine = InferenceEngine.from_pretrained('assets/models/tinystories-llama', compile=False)\n"
        "stream = engine.generate(['Once upon a time'] * 4, max_tokens=400, stream=True)\n"
        "print(next(stream))\n"
    )
    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
