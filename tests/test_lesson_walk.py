"""The lesson walked end to end in Chromium, by two visitors at once.

Two browser contexts (two Gradio sessions) click through every step of the lesson (Lesson ▶, until the note says the
last one: the steps are ``Lesson.for_deployment(0).steps``, so a new step is walked too) and then every scenario of
the dropdown, pressing Run at each, and on the way Replay (◀ step, ▶ slow, the slider, step ▶, Live), Compare with
caching off, Clear cache and Follow-up turn. At each stop visitor A arrives first, presses Clear cache and Run; while
A's run streams, B moves on to the same stop and presses Clear cache too (refused: A is on that engine); then B runs.
They take turns at doing all that the stop says (Run twice, Follow-up turn and Run, Compare, Replay my requests) and
checking the replay's last frame against the live view, while the other replays around its last run as the first
one's run streams. So at every stop one visitor runs while the other moves or replays, both on the same engine. About
4 minutes on 2 busy cores (the app's start apart): short answers, except on the small pool, which they must fill. On
the lesson's small-pool stops each visitor is on a pool of their own: there B's Clear cache is done, and each one's
view counts only their own runs.

What is checked:
- at every change the live view makes (a MutationObserver in each page, ``tests.support.page_reading.WATCH_JS``): no
  console error, no uncaught exception, no error toast, and no number contradicting another of its view (the stats
  line's parts sum to its pool, hits never exceed lookups, nor a badge's cached tokens its prompt tokens, the tree's
  pages are its in use plus its cached); and the app's log has no traceback after each stop;
- after each run: every panel's badge, its row in the request table and its coloured prompt tokens tell the same
  counts (cached + computed = prompt tokens, cached = the badge's cached, up to the 300 tokens shown);
- once its engine is quiet: the occupancy chart, the LRU chart, the hit-rate chart, the page map's cells and the
  prefix tree all end at the stats line's figures, and on the default engine those are the engine's own counters
  (``/cache_stats``); the two visitors on one engine read the same stats; the prompt tokens looked up and hit on
  the engine during the stop are exactly the sums of the badges of the runs made there (and of what Compare says);
- the replay's last frame is the live page map, cell for cell, with the run's text; back to Live the panels show the
  run's text again;
- Clear cache: refused (a warning) while the other visitor is on the engine; where accepted, it freed as many pages
  as were cached and the views say 0 cached; Compare's chart and note agree with each other and with the badges,
  and each badge and the table tell both halves, labelled; Replay my requests answers at the pool's size.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from astrai.explain import Cause
from astrai.playground.backends.profiles import DEFAULT_PROFILE, Profile
from astrai.playground.scenarios import FOLLOW_UP, SCENARIO_BY_NAME, Lesson, Scenario
from astrai.playground.views.causes import TABLE_CAUSES
from astrai.playground.views.text import HALVES, MAX_HIGHLIGHT_TOKENS, TABLE_COLUMNS
from tests.support.needs import NO_CHROMIUM
from tests.support.page_reading import Badge, MapCells, StatsLine, View, Watch, poll, read
from tests.support.playground import Playground, playground, request
from tools.browser import CHROMIUM, open_visitors
from tools.loadtest import launch_app

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
LESSON = Lesson.for_deployment(routers=0)
SHORT_MAX_TOKENS = 16  # where a scenario's point does not need long answers
# On the small pool: 6 prompts with answers of 96 tokens need 11 pages each, more than its 40 pages hold, so a run
# evicts and preempts (at the scenario's 160, the two small-pool stops took half the walk)
SMALL_POOL_MAX_TOKENS = 96
RUN_TIMEOUT_MS = 120_000  # a run of six long panels on the small pool, on two busy cores
VIEW_TIMEOUT_MS = 30_000
SETTLE_S = 20.0  # the live view lags its engine by up to ~3 s; the charts below the fold are drawn in turns
LOG_PROBLEM = re.compile(r"Traceback|ERROR|Exception")


@dataclass(frozen=True)
class Stop:
    """Where both visitors go next: a lesson step (Lesson ▶) or a scenario (the dropdown), and what it says to do."""

    scenario: Scenario
    lesson_step: int | None  # an index into the lesson's steps; None: picked in the dropdown
    runs: int  # presses of Run before anything else
    follow_up: bool  # then Follow-up turn, and Run again
    compare: bool  # then Compare with caching off
    replay_mine: bool = False  # then Replay my requests (the lab, on the visitor's requests)

    @property
    def title(self) -> str:
        if self.lesson_step is None:
            return f"scenario {self.scenario.name!r}"
        return f"lesson step {self.lesson_step + 1}/{LESSON.length}"

    @property
    def note(self) -> str:
        """How the note beside the page map starts once a visitor is there."""
        if self.lesson_step is None:
            return f"{self.scenario.name}:"
        return f"Lesson {self.lesson_step + 1}/{LESSON.length}:"

    @property
    def max_tokens(self) -> int:
        """Short answers: all a scenario needs on the default engine; enough to fill the small pool on it."""
        limit = SHORT_MAX_TOKENS if self.scenario.profile == DEFAULT_PROFILE else SMALL_POOL_MAX_TOKENS
        return min(self.scenario.max_tokens, limit)


def _stop(scenario: Scenario, lesson_step: int | None, says: str) -> Stop:
    runs = 2 if "Run twice" in says else 1
    return Stop(scenario, lesson_step, runs, "Follow-up" in says, "Compare with" in says, "Replay my requests" in says)


STOPS = [_stop(SCENARIO_BY_NAME[s.scenario], i, s.text) for i, s in enumerate(LESSON.steps)]
STOPS += [_stop(s, None, s.explanation) for s in LESSON.scenarios]


@dataclass(frozen=True)
class RunResult:
    badges: list[Any]  # page_reading.Badge, one per panel
    texts: list[str]  # each panel's text as streamed

    @property
    def looked_up(self) -> tuple[int, int]:
        """Prompt tokens this run looked up in its engine's cache, and those it hit (0, 0 with caching off)."""
        if any(b.cached is None for b in self.badges):
            return 0, 0
        return sum(b.prompt for b in self.badges), sum(b.cached for b in self.badges)


@dataclass
class Visitor:
    name: str
    page: Any
    watch: Watch
    log: Path  # the app's
    profile: Profile = DEFAULT_PROFILE
    last: RunResult | None = None  # the run the replay shows
    toasts_seen: list[dict[str, str]] = field(default_factory=list)


@pytest.fixture(scope="module")
def walk_app() -> Iterator[tuple[str, Path]]:
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / "lesson_walk.log"
    with launch_app(log_path=log) as url:
        yield url, log


@pytest.mark.browser
@pytest.mark.timeout(720)  # about 4 minutes on 2 busy cores, plus the app's start (a first one compiles the model)
def test_browser_two_visitors_walk_every_lesson_step_and_scenario(walk_app):
    from gradio_client import Client

    url, log = walk_app
    watches: list[Watch] = []

    def prepare(page: Any) -> None:
        watch = Watch(f"visitor {'AB'[len(watches)]}")
        watch.attach(page)
        watches.append(watch)

    with open_visitors(url, 2, viewport=(1366, 768), prepare=prepare) as pages:
        a, b = (Visitor(w.name, page, w, log) for w, page in zip(watches, pages, strict=True))
        default_engine = Client(url, verbose=False)  # a session of its own, on the default engine
        for visitor in (a, b):
            _open_accordions(visitor)
        seen: dict[str, StatsLine] = {}
        for number, stop in enumerate(STOPS):
            started = time.monotonic()
            engine_stats = _walk(stop, a, b, default_engine, a_does_all=number % 2 == 0)
            print(f"{stop.title}: {time.monotonic() - started:.1f} s")
            seen[stop.scenario.profile.key] = engine_stats
            _assert_nothing_went_wrong(stop, (a, b))
        # a shared pool's figures, as the visitors last saw them, are its engine's own (nobody ran there since); a
        # visitor's own pool is read by them only
        for profile_key, stats in seen.items():
            if profile_key == DEFAULT_PROFILE.key or any(
                s.profile.per_visitor for s in LESSON.scenarios if s.profile.key == profile_key
            ):
                continue
            other = Client(url, verbose=False)
            scenario = next(s for s in LESSON.scenarios if s.profile.key == profile_key)
            other.predict(scenario.name, api_name="/load_scenario")
            reported = other.predict(api_name="/cache_stats")
            assert {k: reported[k] for k in stats.as_engine_reports()} == stats.as_engine_reports(), scenario.name
        kinds = [t["kind"] for v in (a, b) for t in v.toasts_seen]
        assert "warning" in kinds and "info" in kinds, f"Clear cache was both refused and done: {kinds}"
        ticks = [w.state()["checks"] for w in watches]
        assert min(ticks) > 10 * len(STOPS), f"the watch checked the live view too seldom: {ticks}"
        _assert_nothing_went_wrong(None, (a, b))


# ----- one stop ---------------------------------------------------------------------------------------------------
def _walk(stop: Stop, a: Visitor, b: Visitor, default_engine: Any, a_does_all: bool) -> StatsLine:
    """Both visitors through one stop (see the module's docstring); returns the engine's figures at its end.
    ``a_does_all``: A does all the stop says (Run twice, Follow-up, Compare) and checks its replay's last frame
    against the live view, while B runs once and replays around its last run; else the other way round (they take
    turns, to keep the walk short)."""
    profile = stop.scenario.profile
    own = profile.per_visitor  # a lesson's small pool: each visitor on a pool of their own
    client = default_engine if profile == DEFAULT_PROFILE else None
    n = len(stop.scenario.prompts)
    _arrive(a, stop)
    # a step on one's own pool empties it on arrival: wait for the view to show it (adjacent steps may share a pool,
    # so the stats line before the arrival already names it)
    before = _settle(a, client, stop, _emptied if own else lambda stats: [])
    before = _clear(a, b, before, client, stop)
    _set_max_tokens(a, stop.max_tokens)
    _start(a, "#run_btn")
    if a_does_all and b.last is not None:  # while A's run streams, B replays its last run, then moves on
        _replay_around(b)
    _arrive(b, stop)
    cleared = _press_clear(b)
    if own:  # nobody else is on B's own pool: its Clear is done, whatever A runs
        assert cleared["kind"] == "info", (stop.title, cleared)
        before_b = _settle(b, client, stop, _emptied)
    else:
        assert cleared["kind"] == "warning" and "Other visitors" in cleared["text"], (stop.title, cleared)
    looked_up = _turn(a, stop, _finish(a, n, stop), all_of_it=a_does_all)
    _set_max_tokens(b, stop.max_tokens)
    _start(b, "#run_btn")
    if not a_does_all:  # A replays while B's run streams
        _replay_around(a)
    looked_up_b = _turn(b, stop, _finish(b, n, stop), all_of_it=not a_does_all)
    if own:
        after = _settle(a, client, stop, _counts_the_runs(before, looked_up))
        after_b = _settle(b, client, stop, _counts_the_runs(before_b, looked_up_b))
        # the small pools, with the shorter answers: still under pressure
        assert after.evictions - before.evictions + after_b.evictions - before_b.evictions > 0, (stop.title, after)
        return after
    counts = _counts_the_runs(before, looked_up + looked_up_b)
    after = _settle(a, client, stop, counts)
    assert _settle(b, client, stop, counts).as_engine_reports() == after.as_engine_reports(), (
        "one engine, one set of figures"
    )
    if profile != DEFAULT_PROFILE:  # the small pool, with the shorter answers: still under pressure
        assert after.evictions > before.evictions, (stop.title, before, after)
    return after


def _emptied(stats: StatsLine) -> list[str]:
    return [] if stats.cached == 0 else [f"{stats.cached} cached"]


def _counts_the_runs(before: StatsLine, looked_up: list[tuple[int, int]]) -> Callable[[StatsLine], list[str]]:
    """Off the default engine nothing else reads the engine's counters, and a view refreshed between the two
    visitors' runs is at rest too (a run on the small pool takes about a second): wait for one that counts every run
    of the stop on this pool (``looked_up``: what each looked up and hit), or say what it counts."""
    queries, hits = (sum(x) for x in zip(*looked_up, strict=True))

    def check(stats: StatsLine) -> list[str]:
        delta = (stats.query_tokens - before.query_tokens, stats.hit_tokens - before.hit_tokens)
        if delta == (queries, hits):
            return []
        return [f"the engine looked up and hit {delta}, the badges of its runs {looked_up}"]

    return check


def _turn(v: Visitor, stop: Stop, first: RunResult, all_of_it: bool) -> list[tuple[int, int]]:
    """With ``all_of_it``, the rest of what the stop says after a first Run (Run again, Follow-up and Run, the replay's
    last frame checked against the live view, Compare); returns what each run on the stop's engine looked up and
    hit."""
    if not all_of_it:
        return [first.looked_up]
    n = len(stop.scenario.prompts)
    runs = [first]
    for _ in range(stop.runs - 1):
        _start(v, "#run_btn")
        runs.append(_finish(v, n, stop))
    if stop.follow_up:
        _follow_up(v, runs[-1], n)
        _start(v, "#run_btn")
        runs.append(_finish(v, n, stop))
    _replay_end_is_live(v, runs[-1], n)
    looked_up = [r.looked_up for r in runs]
    if stop.compare:
        _start(v, "#compare_btn")
        off = _finish(v, n, stop, compared=True)
        looked_up.append(_check_savings(v, off))
    if stop.replay_mine:
        _replay_mine(v, stop)
    return looked_up


# ----- moving -----------------------------------------------------------------------------------------------------
def _open_accordions(v: Visitor) -> None:
    """The max tokens slider and the coloured prompt tokens render once their accordions open."""
    v.page.get_by_text("Sampling and options").first.click()
    v.page.wait_for_selector("#max_tokens input[type=number]", timeout=VIEW_TIMEOUT_MS)
    v.page.locator("#tokens_accordion").get_by_text("Prompt tokens").click()
    v.page.wait_for_selector("#tokens_0", state="attached", timeout=VIEW_TIMEOUT_MS)


ARRIVED_JS = """
([note, prompts, namespace, maxTokens, engine, outlined]) => {
  if (!(document.getElementById('scenario_note')?.innerText || '').trim().startsWith(note)) return false;
  if (prompts.some((p, i) => document.querySelector(`#prompt_${i} textarea`)?.value !== p)) return false;
  if (document.querySelector('#n_panels input[type=number]')?.value !== String(prompts.length)) return false;
  if (document.querySelector('#cache_namespace input:checked')?.value !== namespace) return false;
  if (document.querySelector('#max_tokens input[type=number]')?.value !== String(maxTokens)) return false;
  if (outlined && !document.getElementById(outlined)?.style.outline.includes('solid')) return false;
  return (document.getElementById('stats')?.innerText || '').includes(engine);
}
"""


def _engine_words(profile: Profile) -> str:
    """How the stats line names the visitor's pool: a lesson's small pool is their own."""
    name = f"your own {profile.name}" if profile.per_visitor else profile.name
    return f"Your engine: {name} · {profile.settings.describe()}"


def _arrive(v: Visitor, stop: Stop) -> None:
    """Go to ``stop`` (Lesson ▶, or the dropdown), and wait until the page shows it: its note, its prompts, its run
    options, its engine in the stats line (the live view's next tick), and the lesson's outline on its view."""
    page, scenario = v.page, stop.scenario
    if stop.lesson_step is None:
        page.locator("#scenario input").click()
        options = [re.sub(r"^✓\s*", "", t).strip() for t in page.get_by_role("option").all_inner_texts()]
        assert options == [s.name for s in LESSON.scenarios], "the dropdown offers the deployment's scenarios"
        page.get_by_role("option", name=scenario.name).click()
    elif stop.lesson_step > 0:  # the page opens on the first step
        page.click("#lesson_next")
    outlined = LESSON.steps[stop.lesson_step].look_at if stop.lesson_step is not None else None
    arrived = [stop.note, scenario.prompts, scenario.namespace, scenario.max_tokens, _engine_words(scenario.profile)]
    _wait(v, ARRIVED_JS, [*arrived, outlined], VIEW_TIMEOUT_MS, f"arriving at {stop.title}")
    v.profile = scenario.profile


def _set_max_tokens(v: Visitor, value: int) -> None:
    box = v.page.locator("#max_tokens input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    _wait(v, "v => document.querySelector('#max_tokens input[type=number]').value === v", str(value), 5000, "max")


# ----- running ----------------------------------------------------------------------------------------------------
# A click on Run (or Compare) empties the request table at once, and the run's end fills it: a run is over when the
# table was emptied since the click and now lists every panel finished (a table filled by the run before never counts).
ARM_JS = """
() => {
  const finished = () => [...document.querySelectorAll('#requests [role=gridcell][data-col="2"]')]
    .filter(c => c.innerText.trim() === 'finished').length;
  window.__walkEmptied = !finished();  // the page's first run: nothing to empty
  window.__walkObserver?.disconnect();
  window.__walkObserver = new MutationObserver(() => { if (!finished()) window.__walkEmptied = true; });
  const changes = {subtree: true, childList: true, characterData: true};
  window.__walkObserver.observe(document.getElementById('requests'), changes);
}
"""
FINISHED_JS = """
n => window.__walkEmptied && [...document.querySelectorAll('#requests [role=gridcell][data-col="2"]')]
  .filter(c => c.innerText.trim() === 'finished').length === n
"""


def _start(v: Visitor, button: str) -> None:
    v.page.evaluate(ARM_JS)
    v.page.click(button)


def _finish(v: Visitor, n: int, stop: Stop, compared: bool = False) -> RunResult:
    """Wait for the run's end, then check that each panel's badge, table row and coloured tokens agree. After a
    Compare (``compared``) each badge and the table tell both halves, labelled: each half is checked, the coloured
    tokens against the caching-on half; returns the caching-off half (the run the replay shows)."""
    halves = HALVES if compared else ("",)
    _wait(v, FINISHED_JS, n * len(halves), RUN_TIMEOUT_MS, f"the run's end at {stop.title}")
    raw = read(v.page).raw
    assert all(text == "" for text in raw["badges"][n:]), f"badges of hidden panels: {raw['badges']}"
    for half in halves:
        said = [_half_of(text, half) for text in raw["badges"][:n]]
        badges = [Badge.parse(text) for text in said]
        assert all(badge is not None and badge.ended for badge in badges), raw["badges"]
        labels = [f"{i} ({half})" if half else str(i) for i in range(1, n + 1)]
        rows = [next((row for row in raw["table"] if row[0] == label), None) for label in labels]
        assert None not in rows, (labels, raw["table"])
        caching = half != HALVES[1]
        for i, (badge, row) in enumerate(zip(badges, rows, strict=True)):
            where = f"{v.name}, {stop.title}, panel {i + 1} {half}"
            assert (badge.cached is None) == (not caching), (where, said[i])
            # the badge's cached tokens are the pool's ("cached") and those loaded from a second tier, one column each
            causes = dict(zip(TABLE_CAUSES, row[4 : 4 + len(TABLE_CAUSES)], strict=True))
            served = [int(causes[c]) for c in (Cause.CACHED, Cause.LOADED) if causes[c].isdigit()]
            assert int(row[3]) == badge.prompt, (where, row, said[i])
            if badge.cached is None:
                assert causes[Cause.CACHED] == "off", (where, row, said[i])
            else:
                assert sum(served) == badge.cached, (where, row, said[i])
            generated = TABLE_COLUMNS.index("generated")
            assert 0 < int(row[generated]) <= int(raw["max_tokens"]), (where, "generated", row)
            computed = [int(v) for c, v in causes.items() if c not in (Cause.CACHED, Cause.LOADED) and v.isdigit()]
            assert sum(computed) + (badge.cached or 0) == badge.prompt, (
                where,
                "the causes add up to the prompt",
                row,
            )
            if not caching:
                continue
            tokens = raw["tokens"][i]  # the caching-on half's colouring, after a Compare
            shown = min(badge.prompt, MAX_HIGHLIGHT_TOKENS)
            cached_shown = min(badge.cached or 0, MAX_HIGHLIGHT_TOKENS)
            assert tokens is not None and (tokens["total"], tokens["cached"]) == (shown, cached_shown), (
                f"{where}: the prompt tokens show {tokens} (cached + computed), the badge {said[i]!r}"
            )
            assert tokens["titled"], f"{where}: every run of tokens says why when hovered"
    assert all(t is None or t["total"] == 0 for t in raw["tokens"][n:]), raw["tokens"]
    texts = raw["outputs"][:n]
    assert all(texts), f"{v.name}: every panel streamed text: {texts}"
    v.last = RunResult(badges, texts)
    return v.last


def _half_of(badge: str, half: str) -> str:
    """The part of a badge that tells one half of a Compare ("Caching on: ..."); the whole badge for a plain run."""
    if not half:
        return badge
    label = f"{half.capitalize()}:"
    return next((line.removeprefix(label) for line in badge.splitlines() if line.startswith(label)), "")


def _follow_up(v: Visitor, run: RunResult, n: int) -> None:
    """Follow-up turn: each prompt becomes prompt + the run's answer + FOLLOW_UP."""
    raw = read(v.page).raw
    assert raw["outputs"][:n] == run.texts, "the panels show the run's answers"
    expected = [p + o + FOLLOW_UP for p, o in zip(raw["prompts"][:n], run.texts, strict=True)]
    v.page.click("#follow_btn")
    _wait(
        v,
        "ps => ps.every((p, i) => document.querySelector(`#prompt_${i} textarea`).value === p)",
        expected,
        VIEW_TIMEOUT_MS,
        "the follow-up prompts",
    )


def _check_savings(v: Visitor, off: RunResult) -> tuple[int, int]:
    """Compare's chart and note tell the same counts, the caching-off half's badges add up to its prompt tokens; returns
    what the caching half looked up and hit (it ran on the visitor's engine; the other half on one without a cache)."""
    view = _poll(v, lambda view: [] if "Without it" in view.raw["savings_note"] else ["no comparison"], 10, "Compare")
    note = view.raw["savings_note"]
    on = re.search(r"With caching, (\d+) prefill tokens were computed for (\d+) prompt tokens: (\d+) \(", note)
    again = re.search(r"and (\d+) were computed again after preemptions", note)
    without = re.search(r"Without it, (\d+) were computed", note)
    assert on and without, note
    computed, prompt, served = map(int, on.groups())
    assert computed == prompt - served + (int(again.group(1)) if again else 0), note
    bars = {t["name"]: t["y"][0] for t in view.raw["plots"]["savings"]["traces"]}  # one chart: prefill tokens
    assert bars == {"caching on": computed, "caching off": int(without.group(1))}, (bars, note)
    assert sum(b.prompt for b in off.badges) == prompt, "both halves ran the same prompts"
    assert int(without.group(1)) >= prompt, "without a cache, every prompt token is computed"
    return prompt, served


def _replay_mine(v: Visitor, stop: Stop) -> None:
    """Replay my requests, offered once the run filled pages: the lab's table of every policy at the visitor's pool's
    size (a press must raise no error: the Workload choice it changes once asked again with a stale capacity)."""
    pool = stop.scenario.profile.settings.n_pages
    v.page.wait_for_selector("#sizing_mine:not([disabled])", timeout=VIEW_TIMEOUT_MS)
    v.page.click("#sizing_mine")
    note = "n => (document.getElementById('sizing_note')?.innerText || '').startsWith(`${n} blocks`)"
    _wait(v, note, pool, VIEW_TIMEOUT_MS, "Replay my requests' answer at the pool's size")


# ----- replay -----------------------------------------------------------------------------------------------------
NOTE_JS = "t => (document.getElementById('replay_note')?.innerText || '').includes(t)"


def _replay_end_is_live(v: Visitor, run: RunResult, n: int) -> None:
    """Right after the run (its engine quiet): ◀ step, then ▶ slow plays to the last frame; that frame shows the
    run's text and, cell for cell, the page map the live view shows after Live."""
    raw = read(v.page).raw
    frames = raw["replay_max"]
    assert frames > 1 and raw["replay_step"] == frames, (raw["replay_step"], frames)
    assert f"step {frames} of {frames} of your run" in raw["replay_note"], raw["replay_note"]
    v.page.click("#replay_back")
    _wait(v, NOTE_JS, f"Replay · step {frames - 1} of {frames} of your run", VIEW_TIMEOUT_MS, "◀ step")
    v.page.click("#replay_slow")
    _wait(v, NOTE_JS, f"Replay · step {frames} of {frames} of your run", VIEW_TIMEOUT_MS, "▶ slow to the end")
    engine_step = re.search(r"of your run \(engine step (\d+)\)", read(v.page).raw["replay_note"]).group(1)

    def last_frame_drawn(view: View) -> list[str]:
        cells = view.cells
        if cells is None or f"after step {engine_step} " not in cells.title or view.raw["replay_step"] != frames:
            return [f"the replay's last frame is not drawn: {cells.title if cells else None}"]
        return []

    replayed = _poll(v, last_frame_drawn, 10, "the replay's last frame")
    assert replayed.raw["outputs"][:n] == run.texts, "the last frame shows the run's text"
    v.page.click("#replay_live")
    live = _poll(v, _at_rest, SETTLE_S, "the live view after Live")
    differ = _cells_that_differ(replayed.cells, live.cells)
    assert not differ, f"{v.name}: the replay's last frame is not the live page map (replayed, live): {differ[:6]}"
    assert live.raw["outputs"][:n] == run.texts, "back to Live, the panels show the run's text"


def _cells_that_differ(replayed: MapCells, live: MapCells) -> list[tuple[Any, Any]]:
    """The page map's cells (colour and hover text) that differ between two drawings, as (one, other) pairs."""
    if len(replayed.z) != len(live.z):
        return [(f"{len(replayed.z)} rows", f"{len(live.z)} rows")]
    cells = [
        ((z1, t1), (z2, t2))
        for r1, r2, h1, h2 in zip(replayed.z, live.z, replayed.hover, live.hover, strict=True)
        for z1, z2, t1, t2 in zip(r1, r2, h1, h2, strict=True)
    ]
    return [pair for pair in cells if pair[0] != pair[1]]


def _replay_around(v: Visitor) -> None:
    """While the other visitor runs: the slider to 0 (before the run: no text), step ▶ once, then Live, which shows
    the live page map and the run's text again."""
    run = v.last
    assert run is not None
    n = len(run.texts)
    box = v.page.locator("#replay_step input[type=number]")
    box.fill("0")
    box.press("Enter")
    _wait(v, NOTE_JS, "Replay · before your run", VIEW_TIMEOUT_MS, "the replay slider at 0")
    no_text = "n => [...Array(n).keys()].every(i => document.querySelector(`#out_${i} textarea`).value === '')"
    _wait(v, no_text, n, VIEW_TIMEOUT_MS, "no text before the run")
    v.page.click("#replay_fwd")
    _wait(v, NOTE_JS, "Replay · step 1 of", VIEW_TIMEOUT_MS, "step ▶")
    v.page.click("#replay_live")

    def back_live(view: View) -> list[str]:
        """The live map and the run's text: two answers (a waiting live tick wakes as the Live click lands, and can
        draw the map before the click's own answer brings the text), so both are waited for."""
        replaying = [] if view.cells and "after step" not in view.cells.title else ["replaying"]
        return replaying + ([] if view.raw["outputs"][:n] == run.texts else ["the panels lack the run's text"])

    _poll(v, back_live, 10, f"{v.name}: back to Live, the live map and the panels showing the run's text")


# ----- the engine's figures ---------------------------------------------------------------------------------------
def _at_rest(view: View) -> list[str]:
    """The live view's disagreements, once it shows no page in use: every check of the walk that reads the live view
    is made when no run is on its engine, and a view that agrees with itself can still be one drawn mid-run (a step
    slower than a tick reads as quiet, and the next tick draws everything)."""
    found = view.live_disagreements()
    if view.stats is not None and view.stats.used:
        found.append(f"{view.stats.used} pages still in use")
    return found


def _settle(
    v: Visitor, client: Any, stop: Stop, expect: Callable[[StatsLine], list[str]] = lambda stats: []
) -> StatsLine:
    """Wait until the visitor's live view shows its engine at rest, agrees with itself and (on the default engine)
    with the engine's own counters, and its stats line with ``expect``; returns its stats line."""

    def problems(view: View) -> list[str]:
        found = _at_rest(view)
        if view.stats is not None:
            found += expect(view.stats)
        if _engine_words(v.profile) not in view.raw["stats"]:
            found.append(f"not on {v.profile.name}: {view.raw['stats']!r}")
        if client is not None and view.stats is not None:
            reported = client.predict(api_name="/cache_stats")
            shown = view.stats.as_engine_reports()
            if {k: reported[k] for k in shown} != shown:
                found.append(f"the stats line {shown} is not the engine's {reported}")
        return found

    return _poll(v, problems, SETTLE_S, f"the engine's figures at {stop.title}").stats


def _press_clear(v: Visitor) -> dict[str, str]:
    before = len(v.watch.toasts())
    v.page.click("#clear_btn")
    _wait(v, "n => window.__walk.toasts.length > n", before, VIEW_TIMEOUT_MS, "Clear cache's answer")
    toast = v.watch.toasts()[before]
    v.toasts_seen.append(toast)
    return toast


def _clear(a: Visitor, b: Visitor, before: StatsLine, client: Any, stop: Stop) -> StatsLine:
    """A presses Clear cache on an engine nobody runs on: refused while B is on it too, done where nobody else is
    (a pool of A's own, or the small pool with B not there yet); either way its figures say what happened. Returns
    the stats after it."""
    toast = _press_clear(a)
    if b.profile == a.profile and not a.profile.per_visitor:
        assert toast["kind"] == "warning", (stop.title, toast)
    elif a.profile != DEFAULT_PROFILE:  # nobody else there (a poll of /cache_stats counts on the default engine)
        assert toast["kind"] == "info", (stop.title, toast)
    if toast["kind"] == "warning":
        return before
    freed = re.fullmatch(r"Prefix cache cleared: (\d+) cached pages are free again\.", toast["text"])
    assert freed and int(freed.group(1)) == before.cached, (toast, before)
    after = _settle(a, client, stop, _emptied)
    assert after.free == before.free + before.cached, (before, after)
    return after


# ----- waiting, and what went wrong -------------------------------------------------------------------------------
def _wait(v: Visitor, js: str, arg: Any, timeout_ms: int, what: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        v.page.wait_for_function(js, arg=arg, timeout=timeout_ms)
    except PlaywrightTimeout:
        raw = read(v.page).raw
        seen = {k: raw[k] for k in ("note", "replay_note", "stats", "badges", "table", "max_tokens", "replay_step")}
        raise AssertionError(f"{v.name}: waited {timeout_ms} ms for {what}; problems {_problems(v)}; {seen}") from None


def _poll(v: Visitor, problems: Callable[[View], list[str]], timeout: float, what: str) -> View:
    try:
        return poll(v.page, problems, timeout)
    except AssertionError as exc:
        raw = read(v.page).raw
        seen = {k: raw[k] for k in ("note", "replay_note", "stats", "badges", "replay_step")}
        title = (raw["plots"]["page_map"] or {}).get("title")
        raise AssertionError(f"{v.name}, {what}: {exc}; problems {_problems(v)}; {seen}; map {title!r}") from None


def _log_problems(log: Path) -> list[str]:
    """The app log's lines that say something failed; a traceback as its exception's line ("RuntimeError: ...")."""
    lines = log.read_text(errors="replace").splitlines()
    problems = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            said = next((later for later in lines[i + 1 :] if later and not later[0].isspace()), "?")
            problems.append(f"app log: a traceback, {said}")
        elif LOG_PROBLEM.search(line) and not re.match(r"\w+(Error|Exception)\b", line):
            problems.append(f"app log: {line}")
    return problems


def _problems(*visitors: Visitor) -> list[str]:
    return [line for v in visitors for line in v.watch.problems()] + _log_problems(visitors[0].log)


def _assert_nothing_went_wrong(stop: Stop | None, visitors: tuple[Visitor, ...]) -> None:
    problems = _problems(*visitors)
    assert not problems, f"after {stop.title if stop else 'the walk'}:\n" + "\n".join(problems)


# ----- what the walk found, pinned in process (no browser) --------------------------------------------------------
@pytest.fixture(scope="module")
def pg() -> Iterator[Playground]:
    with playground() as pg:
        yield pg


def _run_in_process(pg: Playground, session: str) -> list[str]:
    """A run of the page's first lesson step, short, to its end (as the browser chains ``after_run``); its texts."""
    texts: dict[Any, str] = {}
    for update in pg.runs.run(pg.fields(max_tokens=8), request(session)):
        texts = update
    pg.runs.after_run(request(session))
    return [texts[box] for box in pg.ctx.ui.panels.outputs]


def test_live_after_replaying_a_step_shows_the_runs_text_again(pg):
    """Live reset the charts only: the panels kept the replayed step's text, and a Follow-up turn then built its
    prompts from a truncated answer."""
    session, outputs = "live-text", pg.ctx.ui.panels.outputs
    texts = _run_in_process(pg, session)
    step = pg.replays.show_step(1, request(session))
    assert [step[box] for box in outputs] != texts, "control: step 1 of the run shows less text"
    back = pg.replays.live(request(session))
    assert [back.get(box) for box in outputs] == texts


def test_live_redraws_even_when_a_tick_of_the_replay_answers_after_it(pg):
    """A 1 Hz tick in flight when Live is pressed answers after it, and the page keeps that tick's cursor, not the
    one Live reset: it said "settled", so on a quiet engine the replayed page map stayed on screen for good."""
    session, cache = "tick-race", pg.ctx.ui.cache
    _run_in_process(pg, session)
    cursor = None
    for _ in range(3):  # drawn, then redrawn once quiet, then settled
        cursor = pg.live.refresh(cursor, request(session))[cache.cursor]
    assert cursor.settled
    pg.replays.show_step(1, request(session))
    in_flight = pg.live.refresh(cursor, request(session))[cache.cursor]  # began before the click on Live ...
    pg.replays.live(request(session))  # ... and answered after it: its cursor is the one the page keeps
    update = pg.live.refresh(in_flight, request(session))
    assert cache.page_map in update, "back to live, the page map is redrawn"
    assert "after step" not in update[cache.page_map].layout.title.text
