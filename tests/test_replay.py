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
    assert [s.step for s in recording.samples] == sorted(truth)
    for index, step in enumerate((s.step for s in recording.samples), start=1):
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
    frames = len(recording.frames)
    assert first.startswith(f"step 1 of {frames} of your run (engine step {base.step + 1}): panels 1, 2, 3;")
    assert "panel 1 admitted" in first and "panel 3 admitted" in first
    assert "cached page" in first and "prompt tokens from cache" in first
    assert narrate(recording, 0) == f"before your run (engine step {base.step})"


def test_narration_of_a_page_the_base_never_held():
    """The vLLM backend's pages are the blocks its KV events told of: a block first stored during the run is absent
    from the run's base snapshot (CI caught ``after_run`` raising KeyError on one, leaving the badges unfilled)."""
    stored = PageRecord(3, "in_use", None, None, (7,), 0, b"k", None, 7, None, (1, 2))
    sample = StepSample(
        step=5, time=0.0, duration_s=0.0, free_pages=None, used_pages=1, cached_pages=None, prefill_tokens=None,
        decode_tokens=None, hit_tokens=0, query_tokens=2, evictions=None, preemptions=0, requests=(7,),
        sampled=(), page_changes=(stored,), admitted=((7, 2, 0),),
    )  # fmt: skip
    recording = Recording(CacheSnapshot(4, ()), (sample,), (7,))
    assert narrate(recording, 1).endswith("panel 1 admitted, 1 page allocated, 0 of 2 prompt tokens from cache")
    assert pages_at(recording, 1) == [stored]


def step(n: int, requests: tuple[int, ...], evictions: int = 0) -> StepSample:
    return StepSample(
        step=n, time=float(n), duration_s=0.01, free_pages=1, used_pages=1, cached_pages=0, prefill_tokens=1,
        decode_tokens=0, hit_tokens=0, query_tokens=0, evictions=evictions, preemptions=0, requests=requests,
        sampled=(), page_changes=(),
    )  # fmt: skip


def test_a_recording_ends_with_its_run_and_shows_only_its_own_steps():
    """Every after_run and every Stop appended all the engine's steps since the last sample, other visitors' too
    and without end (8 → 108 → 208 → 308 steps), and the slider counted the engine's steps while the narration
    named the run's. Now a recording closes at the step that recorded its run's end, and frames are its own."""
    base = CacheSnapshot(10, ())
    recording = Recording(base, (), (1, 2), generation=3)
    history = [step(11, (1, 2)), step(12, (9,), evictions=2), step(13, (2,)), step(14, ()), step(15, (9,))]
    open_ = recording.extended(history[:3], end_step=None, ended=False)
    assert not open_.closed and open_.frames == [1, 3]
    closed = open_.extended(history, end_step=14, ended=True)
    assert closed.closed and [s.step for s in closed.samples] == [11, 12, 13, 14]
    assert closed.frames == [1, 3, 4]  # its two steps, and the step that recorded its end
    assert closed.extended([*history, step(16, (1,))], end_step=16, ended=True) is closed
    assert narrate(closed, 2).startswith("step 2 of 3 of your run (engine step 13): panel 2;")
    assert narrate(closed, 2).endswith("before it, 1 step of other sessions (2 evictions)")
    assert closed.samples_at(0) == 0 and closed.samples_at(2) == 3 and closed.samples_at(9) == 4
