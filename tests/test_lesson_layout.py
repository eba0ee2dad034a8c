"""Every lesson page on a 1366×768 laptop screen, in Chromium (issue 43): the step's note, the buttons it says to
press and the view it points at are in the window together, after Lesson ▶ and after ◀ Lesson.

One page, one browser, the whole lesson: Lesson ▶ from the first page to the end ("What you saw"), then ◀ Lesson back
to the first, each page measured once its view is placed (the lesson's bar is pinned to the top of the window; the
view is placed just below it, and kept there while the step's updates land). On the way:
- the lesson's buttons are as large as Run (they were the page's smallest);
- step 1's badges are on screen after its run, without scrolling;
- a failed run's "Error" marker, the run's badges, table, token colouring, savings and a replay in progress are all
  gone once the next page loads (tests/test_lesson_pages.py checks every page in process);
- the end counts that run's tokens by cause (what its badges said).

The boxes measured are printed (``pytest -s``) and kept in test-artifacts/lesson_layout.json.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from astrai.playground import promises
from astrai.playground.scenarios import Lesson
from tests.support.needs import NO_CHROMIUM
from tools.browser import CHROMIUM, open_visitors, run_and_wait
from tools.loadtest import launch_app

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
LESSON = Lesson.for_deployment(routers=0)
WIDTH, HEIGHT = 1366, 768
WAIT_MS = 60_000
BUTTONS = {"run": "run_btn", "follow_up": "follow_btn", "compare": "compare_btn", "replay_mine": "sizing_mine"}
BOXES_JS = """
ids => Object.fromEntries(ids.map(id => {
  const e = document.getElementById(id);
  const r = e && e.getBoundingClientRect();
  return [id, r && r.height ? [Math.round(r.left), Math.round(r.top), Math.round(r.right), Math.round(r.bottom)]
    : null];
}))
"""
PLACED_JS = "n => window.__lessonPage?.page === n && !window.__lessonPage.settling"
ERROR_MARKERS_JS = """
() => [...document.querySelectorAll('[data-testid=status-tracker]')]
  .filter(e => (e.innerText || '').trim() === 'Error').map(e => e.closest('[id]')?.id)
"""


def pressed(page: int) -> list[str]:
    """The buttons a page's note says to press (the end: Restart lesson)."""
    if LESSON.is_end(page):
        return ["lesson_restart"]
    return list(dict.fromkeys(BUTTONS[p] for p in promises.presses(LESSON.steps[page])))


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    ARTIFACTS.mkdir(exist_ok=True)
    with launch_app(log_path=ARTIFACTS / "lesson_layout.log") as url:
        yield url


def _note_says(page: Any, number: int) -> None:
    page.wait_for_function(
        "n => (document.getElementById('scenario_note')?.innerText || '').startsWith(`Lesson ${n}/`)",
        arg=number,
        timeout=WAIT_MS,
    )


def _go(page: Any, button: str, to: int) -> None:
    """Lesson ▶ or ◀ Lesson, to page ``to`` (0-based): the note says it, and its view is placed."""
    page.click(f"#{button}")
    _note_says(page, to + 1)
    page.wait_for_function(PLACED_JS, arg=to + 1, timeout=WAIT_MS)


def _measure(page: Any, at: int) -> dict[str, Any]:
    """The boxes of the bar, the note, the page's buttons and its view, once two reads 300 ms apart agree (the
    charts below may still redraw; the page's own boxes stop moving)."""
    ids = ["lesson_bar", "scenario_note", *pressed(at), LESSON.look_at()[at]]
    boxes = page.evaluate(BOXES_JS, ids)
    for _ in range(20):
        page.wait_for_timeout(300)
        again = page.evaluate(BOXES_JS, ids)
        if again == boxes:
            return boxes
        boxes = again
    raise AssertionError(f"page {at + 1}: the boxes kept moving: {boxes}")


def _assert_together(boxes: dict[str, Any], at: int, how: str) -> list[str]:
    """Everything in the window, and the view not under the bar; returns the table's row."""
    where = f"page {at + 1} after {how}"
    bar = boxes["lesson_bar"]
    view = LESSON.look_at()[at]
    for id_, box in boxes.items():
        assert box is not None, f"{where}: #{id_} is not on the page"
        left, top, right, bottom = box
        assert left >= 0 and top >= 0 and right <= WIDTH and bottom <= HEIGHT, f"{where}: #{id_} at {box}: {boxes}"
    assert boxes[view][1] >= bar[3], f"{where}: #{view} starts under the lesson's bar: {boxes}"
    buttons = ", ".join(f"{b} {boxes[b][1]}–{boxes[b][3]}" for b in pressed(at))
    return [f"{at + 1}", how, f"{boxes['scenario_note'][1]}–{boxes['scenario_note'][3]}", buttons, view,
            f"{boxes[view][1]}–{boxes[view][3]}"]  # fmt: skip


def _badges(page: Any, n: int) -> list[str]:
    return [page.locator(f"#badge_{i}").inner_text() for i in range(n)]


@pytest.mark.browser
@pytest.mark.timeout(600)  # about 3 minutes on 2 busy cores, the app's start included
def test_browser_every_lesson_page_shows_its_note_buttons_and_view_together(app_url):
    rows: list[list[str]] = []
    with open_visitors(app_url, 1, viewport=(WIDTH, HEIGHT)) as (page,):
        sizes = page.evaluate(BOXES_JS, ["lesson_prev", "lesson_next", "run_btn"])
        for button in ("lesson_prev", "lesson_next"):
            height, run_height = sizes[button][3] - sizes[button][1], sizes["run_btn"][3] - sizes["run_btn"][1]
            assert height >= run_height and sizes[button][2] - sizes[button][0] >= 80, f"#{button}: {sizes}"
        rows.append(_assert_together(_measure(page, 0), 0, "page opened"))
        # step 1's run, on the page as it opened: its badges on screen without scrolling
        run_and_wait(page, 4)
        page.wait_for_function(
            "() => [0, 1, 2, 3].every(i => /tok\\/s/.test(document.getElementById(`badge_${i}`).innerText))"
        )
        badges = page.evaluate(BOXES_JS, [f"badge_{i}" for i in range(4)])
        assert all(b and b[1] >= 0 and b[3] <= HEIGHT for b in badges.values()), f"step 1's badges: {badges}"
        rows.append(["1", "its Run", "", "", "badge_0–3", f"{badges['badge_0'][1]}–{badges['badge_0'][3]}"])
        cached = sum(int(re.search(r"(\d+) cached", b).group(1)) for b in _badges(page, 4))
        # everything the run filled, and a replay of it, gone once the next page loads
        page.locator("#tokens_accordion").get_by_text("Prompt tokens").click()
        page.wait_for_function("() => document.querySelector('#tokens_0 [data-cause]')", timeout=WAIT_MS)
        page.click("#replay_back")
        page.wait_for_function("() => document.getElementById('replay_note').innerText.includes('Replay ·')")
        _go(page, "lesson_next", 1)
        page.wait_for_function(
            """() => {
              const map = document.querySelector('#page_map .js-plotly-plot')?.layout?.title?.text || '';
              return map.startsWith('Page map') && !map.includes('after step');
            }""",
            timeout=WAIT_MS,
        )
        assert _badges(page, 4) == [""] * 4, "the last run's badges stay"
        assert "finished" not in page.locator("#requests").inner_text(), "the last run's rows stay"
        assert not page.locator("#tokens_0 [data-cause]").count(), "the last run's token colouring stays"
        assert page.locator("#savings_note").inner_text().startswith("Run a batch"), "the last run's savings stay"
        assert "Replay" not in page.locator("#replay_note").inner_text(), "the replay stays"
        rows.append(_assert_together(_measure(page, 1), 1, "Lesson ▶"))
        # a run refused ("Panel 1 has an empty prompt") marks the first panel "Error"; the next page clears it
        page.fill("#prompt_0 textarea", "")
        page.click("#run_btn")
        page.wait_for_function(f"() => ({ERROR_MARKERS_JS})().includes('out_0')", timeout=WAIT_MS)
        # Lesson ▶ through every page, then ◀ Lesson back
        for at in range(2, LESSON.length):
            _go(page, "lesson_next", at)
            if at == 2:
                assert page.evaluate(ERROR_MARKERS_JS) == [], "an Error marker stays on the next page"
            rows.append(_assert_together(_measure(page, at), at, "Lesson ▶"))
        end = page.locator(f"#{LESSON.end.look_at}").inner_text()
        assert "your 1 run" in end and re.search(rf"\bcached\s+{cached:,}\s", end), end
        assert page.locator("#lesson_next").is_disabled() and page.locator("#lesson_restart").is_visible()
        for at in range(LESSON.length - 2, -1, -1):
            _go(page, "lesson_prev", at)
            rows.append(_assert_together(_measure(page, at), at, "◀ Lesson"))
        assert page.locator("#lesson_prev").is_disabled() and not page.locator("#lesson_restart").is_visible()
    header = ["page", "after", "note (top–bottom px)", "buttons", "view", "view (top–bottom px)"]
    (ARTIFACTS / "lesson_layout.json").write_text(json.dumps([header, *rows], ensure_ascii=False, indent=1))
    print("\n" + "\n".join(" | ".join(row) for row in [header, *rows]))
