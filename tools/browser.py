"""Headless Debian Chromium driven by Playwright, offline: shared by the browser tests and the UI measurements."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# No sandbox as root; no background networking, since this machine reaches nothing outside loopback.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


# How often a page's ``wait_for_function`` checks its condition. Playwright's default checks at each animation frame,
# and a headless page on two busy cores can go a minute without one: a run that had ended read as still running.
POLL_MS = 250


def poll_by_clock(page: Any) -> Any:
    """``page``, its ``wait_for_function`` checking every ``POLL_MS`` unless a call says otherwise."""
    page.wait_for_function = functools.partial(page.wait_for_function, polling=POLL_MS)
    return page


@contextlib.contextmanager
def open_visitors(
    url: str,
    count: int,
    timeout_ms: int = 60000,
    viewport: tuple[int, int] = (1400, 1000),
    prepare: Callable[[Any], None] | None = None,
) -> Iterator[list]:
    """``count`` pages showing the playground at ``url``, each in a browser context of its own (its own cookies,
    so its own Gradio session: another visitor), ready to click (the Run button is visible). ``prepare`` is called
    with each page before it opens the playground (to listen to its console, or add an init script)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pages = []
            for _ in range(count):
                context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
                context.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda route: route.abort())  # never stall
                page = poll_by_clock(context.new_page())
                if prepare is not None:
                    prepare(page)
                page.goto(url)
                page.wait_for_selector("#run_btn", state="visible", timeout=timeout_ms)
                pages.append(page)
            yield pages
        finally:
            browser.close()


@contextlib.contextmanager
def open_playground(url: str, timeout_ms: int = 60000, viewport: tuple[int, int] = (1400, 1000)) -> Iterator:
    """A page showing the playground at ``url``, ready to click (the Run button is visible)."""
    with open_visitors(url, 1, timeout_ms, viewport) as (page,):
        yield page


FINISHED_ROWS = "(document.querySelector('#requests').innerText.match(/finished/g) || []).length"


def run_and_wait(page: Any, panels: int, timeout_ms: int = 60000) -> None:
    """Click Run and wait until this run's ``panels`` rows of the request table say finished.

    A click empties the table before the run fills it again; until the emptying arrives, the last run's finished
    rows are still on the page, and a wait for them alone would return at once, while this run still streams. So the
    table must first be seen with fewer finished rows, then with all of them. A page's observer of its own DOM sees
    the emptying, however briefly it lasts (a small pool's run can refill the table between two polls), and a page
    drawn in the background may get no animation frames to poll on: it is polled by the clock."""
    page.evaluate(
        f"""() => {{
        window.astraiTableEmptied = false;
        const observer = new MutationObserver(() => {{
            if ({FINISHED_ROWS} < {panels}) {{ window.astraiTableEmptied = true; observer.disconnect(); }}
        }});
        observer.observe(document.body, {{childList: true, subtree: true, characterData: true}});
    }}"""
    )
    page.click("#run_btn")
    done = f"window.astraiTableEmptied && {FINISHED_ROWS} >= {panels}"
    page.wait_for_function(done, timeout=timeout_ms, polling=100)
