"""Per-visitor state under a classroom: polls never count as activity, and memory stays bounded."""

from __future__ import annotations

import pytest

from astrai.observation import CacheSnapshot
from astrai.playground import state
from astrai.playground.backends.profiles import DEFAULT_PROFILE, SMALL_POOL_PROFILE
from astrai.playground.state import KEEP_RECORDINGS, Visitors
from astrai.playground.views.replay import Recording
from tests.support.playground import playground, request

OPEN_TABS = 200


def recording() -> Recording:
    return Recording(CacheSnapshot(step=0, pages=()), (), (1,))


def test_polls_neither_create_visitors_nor_push_an_active_one_out(monkeypatch):
    monkeypatch.setattr(state, "COUNT_EVERY_S", 0.0)
    visitors = Visitors(DEFAULT_PROFILE)
    visitors.act("active").recording = recording()
    for _ in range(3):
        for tab in range(OPEN_TABS):
            visitors.peek(f"tab-{tab}")
    assert visitors.peek("active").recording is not None
    assert visitors.on(DEFAULT_PROFILE) == OPEN_TABS + 1, "every open tab is counted on the default engine"


def test_recordings_are_bounded_by_activity_order():
    visitors = Visitors(DEFAULT_PROFILE)
    for i in range(KEEP_RECORDINGS + 5):
        visitors.act(f"v{i}").recording = recording()
    visitors.act("v0")  # acting again keeps... nothing it already lost
    kept = [visitors.peek(f"v{i}").recording is not None for i in range(KEEP_RECORDINGS + 5)]
    assert kept[-KEEP_RECORDINGS + 1 :] == [True] * (KEEP_RECORDINGS - 1)
    assert not any(kept[1:5]), "the least recently active lost their replays first"


def test_visitors_count_by_engine(monkeypatch):
    monkeypatch.setattr(state, "COUNT_EVERY_S", 0.0)
    visitors = Visitors(DEFAULT_PROFILE)
    visitors.act("a")
    visitors.act("b").profile = SMALL_POOL_PROFILE
    assert visitors.on(SMALL_POOL_PROFILE) == 1 and visitors.on(DEFAULT_PROFILE) == 1


@pytest.fixture(scope="module")
def pg():
    with playground() as pg:
        yield pg


def test_two_hundred_polling_tabs_leave_an_active_visitors_replay(pg):
    """The 1 Hz refresh used to move each polling tab to the front of the visitor LRU: past 128 open tabs, every
    visitor's state (their replay among it) was evicted each second."""
    runs, live, replays = pg.runs, pg.live, pg.replays
    for _ in runs.run(pg.fields(max_tokens=8), request("active")):
        pass
    runs.after_run(request("active"))
    recorded = replays.page_map_at(3, request("active"))
    assert recorded, "control: the run was recorded"
    for _ in range(2):
        for tab in range(OPEN_TABS):
            live.refresh(None, request(f"tab-{tab}"))
    assert replays.page_map_at(3, request("active")) == recorded


def test_the_live_view_fills_in_the_badges_while_a_run_streams(pg):
    """TTFT shows in a panel's badge as soon as the live view knows it, not only when the run ends (``after_run``).
    The run is held mid-stream here (its generator not resumed): in a browser, whether a 1 Hz tick falls inside a
    run decided the outcome, and the engine got fast enough for a whole run to end between two ticks (CI)."""
    ctx, runs, live = pg.ctx, pg.runs, pg.live
    stream = runs.run(pg.fields(max_tokens=64), request("teacher"))
    first_badge = ctx.ui.panels.badges[0]
    shown = ""
    for _ in stream:  # each update of the streaming text; the run is still on at each
        shown = live.refresh(None, request("teacher")).get(first_badge, "")
        if "TTFT" in shown:
            break
    assert "TTFT" in shown and "streaming" in shown, shown
    for _ in stream:
        pass
    runs.after_run(request("teacher"))
