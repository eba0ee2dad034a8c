"""The lesson on paper and in README cannot drift from the page: both are what ``tools/handout.py`` writes now from
the lesson's definitions, every step has its question, and the handout prints on one page."""

from __future__ import annotations

import re
import shutil

import pytest

from astrai.playground.scenarios import Lesson
from astrai.playground.teaching import QUESTIONS
from tests.support.needs import NO_CHROMIUM
from tools import handout


def test_the_committed_handout_is_what_the_lesson_writes_now():
    assert handout.HANDOUT.read_text() == handout.handout_html(handout.lesson_steps()), (
        "docs/handout.html differs from the lesson's definitions: run python -m tools.handout"
    )


def test_readmes_step_list_is_what_the_lesson_writes_now():
    readme = handout.README.read_text()
    assert handout.readme_with_steps(readme, handout.lesson_steps()) == readme, (
        "README's list of the lesson's steps differs from the lesson's definitions: run python -m tools.handout"
    )
    for number, step in enumerate(handout.lesson_steps(), start=1):  # every step, in order, under its number
        assert f"\n{number}. **{step.title}**" in readme


def test_every_step_has_one_question_and_no_question_is_left_over():
    titles = [step.title for step in Lesson.for_deployment(routers=2).steps]  # a fleet's lesson: every step
    assert sorted(QUESTIONS) == sorted(titles), "astrai/playground/teaching.py: one question per step, by its title"


@pytest.mark.browser
@pytest.mark.parametrize("paper", ["A4", "Letter"])
def test_the_handout_prints_on_one_page(paper):
    if not shutil.which("chromium"):
        pytest.skip(NO_CHROMIUM)
    from playwright.sync_api import sync_playwright

    from tools.browser import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(handout.HANDOUT.as_uri())
            pdf = page.pdf(format=paper, prefer_css_page_size=False)
        finally:
            browser.close()
    pages = len(re.findall(rb"/Type\s*/Page\b", pdf))
    assert pages == 1, f"the handout prints on {pages} {paper} pages"
