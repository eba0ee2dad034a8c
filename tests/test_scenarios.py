"""The scenarios teach what they say: checked against the embedded model's tokenizer and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai import InferenceEngine
from astrai.playground import promises
from astrai.playground.backends.profiles import EMBEDDED_MODEL
from astrai.playground.promises import Panel, Seen
from astrai.playground.scenarios import FOLLOW_UP, LESSON, SCENARIO_BY_NAME


@pytest.fixture(scope="module")
def engine():
    with InferenceEngine.from_pretrained(EMBEDDED_MODEL, page_size=16, n_pages=256, compile=False) as eng:
        yield eng


def run(engine: InferenceEngine, prompts: list[str], **kwargs) -> tuple[tuple[Panel, ...], list[str]]:
    """One run of ``prompts``: each panel as its badge and request table would tell it, and its answer."""
    stream = engine.generate(prompts, stream=True, **kwargs)
    answers = [""] * len(prompts)
    for index, delta in stream:
        answers[index] += delta
    whys = engine.explain(stream.request_ids)
    infos = engine.request_info(stream.request_ids)
    return tuple(Panel(i.prompt_tokens, i.cached_tokens, w.counts) for i, w in zip(infos, whys, strict=True)), answers


def panels(engine: InferenceEngine, prompts: list[str], **kwargs) -> tuple[Panel, ...]:
    return run(engine, prompts, **kwargs)[0]


def promise_of(step: int, *runs: tuple[Panel, ...], page_size: int = 16, **figures) -> list[str]:
    """How these runs break lesson step ``step``'s (1-based) promise (``astrai.playground.promises``)."""
    return promises.check(LESSON[step - 1], Seen(page_size, runs, **figures))


def test_same_page_different_prefix_has_equal_full_pages_that_do_not_hit(engine):
    scenario = SCENARIO_BY_NAME["Same page, different prefix"]
    a, b = (engine.tokenizer(p).input_ids for p in scenario.prompts)
    equal_full_pages = [k for k in range(1, (len(b) - 1) // 16) if a[16 * k : 16 * (k + 1)] == b[16 * k : 16 * (k + 1)]]
    assert equal_full_pages, "the lesson needs a full page with equal tokens after page 0"
    engine.clear()
    first = panels(engine, scenario.prompts[:1], max_tokens=1)
    second = panels(engine, scenario.prompts[1:], max_tokens=1)  # the chained key refuses them
    assert promise_of(4, first + second) == []


def test_shared_system_prompt_hits_in_the_first_run(engine):
    scenario = SCENARIO_BY_NAME["Shared system prompt"]
    engine.clear()
    assert promise_of(1, panels(engine, [scenario.prefix + p for p in scenario.prompts], max_tokens=2)) == []


def test_eviction_pressure_evicts_and_preempts():
    scenario = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
    s = scenario.profile.settings
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL, page_size=s.page_size, n_pages=s.n_pages, max_batch_size=s.max_batch_size, compile=False
    ) as engine:
        for _ in range(2):
            engine.generate(scenario.prompts, max_tokens=scenario.max_tokens)
        stats = engine.cache_stats()
    assert promise_of(3, evictions=stats.evictions) == []
    assert stats.preemptions > 0 and stats.used_pages == 0


def test_distinct_prompts_hit_nothing(engine):
    engine.clear()
    assert promise_of(2, panels(engine, SCENARIO_BY_NAME["Distinct prompts (no hits)"].prompts, max_tokens=2)) == []


def test_a_follow_up_turn_hits_past_the_first_prompt(engine):
    scenario = SCENARIO_BY_NAME["Follow-up turn"]
    engine.clear()
    first, answers = run(engine, scenario.prompts, max_tokens=scenario.max_tokens)
    second = panels(engine, [p + a + FOLLOW_UP for p, a in zip(scenario.prompts, answers, strict=True)], max_tokens=2)
    assert promise_of(5, first, second) == []


def test_caching_off_computes_every_prompt_token_and_on_computes_fewer(engine):
    scenario = SCENARIO_BY_NAME["Shared system prompt"]
    prompts = [scenario.prefix + p for p in scenario.prompts]
    engine.clear()
    on = panels(engine, prompts, max_tokens=2)
    off = panels(engine, prompts, max_tokens=2, cache_salt=[f"no-sharing-{i}" for i in range(len(prompts))])
    assert [p.cached_tokens for p in off] == [0, 0, 0, 0]
    computed = [sum(p.prompt_tokens - (p.cached_tokens or 0) for p in run) for run in (on, off)]
    assert promise_of(6, computed=(computed[0], computed[1])) == []


def test_every_lesson_step_loads_a_scenario_and_names_a_view():
    assert len(LESSON) == 8 and all(step.scenario in SCENARIO_BY_NAME for step in LESSON)
    ui = (Path(__file__).parents[1] / "astrai" / "playground" / "ui" / "layout.py").read_text()
    assert all(f'elem_id="{step.look_at}"' in ui for step in LESSON)


def test_why_did_it_miss_shows_what_its_lesson_step_says():
    """Lesson step 8's text, cause by cause, on the scenario's own engine settings and a cold namespace: the counts
    (``promises.why_did_it_miss``, what a visitor's table shows), then the order and the hover texts they cannot."""
    from astrai.explain import Cause
    from astrai.playground.scenarios import WHY

    assert LESSON[7].scenario == WHY.name
    s = WHY.profile.settings
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL, page_size=s.page_size, n_pages=s.n_pages, max_batch_size=s.max_batch_size, compile=False
    ) as engine:
        stream = engine.generate(WHY.prompts, max_tokens=WHY.max_tokens, stream=True, cache_salt="a cold namespace")
        list(stream)
        whys = engine.explain(stream.request_ids)
        infos = engine.request_info(stream.request_ids)
    seen = tuple(Panel(i.prompt_tokens, i.cached_tokens, w.counts) for i, w in zip(infos, whys, strict=True))
    assert promise_of(8, seen, page_size=s.page_size) == []
    size = s.page_size
    first, second, third, fourth = ([(seg.cause, seg.start, seg.end) for seg in w.segments] for w in whys)
    assert second[0] == (Cause.DIVERGED, 0, size) and whys[1].segments[0].divergence.at == 1, second  # after ⟨s⟩
    assert third[0][:2] == (Cause.CACHED, 0) and third[1][0] is Cause.EVICTED, third
    assert whys[2].segments[1].page.evicted_for == stream.request_ids[1], "evicted for panel 2's answer"
    assert fourth[:2] == [(Cause.CACHED, 0, size), (Cause.DIVERGED, size, 2 * size)], fourth
    for why in whys:  # the last token is computed, at the end
        assert why.segments[-1].cause is Cause.LAST_TOKEN and why.segments[-1].end == why.prompt_tokens
