"""A fast cold start: an engine given a ``background_compile`` serves eager at once, builds its compiled forward on a
thread (``precompile.in_child``: in a child process, then loaded), and switches to it between two forwards, with the
same greedy output; ``CacheStats.forward`` says which serves, and a build that fails leaves it serving eager.

One cold compile here (the module's fixture), in a child process, as the playground does at its start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from astrai import InferenceEngine, compiled_forward, precompile
from astrai.checkpoints import load_checkpoint
from astrai.compiled_forward import Compiled
from tests.support.tiny_models import reference_generate, write_checkpoint
from tests.support.waiting import wait_until

PROMPT = "Once upon a time there was a little cat."


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> Iterator[tuple]:
    """A tiny checkpoint, an empty compile cache, and an engine that was built on it with ``precompile.in_child``
    (the forwards it reported while it started, polled from its stats)."""
    folder = tmp_path_factory.mktemp("cold")
    checkpoint = write_checkpoint(folder / "tiny", "safetensors")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folder / "cache"))  # the child inherits it
        model, tokenizer = load_checkpoint(str(checkpoint), "float32")
        reference = reference_generate(model, tokenizer, PROMPT, 24)
        with InferenceEngine(
            model,
            tokenizer,
            page_size=4,
            n_pages=64,
            background_compile=precompile.in_child(str(checkpoint), "float32"),
        ) as engine:
            seen = [engine.cache_stats().forward]
            eager = _ids(engine, 24)
            seen.append(engine.cache_stats().forward)
            assert wait_until(lambda: engine.cache_stats().forward != "compiling", timeout=900, interval=0.2)
            seen.append(engine.cache_stats().forward)
            compiled = _ids(engine, 24)
            yield folder, engine.runner.compiled, seen, reference, eager, compiled


def _ids(engine: InferenceEngine, n: int) -> list[int]:
    stream = engine.generate(PROMPT, max_tokens=n, stream=True)
    for _ in stream:
        pass
    (info,) = engine.request_info(stream.request_ids)
    return list(info.output_ids)


def test_a_cold_engine_serves_eager_at_once_then_the_compiled_forward(cold):
    _, compiled, seen, *_ = cold
    assert seen[0] == "compiling", "the constructor returned before any compile"
    assert seen[-1] == "compiled" and compiled is not None, seen
    assert compiled.loaded, "the serving process traced nothing: it loaded what the child compiled"


def test_the_greedy_output_is_the_same_eager_and_compiled(cold):
    *_, reference, eager, compiled = cold
    assert eager == compiled == reference


def _counting(compiled: Compiled, calls: list[int]) -> Compiled:
    def forward(*args):
        calls.append(1)
        return compiled.forward(*args)

    return Compiled(forward, loaded=compiled.loaded, seconds=compiled.seconds)


def test_the_switch_falls_between_two_steps_of_a_running_request_and_reaches_every_engine_on_the_model(
    cold, monkeypatch
):
    """The compiled forward takes over a request in the middle of its decode, reading the KV its eager steps wrote,
    and a second engine on the model, built while the first compiled, switches with it."""
    folder, *_ = cold
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))
    model, tokenizer = load_checkpoint(str(folder / "tiny"), "float32")
    n = 300
    reference = reference_generate(model, tokenizer, PROMPT, n)
    calls: list[int] = []
    midway = threading.Event()

    def build(prepared_model) -> Compiled | None:
        loaded = compiled_forward.load(prepared_model)  # cached by the fixture's child
        assert loaded is not None
        midway.wait(timeout=60)
        return _counting(loaded, calls)

    with (
        InferenceEngine(model, tokenizer, page_size=4, n_pages=128, background_compile=build) as engine,
        InferenceEngine(model, tokenizer, page_size=4, n_pages=16) as other,
    ):
        assert engine.cache_stats().forward == other.cache_stats().forward == "compiling"
        stream = engine.generate(PROMPT, max_tokens=n, stream=True)
        for i, _ in enumerate(stream):
            if i == 8:
                midway.set()
        (info,) = engine.request_info(stream.request_ids)
        assert list(info.output_ids) == reference
        assert 0 < len(calls) < n - 8, f"{len(calls)} of {n} tokens compiled: the request did not straddle the switch"
        assert other.cache_stats().forward == "compiled"
        before = len(calls)
        assert other.generate(PROMPT, max_tokens=4) and len(calls) > before, "the second engine serves it too"


@pytest.mark.parametrize("outcome", ["none", "raises"])
def test_a_compile_that_fails_leaves_the_engine_serving_eager_and_says_so(outcome, model, tokenizer, caplog):
    def build(_model) -> Compiled | None:
        if outcome == "raises":
            raise RuntimeError("no C++ compiler here")
        return None

    expected = reference_generate(model, tokenizer, PROMPT, 8)
    with (
        caplog.at_level("WARNING", logger="astrai"),
        InferenceEngine(model, tokenizer, page_size=4, n_pages=64, background_compile=build) as engine,
    ):
        assert wait_until(lambda: engine.cache_stats().forward == "failed", timeout=30)
        assert engine.runner.compiled is None
        assert _ids(engine, 8) == expected
    assert outcome == "none" or "no C++ compiler here" in caplog.text


def test_an_engine_asked_not_to_compile_serves_eager_and_never_builds(model, tokenizer):
    def build(_model) -> Compiled | None:
        raise AssertionError("built although compile=False")

    with InferenceEngine(model, tokenizer, page_size=4, n_pages=16, compile=False, background_compile=build) as engine:
        time.sleep(0.2)
        assert engine.cache_stats().forward == "eager"
