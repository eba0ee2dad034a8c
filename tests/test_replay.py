"""Replay rebuilds, step by step, exactly the pool the engine had: checked against snapshots taken at each step."""

from __future__ import annotations

from astrai import InferenceEngine
from astrai.observation import CacheSnapshot, PageRecord, StepSample
from astrai.playground.views.replay import Recording, narrate, pages_at, tokens_at

SHARED = "Once upon a time there was a little cat. "
PROMPTS = [SHARED + "The dog", SHARED + "Lily and Tom", SHARED + "The sun"]


def test_pages_and_tokens_at_every_step_equal_the_engines_own_record(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=24, max_seq_len=200, compile=False) as engine:
        engine.generate(PROMPTS[:1], max_tokens=6)  # a warm cache: the run starts from a non-empty pool
        truth: dict[int, CacheSnapshot] = {}
        real_record = engine._record_step

        def record_and_snapshot(*args, **kwargs):
            real_record(*args, **kwargs)
            truth[engine.steps] = engine.cache_snapshot()  # the pool right after this step, under the lock

        engine._record_step = record_and_snapshot
        base = engine.cache_snapshot()
        stream = engine.generate(PROMPTS, max_tokens=40, stream=True)
        outputs = ["", "", ""]
        for index, delta in stream:
            outputs[index] += delta
        infos = engine.request_info(stream.request_ids)
        recording = Recording(base, tuple(engine.history(after_step=base.step)), tuple(stream.request_ids))
        stats = engine.cache_stats()
    assert stats.evictions > 0 and stats.preemptions > 0, "the run must evict and preempt to test anything"
    assert recording.steps == sorted(truth)
    for index, step in enumerate(recording.steps, start=1):
        rebuilt, expected = pages_at(recording, index), list(truth[step].pages)
        differing = [(a, b) for a, b in zip(rebuilt, expected, strict=True) if a != b]
        assert not differing, f"step {step}: {differing[:2]}"
    assert pages_at(recording, 0) == list(base.pages)
    assert tokens_at(recording, len(recording.samples)) == [list(i.output_ids) for i in infos]
    assert all(len(t) <= 40 for t in tokens_at(recording, len(recording.samples) // 2))


def test_narration_says_who_was_admitted_and_what_it_hit(model, tokenizer):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False) as engine:
        engine.generate(PROMPTS[0], max_tokens=2)
        base = engine.cache_snapshot()
        stream = engine.generate(PROMPTS, max_tokens=3, stream=True)
        list(stream)
        recording = Recording(base, tuple(engine.history(after_step=base.step)), tuple(stream.request_ids))
    first = narrate(recording, 1)
    assert first.startswith(f"step {base.step + 1}: panels 1, 2, 3;")
    assert "panel 1 admitted" in first and "panel 3 admitted" in first
    assert "cached page" in first and "prompt tokens from cache" in first
    assert narrate(recording, 0) == f"step {base.step}: before the run"


def test_narration_of_a_page_the_base_never_held():
    """The vLLM backend's pages are the blocks its KV events told of: a block first stored during the run is absent
    from the run's base snapshot (CI caught ``after_run`` raising KeyError on one, leaving the badges unfilled)."""
    stored = PageRecord(3, "in_use", None, None, (7,), 0, b"k", None, 7, None, (1, 2))
    sample = StepSample(
        step=5, time=0.0, duration_s=0.0, free_pages=None, used_pages=1, cached_pages=None, prefill_tokens=None,
        decode_tokens=None, hit_tokens=0, query_tokens=2, evictions=None, preemptions=0, requests=(7,),
        sampled=(), page_changes=(stored,),
    )  # fmt: skip
    recording = Recording(CacheSnapshot(4, ()), (sample,), (7,))
    assert narrate(recording, 1).endswith("panel 1 admitted, 1 page allocated")
    assert pages_at(recording, 1) == [stored]
