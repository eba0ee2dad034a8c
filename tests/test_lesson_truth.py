"""Every number a visitor sees is true, and every lesson step stays alive: the defects a close reading of the lesson
found (issue 35), each driven through the playground's own callbacks, in process, as Gradio would call them."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from astrai.observation import PageEvicted
from astrai.playground import promises
from astrai.playground.promises import Panel, Seen
from astrai.playground.scenarios import LESSON, POLICY, SCENARIO_BY_NAME, SECOND_TIER
from astrai.playground.views import charts, replay, sizing
from astrai.playground.views.text import TABLE_COLUMNS
from astrai.sampling import SamplingParams
from tests.support.playground import Playground, no_progress, playground, request
from tools.loadtest import read_computed, read_panels, read_replayed

EVICTION = SCENARIO_BY_NAME["Eviction pressure (small pool)"]


@pytest.fixture(scope="module")
def pg():
    with playground() as pg:
        yield pg


def scenario_fields(pg: Playground, name: str, **changes: object) -> dict[str, object]:
    scenario = SCENARIO_BY_NAME[name]
    prompts = {f"prompt_{i + 1}": p for i, p in enumerate(scenario.prompts)}
    base = dict(
        n_panels=len(scenario.prompts),
        shared_prefix=scenario.prefix,
        max_tokens=scenario.max_tokens,
        cache_namespace=scenario.namespace,
    )
    return pg.fields(**(base | prompts | changes))


def run_to_the_end(pg: Playground, session: str, fields: dict[str, object], live: bool = False) -> list[dict]:
    """One run, the live view polled at each streamed update when ``live``; returns the live view's updates."""
    updates, cursor = [], None
    for _ in pg.runs.run(fields, request(session)):
        if live:
            update = pg.live.refresh(cursor, request(session))
            cursor = update[pg.ctx.ui.cache.cursor]
            updates.append(update)
    pg.runs.after_run(request(session))
    for _ in range(4):  # the ticks after the run: the charts below the fold are drawn in turns, then all at once
        update = pg.live.refresh(cursor, request(session))
        cursor = update[pg.ctx.ui.cache.cursor]
        updates.append(update)
    return updates


def test_the_live_view_keeps_drawing_across_evictions(pg):
    """Defect 1: evicted pages were kept as page numbers where the tree wanted events; every tick after the first
    eviction raised, the tree read "0 pages" and the hit-rate chart stayed empty (lesson step 3)."""
    session = "evicting"
    pg.setup.load_scenario(EVICTION.name, request(session), no_progress)
    backend = pg.ctx.engines.backend(pg.ctx.visitors.peek(session).profile)  # the visitor's own small pool
    assert backend is not None
    updates = []
    for _ in range(2):
        updates += run_to_the_end(pg, session, scenario_fields(pg, EVICTION.name), live=True)
    assert backend.stats().evictions, "the scenario must evict to test anything"
    assert any(isinstance(e, PageEvicted) for e in backend.events(after=0))
    cache = pg.ctx.ui.cache
    trees = [u[cache.prefix_tree].layout.title.text for u in updates if cache.prefix_tree in u]
    assert trees and any("just evicted" in t for t in trees), trees
    rates = [u[cache.hit_rate] for u in updates if cache.hit_rate in u]
    assert rates and any(any(y is not None for y in trace.y) for trace in rates[-1].data)


def test_clear_cache_leaves_a_pool_another_visitors_run_uses():
    """Defect 2: "only you on it now" counted visitors by their current scenario. A started 6 requests on the small
    pool and moved on; B, alone by that count, cleared the pool under A's run."""
    with playground() as pg:
        clear_under_a_run(pg)


def clear_under_a_run(pg: Playground) -> None:
    a, b = "runner-a", "clearer-b"
    for session in (a, b):  # the small pool every visitor who chooses to share is on (else each has their own)
        pg.setup.share_pools(True, request(session), no_progress)
    pg.setup.load_scenario(EVICTION.name, request(a), no_progress)
    pg.setup.load_scenario(EVICTION.name, request(b), no_progress)
    backend = pg.ctx.engines.backend(EVICTION.profile)
    assert backend is not None
    stream = pg.runs.run(scenario_fields(pg, EVICTION.name, max_tokens=160), request(a))
    for _ in range(3):
        next(stream)  # A's run streams, held here
    pg.setup.load_scenario("Distinct prompts (no hits)", request(a), no_progress)  # A moves to another scenario
    assert pg.ctx.visitors.others_on(EVICTION.profile, b) == 1, "A's run still streams on the small pool"
    line = pg.live.refresh(None, request(b))[pg.ctx.ui.cache.stats]
    assert "shared with 1 other visitor" in line, line
    before = backend.stats()
    pg.runs.clear_cache(request(b))
    after = backend.stats()
    assert after.cached_pages >= before.cached_pages or after.steps > before.steps  # nothing was freed by B
    assert not any(type(e).__name__ == "CacheCleared" for e in backend.events(after=0)), "B's clear was refused"
    for _ in stream:
        pass
    pg.runs.after_run(request(a))


def test_what_caching_saved_counts_recomputation_after_preemption():
    """Defect 4: "48 of 48 prefill tokens computed" where the engine ran 308, after 3 preemptions."""
    with playground() as pg:
        saved_after_preemptions(pg)


def saved_after_preemptions(pg: Playground) -> None:
    session = "preempted"
    pg.setup.load_scenario(EVICTION.name, request(session), no_progress)
    run_to_the_end(pg, session, scenario_fields(pg, EVICTION.name))
    visitor = pg.ctx.visitors.peek(session)
    summary, recording = visitor.with_cache, visitor.recording
    assert summary is not None and recording is not None and recording.closed
    mine = set(recording.request_ids)
    own_steps = [s for s in recording.samples if set(s.requests) <= mine and s.requests]
    assert own_steps == [s for s in recording.samples if s.requests], "nobody else ran on this pool meanwhile"
    prefill = sum(s.prefill_tokens or 0 for s in recording.samples)
    assert summary.computed_tokens == prefill, (summary, prefill)
    if summary.recomputed_tokens:
        assert summary.computed_tokens > summary.prompt_tokens - sum(a[2] for s in own_steps for a in s.admitted)


def test_a_recording_holds_its_run_only_and_stops_with_it(pg):
    """Defects 5 and 6: every after_run and every Stop appended all the engine's steps since the last sample (8 →
    108 → 208 → 308 steps, "other sessions"), without end; the slider counted them while the narration named the
    engine's step."""
    me, other = "recorded", "busy-neighbour"
    fields = pg.fields(max_tokens=8)
    run_to_the_end(pg, me, fields)
    recording = pg.ctx.visitors.peek(me).recording
    assert recording is not None and recording.closed
    kept = len(recording.samples)
    for _ in range(3):
        run_to_the_end(pg, other, fields)
        pg.runs.after_run(request(me))  # a later Stop or after_run of mine
    again = pg.ctx.visitors.peek(me).recording
    assert again is not None and len(again.samples) == kept, "other visitors' later steps joined my recording"
    frames = again.frames
    assert all(set(again.request_ids) & set(again.samples[i - 1].requests) for i in frames[:-1])
    update = pg.runs.after_run(request(me))
    assert update[pg.ctx.ui.replay.step].maximum == len(frames)
    assert replay.narrate(again, len(frames)).startswith(f"step {len(frames)} of {len(frames)} of your run")


def test_a_recording_never_takes_in_the_steps_of_the_engine_that_replaced_its_own():
    """Defect 5: after an idle engine was retired and rebuilt, a recording went on with the new engine's steps
    (the local backend's generation was a constant 1)."""
    with playground(idle_retire_s=3600) as pg:
        session = "retired"
        pg.setup.load_scenario(EVICTION.name, request(session), no_progress)
        run_to_the_end(pg, session, scenario_fields(pg, EVICTION.name, max_tokens=4))
        visitor = pg.ctx.visitors.peek(session)
        own = visitor.profile  # the visitor's own small pool: a tenant, retired (closed) and made again the same way
        old = pg.ctx.engines.backend(own)
        assert own.owner is not None and old is not None and visitor.recording is not None
        visitor.recording = dataclasses.replace(visitor.recording, closed=False)  # as if its end were still to come
        pg.ctx.engines._idle_retire_s = 0.0  # the small pool is retired at the next look
        assert pg.ctx.engines.backend(own) is None
        pg.ctx.engines._idle_retire_s = 3600.0
        new = pg.ctx.engines.ensure(own)
        assert new.generation != old.generation
        list(new.submit(["Once upon a time"], SamplingParams(max_tokens=4), None))
        kept = len(visitor.recording.samples)
        pg.runs.after_run(request(session))
        assert len(pg.ctx.visitors.peek(session).recording.samples) == kept


def test_with_prefix_caching_off_the_badges_and_table_say_off(pg):
    """Defect 7: badges and the request table said "0 cached (0%)" where the engine looks nothing up."""
    session = "no-caching"
    status = pg.setup.apply_settings(
        {"model": pg.ctx.engines.default.model, "page_size": 16, "n_pages": 64, "max_batch_size": 8,
         "prefix_caching": False, "dtype": "float32"},
        request(session),
        no_progress,
    )  # fmt: skip
    assert "caching off" in status[pg.ctx.ui.setup.engine.status]
    for _ in pg.runs.run(pg.fields(max_tokens=4), request(session)):
        pass
    update = pg.runs.after_run(request(session))
    badge = update[pg.ctx.ui.panels.badges[0]]
    assert "prefix caching off" in badge and "cached" not in badge.replace("caching", ""), badge
    assert update[pg.ctx.ui.cache.table][0][4] == "off"


def test_compare_runs_its_second_half_on_an_engine_without_caching(pg):
    """Defect 8: the caching-off half salted its pages into the shared engine's LRU (evicting other visitors'
    pages) and its zero-hit lookups lowered everyone's "Reuse so far"; its chart showed total time without why,
    and its note advised loading a larger model where none can be loaded."""
    session = "comparing"
    default = pg.ctx.engines.backend(pg.ctx.engines.default)
    assert default is not None
    fields = scenario_fields(pg, "Shared system prompt", max_tokens=4)
    for _ in pg.runs.run(fields, request("warm-up")):
        pass
    before = default.stats()
    for _ in pg.runs.compare(fields, request(session)):
        pass
    after = default.stats()
    visitor = pg.ctx.visitors.peek(session)
    assert visitor.with_cache and visitor.without_cache
    looked_up = after.query_tokens - before.query_tokens
    assert looked_up == visitor.with_cache.prompt_tokens, "only the caching-on half was looked up on this engine"
    saved = pg.runs.after_run(request(session))
    note = saved[pg.ctx.ui.cache.savings_note]
    assert promises.check(LESSON[5], Seen(16, computed=read_computed(note))) == []
    assert "Load a larger model" not in note and "mostly decoding" in note


def test_the_savings_chart_says_its_own_numbers_and_shows_no_time(pg):
    """Issue 43: caching on had the higher median TTFT in 6 of 7 presses (up to 8×) while the note said the times
    "differ little". The chart now holds the exact prefill tokens alone, and its caption says the bars' numbers."""
    session = "caption"
    for _ in pg.runs.compare(scenario_fields(pg, "Shared system prompt", max_tokens=4), request(session)):
        pass
    update = pg.runs.after_run(request(session))
    figure = update[pg.ctx.ui.cache.savings]
    bars = {trace.name: trace.y[0] for trace in figure.data}
    assert set(bars) == {"caching on", "caching off"} and bars["caching on"] < bars["caching off"], bars
    caption = figure.layout.title.text
    said = re.fullmatch(r"Prefill tokens computed: ([\d,]+) with caching, ([\d,]+) without \(([\d,]+) fewer.*", caption)
    assert said, caption
    on, off, fewer = (int(n.replace(",", "")) for n in said.groups())
    assert (on, off, fewer) == (bars["caching on"], bars["caching off"], bars["caching off"] - bars["caching on"])
    assert read_computed(update[pg.ctx.ui.cache.savings_note]) == (on, off), "the note says the chart's numbers"
    assert not any("time" in (trace.name or "") or "TTFT" in (trace.name or "") for trace in figure.data)


def test_after_compare_the_badges_and_table_show_both_halves_labelled(pg):
    """Issue 43: after Compare, every badge and the table showed the caching-off half only."""
    session = "both-halves"
    fields = scenario_fields(pg, "Shared system prompt", max_tokens=4)
    for _ in pg.runs.compare(fields, request(session)):
        pass
    update = pg.runs.after_run(request(session))
    n = len(SCENARIO_BY_NAME["Shared system prompt"].prompts)
    for badge in pg.ctx.ui.panels.badges[:n]:
        on, off = update[badge].split("  \n")
        assert on.startswith("**Caching on:**") and "cached (" in on, update[badge]
        assert off.startswith("**Caching off:**") and "prefix caching off" in off, update[badge]
    rows = update[pg.ctx.ui.cache.table]
    assert [row[0] for row in rows] == [f"{i} (caching on)" for i in range(1, n + 1)] + [
        f"{i} (caching off)" for i in range(1, n + 1)
    ]
    assert all(row[4] != "off" for row in rows[:n]) and all(row[4] == "off" for row in rows[n:])
    assert all(update[box].startswith("<small>caching on:</small>") for box in pg.ctx.ui.panels.highlights[:n])
    for _ in pg.runs.run(fields, request(session)):  # a plain Run again: one half, unlabelled
        pass
    again = pg.runs.after_run(request(session))
    assert "Caching" not in again[pg.ctx.ui.panels.badges[0]] and again[pg.ctx.ui.cache.table][0][0] == 1


def seen_run(pg: Playground, update: dict, n: int) -> tuple[Panel, ...]:
    """A run's panels as the visitor reads them after it (badges, the request table's causes), read the way the
    lockstep load tool reads them (``tools.loadtest.read_panels``)."""
    badges = [update[badge] for badge in pg.ctx.ui.panels.badges]
    return read_panels([*badges, {"headers": TABLE_COLUMNS, "data": update[pg.ctx.ui.cache.table]}], n)


def lesson_step(pg: Playground, session: str, index: int) -> tuple[dict[str, object], object]:
    """Go to lesson step ``index`` as Lesson ▶ does; return its run form and the pool the visitor is on."""
    pg.setup.lesson(index, 0, request(session), no_progress)
    scenario = SCENARIO_BY_NAME[LESSON[index].scenario]
    backend = pg.ctx.engines.backend(pg.ctx.visitors.peek(session).profile)
    return scenario_fields(pg, scenario.name), backend


def test_step_3_on_a_visitors_own_pool_shows_eviction_costing_hits(pg):
    """Issue 43: every prompt of step 3 was shorter than a page: no run could hit, and eviction cost nothing (0 of 96
    prompt tokens cached on both runs, 101 evictions). On the visitor's own 40-page pool (a tenant of the default
    engine, batch 8) the second run now hits the opening and misses pages that were evicted, as the badges say."""
    session, index = "evicted", next(i for i, s in enumerate(LESSON) if s.scenario == EVICTION.name)
    fields, backend = lesson_step(pg, session, index)
    assert backend is not None and backend.stats().n_pages == 40 and pg.ctx.visitors.peek(session).profile.owner
    before = backend.stats().evictions
    runs = []
    for _ in range(2):
        run_to_the_end(pg, session, fields)
        runs.append(seen_run(pg, pg.runs.after_run(request(session)), len(EVICTION.prompts)))
    seen = Seen(16, tuple(runs), backend.stats().evictions - before)
    assert promises.check(LESSON[index], seen) == []
    badges = [pg.runs.after_run(request(session))[b] for b in pg.ctx.ui.panels.badges[: len(EVICTION.prompts)]]
    assert any(re.search(r"\*\*\d+\*\* cached .* · \d+ evicted at step \d+", b) for b in badges), badges


def test_the_second_tier_step_loads_each_story_back_as_its_text_says(pg):
    """Issue 45: on the visitor's own pool (a tenant of the default engine) with a second tier of its own in memory,
    the second run's badges say every story's full pages were loaded from the tier, and the stats line's 'Second
    tier' counts those loads (from its stats)."""
    session, index = "tiered", next(i for i, s in enumerate(LESSON) if s.scenario == SECOND_TIER.name)
    fields, backend = lesson_step(pg, session, index)
    assert backend is not None and backend.stats().second_tier is not None
    assert pg.ctx.visitors.peek(session).profile.owner, "each student's own pool, with a tier of its own"
    runs = []
    for _ in range(2):
        run_to_the_end(pg, session, fields)
        runs.append(seen_run(pg, pg.runs.after_run(request(session)), len(SECOND_TIER.prompts)))
    assert promises.check(LESSON[index], Seen(16, tuple(runs))) == []
    tier = backend.stats().second_tier
    line = pg.live.refresh(None, request(session))[pg.ctx.ui.cache.stats]
    assert f"**{tier.hit_tokens}** of the reused prompt tokens loaded from it" in line and tier.loaded_pages, line


def test_step_8_shows_lru_and_arc_side_by_side_on_the_visitors_own_requests(pg):
    """Issue 43: step 7's ARC half showed nothing (98 against 101 evictions on short prompts, no LRU beside it). The
    policy step's run shows the LRU pool evicting the system prompt, and Replay my requests, on the same requests at
    the pool's size, LRU serving it once and ARC twice, side by side in its table."""
    session, index = "policies", next(i for i, s in enumerate(LESSON) if s.scenario == POLICY.name)
    fields, backend = lesson_step(pg, session, index)
    assert backend is not None and pg.ctx.visitors.peek(session).profile.owner
    run_to_the_end(pg, session, fields)
    run = seen_run(pg, pg.runs.after_run(request(session)), len(POLICY.prompts))
    shown = pg.sizing.replay_mine(request(session), no_progress)
    sizing_views = pg.ctx.ui.sizing
    table = {"headers": sizing.TABLE_COLUMNS, "data": shown[sizing_views.table]}
    replayed = read_replayed([table, shown[sizing_views.capacity].value])
    assert promises.check(LESSON[index], Seen(16, (run,), replayed=replayed)) == []
    assert "LRU serves" in shown[sizing_views.note] and "ARC (the best online policy here)" in shown[sizing_views.note]


def test_replay_my_requests_is_offered_only_once_the_requests_fill_pages_and_never_raises(pg):
    """Issue 43: on step 7's engine, Replay my requests gave a red Error toast and a traceback in the log for requests
    under one page. It is disabled, saying why, until they fill ``sizing.MIN_BLOCKS`` pages; a press that races
    that says the same in the note."""
    session, button = "short-requests", pg.ctx.ui.sizing.replay_mine
    update = pg.setup.load_scenario(EVICTION.name, request(session), no_progress)
    assert not update[button].interactive and "fill 0 full pages" in update[button].value
    run_to_the_end(pg, session, pg.fields(n_panels=1, prompt_1="Tom had a red ball", shared_prefix="", max_tokens=4))
    after = pg.runs.after_run(request(session))
    assert not after[button].interactive and "fill 0 full pages" in after[button].value
    pressed = pg.sizing.replay_mine(request(session), no_progress)  # raised gr.Error before
    assert "a replay needs 2" in pressed[pg.ctx.ui.sizing.note] and not pressed[button].interactive
    run_to_the_end(pg, session, scenario_fields(pg, EVICTION.name, max_tokens=4))
    assert pg.runs.after_run(request(session))[button].interactive


def test_reading_a_hub_models_config_never_holds_the_lock_every_poll_takes(pg, monkeypatch):
    """Defect 9: a config fetch ran under the lock every visitor's 1 Hz poll takes: a 3 s fetch stalled them all."""
    import transformers

    from astrai.playground.backends.profiles import EngineSettings, Profile
    from astrai.playground.backends.protocol import BackendError

    engines = pg.ctx.engines
    fetching = threading.Event()

    def slow_config(*args, **kwargs):
        fetching.set()
        time.sleep(1.5)
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", slow_config)
    monkeypatch.setitem(engines._choices, "a hub model", "nowhere/model")
    profile = Profile("a hub model", EngineSettings(n_pages=64), name="hub", custom=True)
    claim = threading.Thread(target=lambda: pytest.raises(BackendError, engines.ensure, profile))
    claim.start()
    assert fetching.wait(10)
    started = time.monotonic()
    engines.backend(engines.default)  # what every poll does
    assert time.monotonic() - started < 0.5
    claim.join()


def test_lesson_step_two_has_prompts_of_full_pages_and_no_run_of_it_hits(pg):
    """Smaller things: step 2's prompts were shorter than a page, so "no hits" was trivially true. They now fill two
    pages, and since anyone on the engine may have run them before, each run has a namespace of its own."""
    name = LESSON[1].scenario
    backend = pg.ctx.engines.backend(pg.ctx.engines.default)
    assert backend is not None
    for session in ("first", "second"):  # the second visitor runs the very same prompts
        run_to_the_end(pg, session, scenario_fields(pg, name, max_tokens=2))
        infos = backend.request_info(list(pg.ctx.visitors.peek(session).shown.request_ids))
        run = tuple(Panel(i.prompt_tokens, i.cached_tokens) for i in infos)
        assert len(run) == 4 and promises.check(LESSON[1], Seen(16, (run,))) == []


def test_after_a_run_the_slow_replay_is_offered(pg):
    """Smaller things: a run ends in about a second, so nothing is watched live; Replay ▶ slow is offered at once."""
    session = "slowly"
    for _ in pg.runs.run(pg.fields(max_tokens=16), request(session)):
        pass
    update = pg.runs.after_run(request(session))
    assert update[pg.ctx.ui.replay.play_slow].variant == "primary"
    assert "Replay ▶ slow" in update[pg.ctx.ui.replay.note]


def test_the_slow_replay_holds_each_step_for_half_a_second(pg):
    """Issue 43: ▶ ¼× played a quarter of the run's recorded time, and a run lasts about a second: 27 steps a second,
    too fast to point at anything. ▶ slow plays ``SLOW_STEPS_PER_S`` steps a second, whatever their recorded times."""
    session = "pointing"
    run_to_the_end(pg, session, pg.fields(max_tokens=16))
    pg.runs.after_run(request(session))
    visitor = pg.ctx.visitors.peek(session)
    assert visitor.recording is not None and len(visitor.recording.frames) > 6
    pg.replays.play(0, True, request(session))
    assert visitor.playback is not None
    started = visitor.playback.wall_start - 2.0  # as if it had played for two seconds
    visitor.playback = dataclasses.replace(visitor.playback, wall_start=started)
    before = time.monotonic()
    frame = pg.replays.tick(request(session))[pg.ctx.ui.replay.step]
    after = time.monotonic()
    pace = replay.SLOW_STEPS_PER_S
    assert int((before - started) * pace) <= frame <= int((after - started) * pace), frame


def test_the_lru_chart_keeps_evictions_off_the_pages_axis():
    """Smaller things: cumulative evictions (101) were drawn on the "pages" axis of a 40-page pool."""
    from astrai.playground.views.series import Series

    data = Series("s", [0.0, 1.0], [1, 1], [30, 40], [9, 0], [0, 101], [None, 0.5], [], [])
    figure = charts.lru_chart(data)
    pages, evictions = figure.data
    assert (pages.yaxis or "y") == "y" and evictions.yaxis == "y2"


def test_the_scenarios_say_what_the_app_does():
    """Smaller things: the Follow-up text said "a new line" while the app appends " Then"."""
    from astrai.playground.scenarios import FOLLOW_UP

    assert repr(FOLLOW_UP)[1:-1] in SCENARIO_BY_NAME["Follow-up turn"].explanation
    assert "new line" not in SCENARIO_BY_NAME["Follow-up turn"].explanation


def test_building_an_engine_reads_as_a_sentence():
    from astrai.playground.backends.profiles import EngineSettings, Profile

    custom = Profile(settings=EngineSettings(n_pages=64), name="your own settings", custom=True)
    assert f"Building {custom.engine}" == "Building the “your own settings” engine"
