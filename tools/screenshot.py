"""Screenshots of the running app in headless Chromium, as README shows it and as a teacher projects it.

    python -m tools.screenshot                       # README's image: assets/playground.png
    python -m tools.screenshot --teacher --steps 1,3,6,8,9 --out-dir docs
                                                     # the teacher's page in presenter mode: docs/teacher-step-N.png

It starts this checkout's app.py on loopback (``--url`` uses a running one instead; ``--teacher`` then needs its
``ASTRAI_TEACHER_KEY`` in the environment), opens it at 1366×768, and at each step does what the step's note says
(``promises.presses``: Run, Run twice, Follow-up turn, Compare) and waits for the run to end before it takes the
picture. README's image is step 1 after its Run, as a visitor sees it; a teacher's are scrolled to the view each step
points at, the class panel folded away, as a teacher projects them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astrai.playground import promises
from astrai.playground.scenarios import SCENARIO_BY_NAME, Lesson, LessonStep
from tools.browser import open_visitors, run_and_wait
from tools.loadtest import launch_app

ROOT = Path(__file__).resolve().parents[1]
README_IMAGE = ROOT / "assets" / "playground.png"
VIEWPORT = (1366, 768)
WAIT_MS = 120_000
SCROLL_TO_JS = (  # presenter mode makes scrollIntoView a no-op: scroll the window itself, the view just below the
    # lesson bar pinned at the top
    "(id) => { const e = id && document.getElementById(id);"
    " const bar = document.getElementById('lesson_bar');"
    " const pinned = bar ? bar.getBoundingClientRect().height : 0;"
    " window.scrollTo(0, e ? e.getBoundingClientRect().top + window.scrollY - pinned - 8 : 0); }"
)
SAVINGS_DRAWN = (
    "(() => { const p = document.querySelector('#savings .js-plotly-plot');"
    " return p && p.data.filter(t => t.name === 'caching off').length > 0; })()"
)


@contextlib.contextmanager
def app_url(url: str | None, key: str | None) -> Iterator[str]:
    """``url`` as it is, or this checkout's app started for the block (with ``key`` as its teacher's key)."""
    if url:
        yield url
        return
    with launch_app({"ASTRAI_TEACHER_KEY": key} if key else None) as started:
        yield started


def show_step(page: Any, steps: tuple[LessonStep, ...], number: int) -> None:
    """Lesson ▶ until the note says step ``number`` (steps go forward only; the page opens on the first)."""
    if not 1 <= number <= len(steps):
        raise ValueError(f"the lesson has steps 1 to {len(steps)}, not {number}")
    found = re.search(r"Lesson (\d+)/", page.locator("#scenario_note").inner_text())
    if found is None:
        raise RuntimeError("the note names no lesson step")
    shown = int(found.group(1))
    if shown > number:
        raise ValueError(f"the page is on step {shown}, past step {number}")
    for following in range(shown + 1, number + 1):
        page.evaluate("document.getElementById('lesson_next').click()")  # a script's click scrolls nothing
        page.wait_for_function(
            f"document.querySelector('#scenario_note').innerText.includes('Lesson {following}/')",
            timeout=WAIT_MS,
            polling=250,
        )


def do_step(page: Any, step: LessonStep) -> str:
    """Press what the step's note says, each run waited for to the end; the id of the view that shows the result
    (the step's own, or the table of Replay my requests)."""
    scenario = SCENARIO_BY_NAME[step.scenario]
    look_at = step.look_at
    for button in promises.presses(step):
        if button == "run":
            run_and_wait(page, len(scenario.prompts), timeout_ms=WAIT_MS)
        elif button == "follow_up":
            page.click("#follow_btn")
            page.wait_for_timeout(500)
        elif button == "compare":
            page.click("#compare_btn")
            page.wait_for_function(SAVINGS_DRAWN, timeout=WAIT_MS, polling=250)
        elif button == "replay_mine":  # its answer starts "N blocks", N the visitor's pool
            page.wait_for_selector("#sizing_mine:not([disabled])", timeout=WAIT_MS)
            page.click("#sizing_mine")
            answered = "n => (document.getElementById('sizing_note')?.innerText || '').startsWith(`${n} blocks`)"
            page.wait_for_function(answered, arg=scenario.profile.settings.n_pages, timeout=WAIT_MS, polling=250)
            look_at = "sizing_mine"
    page.wait_for_timeout(2500)  # the live view's next ticks: the charts drawn up to the run's end
    return look_at


def capture(url: str, shots: dict[int, Path], teacher_key: str | None) -> None:
    """Each ``{step number: path}``, in order, on one page: a visitor's, at the top of the page, or the teacher's in
    presenter mode, its class panel folded away and the page scrolled to the view the step points at (as the
    teacher projects it: the note is pinned below)."""
    steps = Lesson.for_deployment(routers=0).steps
    with open_visitors(url, 1, timeout_ms=WAIT_MS, viewport=VIEWPORT) as (page,):
        if teacher_key:
            page.goto(f"{url}?teacher={teacher_key}")
            page.wait_for_selector("#teacher_view", state="visible", timeout=WAIT_MS)
            page.wait_for_selector("#astrai_presenter", state="attached", timeout=WAIT_MS)
            page.locator("#teacher_view").get_by_text("Teacher's view").first.click()  # folded
        for number, path in sorted(shots.items()):
            show_step(page, steps, number)
            look_at = do_step(page, steps[number - 1])
            page.evaluate(SCROLL_TO_JS, look_at if teacher_key else None)
            path.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(path))
            print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running app (default: start this checkout's app.py on loopback)")
    parser.add_argument("--teacher", action="store_true", help="the teacher's page, in presenter mode")
    parser.add_argument("--steps", default="1", help="lesson step numbers, comma-separated (default: 1)")
    parser.add_argument("--out", type=Path, default=README_IMAGE, help="the image of a single step")
    parser.add_argument("--out-dir", type=Path, help="one image per step, NAME-step-N.png in this folder")
    args = parser.parse_args(argv)
    numbers = [int(n) for n in args.steps.split(",")]
    prefix = "teacher" if args.teacher else "visitor"
    if args.out_dir is not None:
        shots = {n: args.out_dir / f"{prefix}-step-{n}.png" for n in numbers}
    elif len(numbers) == 1:
        shots = {numbers[0]: args.out}
    else:
        parser.error("several steps need --out-dir")
    key = None
    if args.teacher:
        key = os.environ.get("ASTRAI_TEACHER_KEY") if args.url else secrets.token_urlsafe(16)
        if not key:
            parser.error("--teacher with --url needs the app's ASTRAI_TEACHER_KEY in the environment")
    with app_url(args.url, key) as url:
        capture(url, shots, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
