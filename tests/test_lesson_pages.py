"""The lesson's pages as a class meets them (issue 43): every page starts from a clean slate, and the lesson ends.

In process, through the playground's own callbacks as Gradio calls them (no browser):
- loading any page (Lesson ▶, ◀ Lesson, Restart lesson, or a scenario picked) empties every view of the last run
  (its text, badges, token colouring, request table, savings, replay) and puts the view back live, whatever the
  visitor did before (a run, then replaying its first step);
- past the last step, "What you saw" counts the prompt tokens of the visitor's own runs by cause (the request
  table's cause columns, summed; never another visitor's) and gives the five reasons a token is computed; Restart
  lesson starts the count again at the first step.

tests/test_lesson_layout.py walks the same pages in Chromium, for where each lands on the screen.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pytest

from astrai.explain import Cause
from astrai.playground.scenarios import Lesson
from astrai.playground.views import causes, text
from tests.support.playground import Playground, no_progress, playground, request

LESSON = Lesson.for_deployment(routers=0)
CAUSE_COLUMNS = {cause: text.TABLE_COLUMNS.index(words) for cause, (words, _) in causes.CAUSES.items()}


@pytest.fixture(scope="module")
def pg() -> Iterator[Playground]:
    with playground() as pg:
        yield pg


def _form(pg: Playground, loaded: dict[Any, Any], short: bool = True) -> dict[str, Any]:
    """The run form once a page loaded: what its update set, over the page's first values; ``short``: 2 tokens an
    answer."""
    fields = {name: loaded.get(component, pg.fields()[name]) for name, component in pg.ctx.ui.run_fields().items()}
    return fields | ({"max_tokens": 2} if short else {})


def _run(pg: Playground, session: str, form: dict[str, Any]) -> dict[Any, Any]:
    """A run to its end, then what the browser chains after it (``after_run``): its update."""
    for _ in pg.runs.run(form, request(session)):
        pass
    return pg.runs.after_run(request(session))


def _value(update: Any) -> Any:
    """A value as sent: a component given as an update sends one only where it was given one ("unchanged" if not)."""
    if isinstance(update, gr.components.Component):
        return update.constructor_args.get("value", "unchanged")
    return update


def _assert_clean_slate(pg: Playground, session: str, update: dict[Any, Any], where: str) -> None:
    ui = pg.ctx.ui
    views = {
        "text": [update[box] for box in ui.panels.outputs],
        "badges": [update[badge] for badge in ui.panels.badges],
        "token colouring": [_value(update[box]) for box in ui.panels.highlights],
    }
    for what, values in views.items():
        assert all(not v for v in values), f"{where}: the last run's {what} stay: {values}"
    assert update[ui.cache.table] == [], f"{where}: the request table keeps the last run's rows"
    assert _value(update[ui.cache.savings_note]).startswith("Run a batch"), f"{where}: {update[ui.cache.savings_note]}"
    assert not update[ui.cache.savings].data, f"{where}: the savings chart keeps the last run's bars"
    assert _value(update[ui.replay.step]) == 0 and update[ui.replay.note] == "", f"{where}: the replay stays"
    assert update[ui.replay.timer].active is False and update[ui.cache.cursor] is None, where
    panels = _value(update.get(ui.form.n_panels))
    if panels is not None:  # a scenario loaded: its panels shown, their token boxes too, and no more
        shown = [update[view].visible for view in (*ui.panels.columns, *ui.panels.highlights)]
        assert shown == [i < panels for i in range(len(ui.panels.columns))] * 2, f"{where}: {panels} panels: {shown}"
        assert update[ui.setup.lesson_end].visible is False, f"{where}: the lesson's end stays"
    visitor = pg.ctx.visitors.peek(session)
    assert visitor.following and visitor.playback is None, f"{where}: still replaying"
    assert visitor.shown is None and visitor.recording is None, f"{where}: the last run is still the one shown"
    live = pg.live.refresh(update[ui.cache.cursor], request(session))
    assert "after step" not in live[ui.cache.page_map].layout.title.text, f"{where}: the page map is a replay's"
    assert not any(live.get(badge) for badge in ui.panels.badges), f"{where}: the live view brings badges back"


def _dirty(pg: Playground, session: str, loaded: dict[Any, Any]) -> None:
    """Everything a run fills, full (a run of the page's prompts), and the visitor replaying its first step."""
    done = _run(pg, session, _form(pg, loaded))
    assert any(done[badge] for badge in pg.ctx.ui.panels.badges) and done[pg.ctx.ui.cache.table], "the run showed"
    pg.replays.show_step(1, request(session))
    assert not pg.ctx.visitors.peek(session).following


def test_every_lesson_page_starts_from_a_clean_slate(pg):
    """Lesson ▶ from every page to the next (the end too), after a run and while replaying it; then ◀ Lesson, Restart
    lesson and a scenario picked from the dropdown. Before, the badges of step N stayed under step N+1's prompts and
    step 3's replayed small-pool tree stayed on screen at step 4."""
    session, setup = "clean-slate", pg.setup
    loaded = setup.lesson(0, 0, request(session), no_progress)
    for page in range(LESSON.length - 1):
        if not LESSON.is_end(page):
            _dirty(pg, session, loaded)
        loaded = setup.lesson(page, 1, request(session), no_progress)
        _assert_clean_slate(pg, session, loaded, f"Lesson ▶ to page {page + 2}")
    loaded = setup.lesson(LESSON.length - 2, 0, request(session), no_progress)
    _dirty(pg, session, loaded)
    _assert_clean_slate(pg, session, setup.lesson(LESSON.length - 2, -1, request(session), no_progress), "◀ Lesson")
    _dirty(pg, session, setup.lesson(0, 0, request(session), no_progress))
    _assert_clean_slate(pg, session, setup.restart(request(session), no_progress), "Restart lesson")
    _dirty(pg, session, setup.lesson(0, 0, request(session), no_progress))
    picked = setup.load_scenario(LESSON.scenarios[1].name, request(session), no_progress)
    _assert_clean_slate(pg, session, picked, "a scenario picked")


def _table_counts(update: dict[Any, Any], pg: Playground) -> dict[Cause, int]:
    """A run's prompt tokens by cause, as its request table shows them (the causes' columns summed)."""
    rows = update[pg.ctx.ui.cache.table]
    return {cause: sum(row[column] or 0 for row in rows) for cause, column in CAUSE_COLUMNS.items()}


def _end_counts(markdown: str) -> dict[str, int]:
    """What the end's table says, by cause in words."""
    return {
        m.group(1): int(m.group(2).replace(",", ""))
        for m in re.finditer(r"^\| ([a-z ]+) \| ([\d,]+) \|", markdown, re.M)
    }


def test_the_end_counts_the_visitors_own_runs_by_cause_and_restart_starts_over(pg):
    """Visitor A runs steps 1 and 8 (cached, new, diverged, evicted, partial page, last token); visitor B runs step 2
    on the same default engine meanwhile. A's end counts A's tokens exactly as A's request tables did, none of B's;
    it names the five reasons a token is computed; Lesson ▶ is off there and Restart lesson on. Restart lesson goes
    to the first step, and the end then counts nothing."""
    a, b, setup, ui = "end-a", "end-b", pg.setup, pg.ctx.ui
    expected: dict[Cause, int] = {}
    for step in (0, 7):  # step 8's eviction takes panel 2's whole answer
        loaded = setup.lesson(step, 0, request(a), no_progress)
        for cause, count in _table_counts(_run(pg, a, _form(pg, loaded, short=step == 0)), pg).items():
            expected[cause] = expected.get(cause, 0) + count
        if step == 0:  # B's run, on the engine A's step 1 ran on
            _run(pg, b, _form(pg, setup.lesson(1, 0, request(b), no_progress)))
    assert all(expected[c] for c in (Cause.CACHED, *causes.COMPUTED_BECAUSE)), f"A's runs show every cause: {expected}"
    end = setup.lesson(LESSON.length - 2, 1, request(a), no_progress)
    shown = end[ui.setup.lesson_end]
    assert shown.visible and end[ui.setup.lesson_step] == LESSON.length - 1
    assert LESSON.note(LESSON.length - 1) == end[ui.setup.note] and "What you saw" in end[ui.setup.note]
    said = _end_counts(shown.value)
    assert said == {causes.CAUSES[c][0]: n for c, n in expected.items() if n or c in causes.COMPUTED_BECAUSE}, said
    assert "2 runs" in shown.value and f"**{sum(expected.values()):,}** prompt tokens" in shown.value, shown.value
    for cause, why in causes.COMPUTED_BECAUSE.items():
        assert f"**{causes.CAUSES[cause][0]}**: {why}" in shown.value
    assert end[ui.setup.lesson_next].interactive is False and end[ui.setup.restart].visible is True
    again = setup.lesson(LESSON.length - 1, 1, request(a), no_progress)  # Lesson ▶ on the end: it stays there
    assert again[ui.setup.lesson_step] == LESSON.length - 1
    restarted = setup.restart(request(a), no_progress)
    assert restarted[ui.setup.lesson_step] == 0 and restarted[ui.setup.note] == LESSON.note(0)
    assert restarted[ui.setup.scenario] == LESSON.steps[0].scenario and restarted[ui.setup.restart].visible is False
    assert restarted[ui.setup.lesson_prev].interactive is False and restarted[ui.setup.lesson_next].interactive
    fresh = setup.lesson(LESSON.length - 2, 1, request(a), no_progress)[ui.setup.lesson_end].value
    assert "You have run no batch" in fresh and _end_counts(fresh) == {}, fresh
    b_end = setup.lesson(LESSON.length - 2, 1, request(b), no_progress)[ui.setup.lesson_end].value
    assert "your 1 run " in b_end, b_end


def test_lesson_notes_number_each_page_once():
    """The notes said "Lesson 1/8: 1. A shared ..." (the number twice) and "Why did it miss?." (two ends); the end is
    a page of its own, numbered like the steps."""
    for index in range(LESSON.length):
        note = LESSON.note(index)
        assert note.startswith(f"**Lesson {index + 1}/{LESSON.length}: "), note
        assert not re.match(r"\*\*Lesson \d+/\d+: \d", note) and not re.search(r"[.?!]\.\*\*", note), note
    assert LESSON.is_end(LESSON.length - 1) and not LESSON.is_end(LESSON.length - 2)
    assert LESSON.look_at()[-1] == LESSON.end.look_at
