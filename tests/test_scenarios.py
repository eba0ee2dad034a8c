"""The scenarios teach what they say: checked against the embedded model's tokenizer and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai import InferenceEngine
from astrai.lab.record import from_requests
from astrai.lab.replay import Replay
from astrai.playground import promises
from astrai.playground.backends.profiles import EMBEDDED_MODEL, TIER_WRITE, Profile
from astrai.playground.promises import Panel, Replayed, Seen
from astrai.playground.scenarios import (
    EVICTION_OPENING_PAGES,
    FARM,
    FOLLOW_UP,
    LESSON,
    LOAD_FASTER_THAN_COMPUTE,
    POLICY,
    SCENARIO_BY_NAME,
    SECOND_TIER,
    SECOND_TIER_PAGES,
    SYSTEM_PROMPT_PAGES,
)


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


def small_engine(profile: Profile, eviction: str = "lru") -> InferenceEngine:
    """An engine of a lesson step's pool settings, under ``eviction``."""
    s = profile.settings
    return InferenceEngine.from_pretrained(
        EMBEDDED_MODEL,
        page_size=s.page_size,
        n_pages=s.n_pages,
        max_batch_size=s.max_batch_size,
        eviction=eviction,
        compile=False,
    )


def test_the_eviction_prompts_share_an_opening_of_whole_pages_then_fill_pages_of_their_own(engine):
    """Step 3's second run can hit only the opening, and can miss only pages of a panel's own: the opening is
    exactly ``EVICTION_OPENING_PAGES`` full pages (with the start token), then every prompt differs and fills two
    full pages of its own."""
    scenario = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
    size = scenario.profile.settings.page_size
    opening = EVICTION_OPENING_PAGES * size
    ids = [engine.tokenizer(scenario.prefix + p).input_ids for p in scenario.prompts]
    assert all(i[:opening] == ids[0][:opening] for i in ids)
    assert len({tuple(i[opening : opening + 1]) for i in ids}) == len(ids), "each differs from the opening's end on"
    assert all(len(i) > opening + 2 * size for i in ids), [len(i) for i in ids]


def test_each_second_tier_story_fills_its_pages_and_a_token_more_and_a_pool_holds_one_request(engine):
    """The step's figures: every story has ``SECOND_TIER_PAGES`` full pages before its last token (all of them can
    be served), and a story with its answer takes more than half the pool, so each request evicts the one before."""
    settings = SECOND_TIER.profile.settings
    size = settings.page_size
    lengths = [len(engine.tokenizer(p).input_ids) for p in SECOND_TIER.prompts]
    assert all(SECOND_TIER_PAGES * size < n <= (SECOND_TIER_PAGES + 1) * size for n in lengths), lengths
    assert settings.n_pages < 2 * (SECOND_TIER_PAGES + 1) and settings.max_batch_size == 1


def test_on_the_embedded_model_a_page_loads_from_the_tier_faster_than_it_is_computed():
    """The second-tier step's comparison, measured on this machine: a story's pages computed (its prefill step's
    time, per page: the first run's cost) against the same pages loaded back from a tier in memory (the tier's own
    load time, per page). The step says loading is more than ``LOAD_FASTER_THAN_COMPUTE`` times faster."""
    settings = SECOND_TIER.profile.settings
    size = settings.page_size
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL,
        page_size=size,
        n_pages=settings.n_pages,
        max_batch_size=1,
        offload_pages=settings.offload_pages,
        offload_policy=TIER_WRITE,
        compile=False,
    ) as engine:
        engine.generate(SECOND_TIER.prompts[0], max_tokens=1)
        (prefill,) = [s for s in engine.history() if s.prefill_tokens]
        computed = prefill.duration_s / (prefill.prefill_tokens / size)
        engine.generate(SECOND_TIER.prompts[1:3], max_tokens=1)  # one at a time: the first story goes to the tier
        engine.generate(SECOND_TIER.prompts[0], max_tokens=1)
        tier = engine.cache_stats().second_tier
        assert tier is not None and tier.loaded_pages == SECOND_TIER_PAGES, tier
        loaded = tier.load_seconds / tier.loaded_pages
    assert computed > LOAD_FASTER_THAN_COMPUTE * loaded, (computed, loaded)


def test_eviction_costs_hits_in_the_second_run():
    """Step 3 on its pool's settings: the first run evicts and preempts; in the second every panel hits the opening
    and some panel misses pages of its own that were evicted (the table's "evicted" column)."""
    scenario = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
    prompts = [scenario.prefix + p for p in scenario.prompts]
    with small_engine(scenario.profile) as engine:
        runs = [panels(engine, prompts, max_tokens=scenario.max_tokens, cache_salt="mine") for _ in range(2)]
        stats = engine.cache_stats()
    assert promise_of(3, *runs, evictions=stats.evictions) == []
    assert stats.preemptions > 0 and stats.used_pages == 0


def test_lru_evicts_the_system_prompt_that_arc_keeps_on_the_engine_and_in_the_lab(engine):
    """Step 8's workload on its pool's settings: under LRU panel 6 finds the system prompt evicted, under ARC it
    hits it; Replay my requests (the lab, on the LRU engine's requests) serves it once under LRU and twice under ARC
    at the pool's size, and so the step's promise, as a visitor reads it, is kept."""
    size, pool = POLICY.profile.settings.page_size, POLICY.profile.settings.n_pages
    system = SYSTEM_PROMPT_PAGES * size
    ids = [engine.tokenizer(p).input_ids for p in POLICY.prompts]
    farm = [i for i, prompt in enumerate(POLICY.prompts) if prompt.startswith(FARM)]
    assert farm == [0, 1, 5] and all(ids[i][:system] == ids[0][:system] for i in farm)
    assert all(len(i) < (SYSTEM_PROMPT_PAGES + 1) * size for i in ids), "no prompt fills a page past the system's"
    assert len({tuple(i[1:size]) for i in ids[2:5]} | {tuple(ids[0][1:size])}) == 4, "the stories share no page"
    by_policy = {}
    for eviction in ("lru", "arc"):
        with small_engine(POLICY.profile, eviction) as pool_engine:
            stream = pool_engine.generate(POLICY.prompts, max_tokens=POLICY.max_tokens, stream=True, cache_salt="a")
            list(stream)
            infos = pool_engine.request_info(stream.request_ids)
            whys = pool_engine.explain(stream.request_ids)
        by_policy[eviction] = tuple(
            Panel(i.prompt_tokens, i.cached_tokens, w.counts) for i, w in zip(infos, whys, strict=True)
        )
        if eviction == "lru":
            trace = from_requests(infos, size)
    assert by_policy["arc"][-1].cached_tokens == system, "on an ARC pool panel 6 hits the system prompt"
    prepared = Replay(trace)
    served = {policy: prepared.run(policy, pool).hit_tokens for policy in ("lru", "arc")}
    assert promise_of(8, by_policy["lru"], replayed=Replayed(pool, served)) == []


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
    assert len(LESSON) == 10 and all(step.scenario in SCENARIO_BY_NAME for step in LESSON)
    ui = (Path(__file__).parents[1] / "astrai" / "playground" / "ui" / "layout.py").read_text()
    assert all(f'elem_id="{step.look_at}"' in ui for step in LESSON)


def test_why_did_it_miss_shows_what_its_lesson_step_says():
    """Lesson step 10's text, cause by cause, on the scenario's own engine settings and a cold namespace: the counts
    (``promises.why_did_it_miss``, what a visitor's table shows), then the order and the hover texts they cannot."""
    from astrai.explain import Cause
    from astrai.playground.scenarios import WHY

    assert LESSON[9].scenario == WHY.name
    s = WHY.profile.settings
    with InferenceEngine.from_pretrained(
        EMBEDDED_MODEL, page_size=s.page_size, n_pages=s.n_pages, max_batch_size=s.max_batch_size, compile=False
    ) as engine:
        stream = engine.generate(WHY.prompts, max_tokens=WHY.max_tokens, stream=True, cache_salt="a cold namespace")
        list(stream)
        whys = engine.explain(stream.request_ids)
        infos = engine.request_info(stream.request_ids)
    seen = tuple(Panel(i.prompt_tokens, i.cached_tokens, w.counts) for i, w in zip(infos, whys, strict=True))
    assert promise_of(10, seen, page_size=s.page_size) == []
    size = s.page_size
    first, second, third, fourth = ([(seg.cause, seg.start, seg.end) for seg in w.segments] for w in whys)
    assert second[0] == (Cause.DIVERGED, 0, size) and whys[1].segments[0].divergence.at == 1, second  # after <s>
    assert third[0][:2] == (Cause.CACHED, 0) and third[1][0] is Cause.EVICTED, third
    assert whys[2].segments[1].page.evicted_for == stream.request_ids[1], "evicted for panel 2's answer"
    assert fourth[:2] == [(Cause.CACHED, 0, size), (Cause.DIVERGED, size, 2 * size)], fourth
    for why in whys:  # the last token is computed, at the end
        assert why.segments[-1].cause is Cause.LAST_TOKEN and why.segments[-1].end == why.prompt_tokens
