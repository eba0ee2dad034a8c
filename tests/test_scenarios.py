"""The scenarios teach what they say: checked against the embedded model's tokenizer and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai import InferenceEngine
from astrai.playground.backends.profiles import EMBEDDED_MODEL
from astrai.playground.scenarios import FOLLOW_UP, SCENARIO_BY_NAME


@pytest.fixture(scope="module")
def engine():
    with InferenceEngine.from_pretrained(EMBEDDED_MODEL, page_size=16, n_pages=256, compile=False) as eng:
        yield eng


def cached(engine: InferenceEngine, prompts: list[str], **kwargs) -> list[int]:
    stream = engine.generate(prompts, stream=True, **kwargs)
    list(stream)
    return [info.cached_tokens for info in engine.request_info(stream.request_ids)]


def test_same_page_different_prefix_has_equal_full_pages_that_do_not_hit(engine):
    scenario = SCENARIO_BY_NAME["Same page, different prefix"]
    a, b = (engine.tokenizer(p).input_ids for p in scenario.prompts)
    equal_full_pages = [k for k in range(1, (len(b) - 1) // 16) if a[16 * k : 16 * (k + 1)] == b[16 * k : 16 * (k + 1)]]
    assert equal_full_pages, "the lesson needs a full page with equal tokens after page 0"
    engine.clear()
    assert cached(engine, scenario.prompts[:1], max_tokens=1) == [0]
    assert cached(engine, scenario.prompts[1:], max_tokens=1) == [0]  # the chained key refuses them


def test_shared_system_prompt_hits_in_the_first_run(engine):
    scenario = SCENARIO_BY_NAME["Shared system prompt"]
    engine.clear()
    hits = cached(engine, [scenario.prefix + p for p in scenario.prompts], max_tokens=2)
    assert hits[0] == 0 and min(hits[1:]) >= 32


def test_eviction_pressure_evicts_and_preempts():
    scenario = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
    s = scenario.profile.settings
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL, page_size=s.page_size, n_pages=s.n_pages, max_batch_size=s.max_batch_size, compile=False
    ) as engine:
        for _ in range(2):
            engine.generate(scenario.prompts, max_tokens=scenario.max_tokens)
        stats = engine.cache_stats()
    assert stats.evictions > 0 and stats.preemptions > 0 and stats.used_pages == 0


def test_distinct_prompts_hit_nothing(engine):
    engine.clear()
    assert cached(engine, SCENARIO_BY_NAME["Distinct prompts (no hits)"].prompts, max_tokens=2) == [0, 0, 0, 0]


def test_a_follow_up_turn_hits_past_the_first_prompt(engine):
    scenario = SCENARIO_BY_NAME["Follow-up turn"]
    engine.clear()
    answers = engine.generate(scenario.prompts, max_tokens=scenario.max_tokens)
    second = [p + a + FOLLOW_UP for p, a in zip(scenario.prompts, answers, strict=True)]
    first_lengths = [len(engine.tokenizer(p).input_ids) for p in scenario.prompts]
    hits = cached(engine, second, max_tokens=2)
    assert all(hit > first for hit, first in zip(hits, first_lengths, strict=True)), (hits, first_lengths)


def test_caching_off_computes_every_prompt_token_and_on_computes_fewer(engine):
    scenario = SCENARIO_BY_NAME["Shared system prompt"]
    prompts = [scenario.prefix + p for p in scenario.prompts]
    engine.clear()
    on = cached(engine, prompts, max_tokens=2)
    off = cached(engine, prompts, max_tokens=2, cache_salt=[f"no-sharing-{i}" for i in range(len(prompts))])
    assert off == [0, 0, 0, 0] and sum(on) > 0


def test_every_lesson_step_loads_a_scenario_and_names_a_view():
    from astrai.playground.scenarios import LESSON

    assert len(LESSON) == 8 and all(step.scenario in SCENARIO_BY_NAME for step in LESSON)
    ui = (Path(__file__).parents[1] / "astrai" / "playground" / "ui" / "layout.py").read_text()
    assert all(f'elem_id="{step.look_at}"' in ui for step in LESSON)


def test_why_did_it_miss_shows_what_its_lesson_step_says():
    """Lesson step 8's text, cause by cause, on the scenario's own engine settings and a cold namespace."""
    from astrai.explain import Cause
    from astrai.playground.scenarios import LESSON, WHY

    assert LESSON[7].scenario == WHY.name
    s = WHY.profile.settings
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL, page_size=s.page_size, n_pages=s.n_pages, max_batch_size=s.max_batch_size, compile=False
    ) as engine:
        stream = engine.generate(WHY.prompts, max_tokens=WHY.max_tokens, stream=True, cache_salt="a cold namespace")
        list(stream)
        whys = engine.explain(stream.request_ids)
    size = s.page_size
    first, second, third, fourth = ([(seg.cause, seg.start, seg.end) for seg in w.segments] for w in whys)
    assert whys[0].counts[Cause.CACHED] == 0 and whys[0].counts[Cause.NEW] > 0, first  # panel 1: new
    assert first[-1][0] is Cause.LAST_TOKEN
    assert second[0] == (Cause.DIVERGED, 0, size) and whys[1].segments[0].divergence.at == 1, second  # after ⟨s⟩
    assert second[1][0] is Cause.NEW, second
    assert third[0][:2] == (Cause.CACHED, 0) and third[0][2] % size == 0 and third[1][0] is Cause.EVICTED, third
    assert whys[2].segments[1].page.evicted_for == stream.request_ids[1], "evicted for panel 2's answer"
    assert fourth[:2] == [(Cause.CACHED, 0, size), (Cause.DIVERGED, size, 2 * size)], fourth
    for why in whys:  # whatever follows the last full page is a partial page, and the last token is computed
        assert why.segments[-1].cause is Cause.LAST_TOKEN and why.segments[-1].end == why.prompt_tokens
        assert why.counts[Cause.PARTIAL_PAGE] == max(0, why.prompt_tokens - 1 - why.prompt_tokens // size * size)
