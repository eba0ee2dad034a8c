"""The teacher's view: opened only by the operator's key, never by a visitor; it shows counts only, and reaches
visitors only as the banner that moves the class (``callbacks/teacher.py``, ``classroom.py``).

In process, the callbacks called as Gradio calls them (a request is its session hash and the page's query); the
last test drives the real app in Chromium: the key in the address, presenter mode, the banner and its button."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr
import pytest

from astrai.playground import knobs
from astrai.playground.backends.engines import LocalEngines
from astrai.playground.callbacks.context import Context
from astrai.playground.callbacks.live import LiveCallbacks, LiveCursor
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.setup import SetupCallbacks
from astrai.playground.callbacks.teacher import TeacherCallbacks
from astrai.playground.classroom import CALL_STANDS_S, Classroom
from astrai.playground.scenarios import SCENARIO_BY_NAME, Lesson
from astrai.playground.state import SEEN_WITHIN_S, Visitors
from astrai.playground.ui.app import build_demo
from astrai.playground.ui.layout import build_layout
from astrai.playground.ui.teacher import build_banner, build_teacher_views
from tests.support.needs import NO_CHROMIUM
from tests.support.playground import no_progress

KEY = "teacher-key-" + "x" * 12
LESSON = Lesson.for_deployment(routers=0)
SECRET_WORD = "Quetzalcoatlus"  # in a visitor's prompt: it must never reach the teacher's view
TEACHER_ELEMS = {"teacher_view", "class_panel", "class_move", "class_banner", "class_follow"}


def request(session: str, **query: str) -> Any:
    return SimpleNamespace(session_hash=session, query_params=query)


def step_of(title: str) -> int:
    return next(i for i, step in enumerate(LESSON.steps) if step.title == title)


@dataclass
class Class:
    ctx: Context
    teacher: TeacherCallbacks
    runs: RunCallbacks
    live: LiveCallbacks
    setup: SetupCallbacks
    cursors: dict[str, LiveCursor] = field(default_factory=dict)  # each page's live view, as it last drew

    def open_page(self, session: str, **query: str) -> dict:
        """A page opens, on the lesson's first step (the query: its address's)."""
        return self.teacher.arrive(0, LESSON.steps[0].scenario, request(session, **query))

    def go_to(self, session: str, index: int) -> None:
        """Lesson ▶ to step ``index``: the step's scenario loaded, then the page's change events (as Gradio fires
        them) place it."""
        self.setup.lesson(index, 0, request(session), no_progress)
        self.teacher.place(index, LESSON.steps[index].scenario, request(session))

    def run(self, session: str, scenario_name: str, compare: bool = False, **changes: Any) -> None:
        """Run (or Compare) the scenario's prompts, with ``changes`` to the form, 4 tokens each."""
        fields = {name: c.value for name, c in self.ctx.ui.run_fields().items()}
        scenario = SCENARIO_BY_NAME[scenario_name]
        prompts = {f"prompt_{i + 1}": p for i, p in enumerate(scenario.prompts)}
        values = fields | prompts | {"n_panels": len(scenario.prompts), "shared_prefix": scenario.prefix}
        values |= {"max_tokens": 4, "cache_namespace": scenario.namespace} | changes
        for _ in (self.runs.compare if compare else self.runs.run)(values, request(session)):
            pass


@pytest.fixture(scope="module")
def engines() -> Iterator[LocalEngines]:
    engines = LocalEngines(idle_retire_s=3600, compile=False)
    try:
        yield engines
    finally:
        engines.shutdown()


@pytest.fixture
def klass(engines) -> Class:
    """The app's parts wired as ``build_demo`` wires them with a teacher's key, a fresh classroom each test."""
    with gr.Blocks():
        views, banner = build_teacher_views(LESSON), build_banner()
        ui = build_layout(engines.default, list(engines.model_choices()), engines.chooses_pools, LESSON)
    ctx = Context(engines, Visitors(engines.default), ui, StreamingRuns(), LESSON, Classroom())
    teacher = TeacherCallbacks(ctx, KEY, views, banner)
    runs = RunCallbacks(ctx)
    return Class(ctx, teacher, runs, LiveCallbacks(ctx, runs, teacher), SetupCallbacks(ctx, runs))


def elem_ids(demo: gr.Blocks) -> set[str]:
    return {c["props"].get("elem_id") for c in demo.get_config_file()["components"]} - {None}


# ----- access ----------------------------------------------------------------------------------------------------
def test_without_a_key_there_is_no_teacher_view_at_all(engines):
    assert not elem_ids(build_demo(engines, teacher_key=None)) & TEACHER_ELEMS
    assert elem_ids(build_demo(engines, teacher_key=KEY)) >= TEACHER_ELEMS  # the check above can fail


def test_the_teacher_view_adds_no_loading_status(engines):
    """Its events show no progress (``QUIET``): each component an event shows progress on costs every visitor's
    page a refresh at every streamed message (tests/test_app.py keeps them to five)."""
    config = build_demo(engines, teacher_key=KEY).get_config_file()
    elem = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    targets = set()
    for dependency in config["dependencies"]:
        if dependency["targets"]:
            shown = dependency["show_progress_on"]
            targets |= set(dependency["outputs"] if shown is None else shown)
    assert {elem[t] for t in targets} == {"out_0", "scenario_note", "engine_status", "sizing_note", "ladder_note"}


def test_a_short_key_stops_the_app_and_is_never_echoed(monkeypatch):
    monkeypatch.setenv("ASTRAI_TEACHER_KEY", "hunter2")
    with pytest.raises(knobs.KnobError, match="at least 16 characters") as refused:
        knobs.teacher_key()
    assert "hunter2" not in str(refused.value)
    monkeypatch.setenv("ASTRAI_TEACHER_KEY", "  ")
    assert knobs.teacher_key() is None
    monkeypatch.setenv("ASTRAI_TEACHER_KEY", KEY)
    assert knobs.teacher_key() == KEY


@pytest.mark.parametrize("query", [{}, {"teacher": ""}, {"teacher": KEY[:-1]}, {"teacher": KEY + "x"}])
def test_a_wrong_or_missing_key_opens_nothing(klass, query):
    views = klass.teacher.views
    opened = klass.open_page("visitor", **query)
    assert opened == {views.box: gr.skip()}, "the teacher's view stays hidden"
    assert not klass.ctx.classroom.is_teacher("visitor")
    assert klass.teacher.class_panel(request("visitor")) == {views.panel: gr.skip()}
    with pytest.raises(gr.Error, match="Only the teacher's view"):
        klass.teacher.move(2, request("visitor"))
    assert klass.ctx.classroom.standing_call() is None


def test_the_right_key_opens_the_view_in_presenter_mode(klass):
    views = klass.teacher.views
    opened = klass.open_page("teacher", teacher=KEY)
    assert opened[views.box].visible is True and opened[views.presenter] is True
    assert opened[views.timer].active is True and "open pages" in opened[views.panel]
    assert klass.ctx.classroom.is_teacher("teacher")
    assert "open pages" in klass.teacher.class_panel(request("teacher"))[views.panel]
    update = klass.teacher.move(2, request("teacher"))
    assert update[klass.ctx.ui.setup.lesson_step] == 1, "the teacher's own page goes there too (Lesson ▶ is next)"


# ----- privacy and the class's counts --------------------------------------------------------------------------
def panel_row(panel: str, name: str) -> list[str]:
    row = next(line for line in panel.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in row.strip("|").split("|")][1:]


def test_the_class_panel_counts_a_known_sequence_of_runs_and_shows_no_visitors_text(klass):
    """A on step 1 runs (its prompt holds a word of its own), B on step 6 compares, C on a scenario of their own
    runs: step 1 counts A's panels, step 6 Compare's caching-on half only, C counts nowhere; each count is the
    engine's own per request."""
    classroom, teacher = klass.ctx.classroom, klass.teacher
    klass.open_page("teacher", teacher=KEY)
    for session in ("a", "b", "c"):
        klass.open_page(session)
    klass.run("a", LESSON.steps[0].scenario, prompt_4=f"One day, {SECRET_WORD} the bird")
    compare = step_of("Caching off versus on")
    klass.go_to("b", compare)
    klass.run("b", LESSON.steps[compare].scenario, compare=True)
    klass.setup.load_scenario("Follow-up turn", request("c"), no_progress)  # C's own choice, off the lesson
    teacher.place(0, "Follow-up turn", request("c"))
    klass.run("c", "Follow-up turn", prompt_1=f"{SECRET_WORD} went")

    a = klass.ctx.visitors.act("a").shown
    backend = klass.ctx.engines.backend(a.profile)
    infos = backend.request_info(list(a.request_ids))
    b_on = klass.ctx.visitors.act("b").with_cache  # Compare's caching-on half (default engine: no preemption)
    assert b_on is not None and b_on.recomputed_tokens == 0
    expected = {0: (sum(i.cached_tokens for i in infos), sum(i.prompt_tokens for i in infos))}
    expected[compare] = (b_on.prompt_tokens - b_on.computed_tokens, b_on.prompt_tokens)
    assert expected[0][0] > 0 and expected[compare][0] > 0

    for session in ("a", "b", "c"):  # their pages poll (a page that stops polling drops out: the last test)
        classroom.waiting_call(session)
    view = classroom.view()
    assert view.on_step == {0: 1, compare: 1} and view.elsewhere == 1
    assert {i: (h.cached_tokens, h.looked_up_tokens) for i, h in view.hits.items()} == expected
    assert {i: h.runs for i, h in view.hits.items()} == {0: 1, compare: 1}
    panel = teacher.class_panel(request("teacher"))[teacher.views.panel]
    cells = panel_row(panel, "cached / looked up")
    assert cells[0] == f"{expected[0][0]:,} / {expected[0][1]:,}"
    assert cells[compare] == f"{expected[compare][0]:,} / {expected[compare][1]:,}"
    assert all(cell == "–" for i, cell in enumerate(cells) if i not in expected)
    assert panel_row(panel, "open pages")[0] == "1" and "**3** open pages" in panel
    # nothing the teacher's callbacks return holds a visitor's text; a visitor's own view does (the check can fail)
    returned = [klass.open_page("teacher", teacher=KEY), teacher.class_panel(request("teacher"))]
    returned.append(teacher.move(0, request("teacher")))
    assert SECRET_WORD not in json.dumps([list(r.values()) for r in returned], default=str)
    mine = klass.runs.details(klass.ctx.visitors.act("a"), "a")
    assert SECRET_WORD in json.dumps(list(mine.values()), default=str)


# ----- the banner --------------------------------------------------------------------------------------------------
def settled(klass: Class, session: str) -> LiveCursor:
    """The cursor of a page that has drawn everything: its next poll waits for a change (``LiveCallbacks.idle``)."""
    cursor = None
    for _ in range(10):
        cursor = klass.live.refresh(cursor, request(session))[klass.ctx.ui.cache.cursor]
        if klass.live.idle(cursor, session):
            return cursor
    raise AssertionError(f"{session}'s page never settled")


def tick(klass: Class, session: str) -> dict:
    """The live view's poll of a page that has drawn everything: it answers at once for a change, or once it has
    waited ``IDLE_WAIT_S`` with nothing."""
    return asyncio.run(klass.live.watch(klass.cursors[session], request(session)))


def test_the_call_reaches_each_visitors_page_once_as_a_banner_and_nothing_else(klass, monkeypatch):
    monkeypatch.setattr("astrai.playground.callbacks.live.IDLE_WAIT_S", 0.5)  # a poll with nothing answers sooner
    teacher, banner, views = klass.teacher, klass.teacher.banner, klass.teacher.views
    klass.open_page("teacher", teacher=KEY)
    klass.open_page("here")
    klass.open_page("there")
    eviction = step_of("Eviction costs hits")
    klass.go_to("there", eviction)
    klass.cursors = {session: settled(klass, session) for session in ("here", "there", "teacher")}
    assert banner.row not in tick(klass, "here"), "no call yet"
    teacher.move(eviction, request("teacher"))
    shown = tick(klass, "here")
    assert shown[banner.row].visible is True and shown[banner.follow].value == f"Go to step {eviction + 1}"
    assert "Your teacher moved the class to step 3" in shown[banner.text]
    assert not set(shown) & {views.box, views.panel, views.presenter, views.step, views.move, views.timer}
    assert banner.row not in tick(klass, "here"), "shown once"
    assert banner.row not in tick(klass, "there"), "already on the called step"
    assert banner.row not in tick(klass, "teacher"), "the teacher is not called"
    # following: the step before the called one, then the page's own Lesson ▶ (the browser presses it)
    followed = teacher.follow(request("here"))
    assert followed[banner.row].visible is False
    index = followed[klass.ctx.ui.setup.lesson_step]
    loaded = klass.setup.lesson(index, 1, request("here"), no_progress)
    assert loaded[klass.ctx.ui.setup.lesson_step] == eviction
    assert f"Lesson {eviction + 1}/{LESSON.length}" in loaded[klass.ctx.ui.setup.note]


def test_the_classroom_forgets_pages_that_stop_polling_and_calls_that_grew_old():
    now = [0.0]
    classroom = Classroom(clock=lambda: now[0])
    classroom.place("a", 2)
    classroom.place("b", None)
    classroom.admit_teacher("t")
    classroom.place("t", 1)  # a teacher's page is never counted
    assert classroom.view().on_step == {2: 1} and classroom.view().elsewhere == 1
    call = classroom.call(0)
    now[0] = SEEN_WITHIN_S / 2
    assert classroom.waiting_call("a") == call  # polled: seen
    now[0] = SEEN_WITHIN_S * 1.2
    assert classroom.view().on_step == {2: 1} and classroom.view().elsewhere == 0, "b stopped polling"
    now[0] = CALL_STANDS_S + 1
    assert classroom.waiting_call("a") is None and classroom.standing_call() is None
    classroom.count_run(None, [(10, 5)])  # not on a step: not counted
    classroom.count_run(2, [(10, None)])  # never looked up: not counted
    classroom.count_run(2, [(10, 4), (20, None), (30, 16)])
    assert classroom.view().hits[2].runs == 1
    assert (classroom.view().hits[2].cached_tokens, classroom.view().hits[2].looked_up_tokens) == (20, 40)


# ----- in Chromium -----------------------------------------------------------------------------------------------
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
OPEN_PAGES_JS = (
    "(() => { const row = [...document.querySelectorAll('#class_panel tr')]"
    ".find(r => r.cells[0] && r.cells[0].innerText.trim() === 'open pages');"
    " return row ? [...row.cells].slice(1).map(c => c.innerText.trim()) : null; })()"
)


@pytest.mark.browser
@pytest.mark.slow
def test_browser_the_key_opens_presenter_mode_and_the_class_follows_the_banner(tmp_path):
    """One app with a key: a visitor's page and a wrong key's show no teacher's view; the teacher's does, in
    presenter mode (Lesson ▶ scrolls nothing), the key gone from its address; the teacher moves the class and the
    visitor's banner button loads the step; and tools.screenshot makes README's image from this app."""
    if not shutil.which("chromium"):
        pytest.skip(NO_CHROMIUM)
    from tools import screenshot
    from tools.browser import open_visitors, poll_by_clock
    from tools.loadtest import launch_app

    ARTIFACTS.mkdir(exist_ok=True)
    eviction = step_of("Eviction costs hits")
    with launch_app({"ASTRAI_TEACHER_KEY": KEY}, log_path=ARTIFACTS / "teacher-app.log") as url:
        with open_visitors(url, 2, viewport=(1366, 768)) as (visitor, wrong):
            wrong.goto(f"{url}?teacher={KEY[:-1]}z")
            teacher = poll_by_clock(
                visitor.context.browser.new_context(viewport={"width": 1366, "height": 768}).new_page()
            )
            teacher.goto(f"{url}?teacher={KEY}")
            teacher.wait_for_selector("#class_panel", state="visible", timeout=60000)
            teacher.wait_for_selector("#astrai_presenter", state="attached", timeout=10000)
            teacher.wait_for_function("!window.location.search.includes('teacher')", timeout=10000)
            wrong.wait_for_selector("#run_btn", state="visible", timeout=60000)
            for page in (visitor, wrong):
                assert not page.locator("#teacher_view").is_visible() and not page.locator("#class_panel").is_visible()
            wide, narrow = (p.locator("#page_map").bounding_box()["width"] for p in (teacher, visitor))
            assert wide > 2 * narrow, f"presenter mode: a larger page map ({wide} px wide, a visitor's {narrow})"
            # polled by the clock, not by animation frames: a page drawn in the background may get none (in CI at
            # df13fe2, the first wait here saw none for 30 s)
            for number in range(2, eviction + 2):  # pressed from a script: a click by Playwright would scroll to it
                teacher.evaluate("document.getElementById('lesson_next').click()")
                teacher.wait_for_function(
                    f"document.querySelector('#scenario_note').innerText.includes('Lesson {number}/')", polling=250
                )
            look_at = LESSON.steps[eviction].look_at  # below the fold: a visitor's page scrolls to it
            teacher.wait_for_function(
                f"document.getElementById('{look_at}').style.outline.includes('solid')", polling=250
            )
            assert teacher.evaluate("window.scrollY") == 0, "presenter mode: the lesson's highlight scrolls nothing"
            teacher.locator("#class_step input").click()
            teacher.get_by_role("option", name=re.compile(f"^step {eviction + 1}:")).click()
            teacher.click("#class_move")
            visitor.wait_for_selector("#class_banner", state="visible", timeout=30000)
            visitor.click("#class_follow")
            visitor.wait_for_function(
                f"document.querySelector('#scenario_note').innerText.includes('Lesson {eviction + 1}/')", timeout=60000
            )
            assert not visitor.locator("#class_banner").is_visible()
            # the class panel: the visitor on the called step, the wrong key's page still on step 1
            expected = ["1" if i in (0, eviction) else "0" for i in range(len(LESSON.steps))]
            compact = json.dumps(expected, separators=(",", ":"))  # as JSON.stringify writes it
            teacher.wait_for_function(
                f"JSON.stringify({OPEN_PAGES_JS}) === {json.dumps(compact)}", timeout=10000, polling=250
            )
            teacher.screenshot(path=str(ARTIFACTS / "teacher.png"))
        image = tmp_path / "playground.png"  # its own browser: Playwright's sync API does not nest
        assert screenshot.main(["--url", url, "--out", str(image)]) == 0
        png = image.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == screenshot.VIEWPORT
