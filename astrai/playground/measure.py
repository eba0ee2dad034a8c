"""Measure the playground in headless Chromium: `python -m astrai.playground.measure`.

Prints: page load to interactive, click to first token visible, visible updates per second per panel (4 panels),
and the cost of the live charts (frames per second and text updates per second with the Timer on vs off).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from playwright.sync_api import Page, sync_playwright

from astrai.playground.loadtest import launch_app

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
# Counts animation frames and distinct visible texts of each output box, from inside the page.
PROBE = """
() => {
  window.__probe = {frames: 0, changes: [0, 0, 0, 0], last: ['', '', '', ''], first: null, start: performance.now()};
  const tick = () => {
    const p = window.__probe;
    p.frames += 1;
    for (let i = 0; i < 4; i++) {
      const v = document.querySelector(`#out_${i} textarea`).value;
      if (v !== p.last[i]) { p.changes[i] += 1; p.last[i] = v; if (p.first === null && v) p.first = performance.now(); }
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}
"""


def pick_scenario(page: Page) -> None:
    page.locator("#scenario input").click()
    page.get_by_role("option", name="Shared system prompt").click()
    page.wait_for_function("document.querySelector('#prompt_3 textarea').value.length > 0", timeout=30000)


def one_run(page: Page) -> dict:
    """One Run of the shared-prefix scenario (4 panels, 64 new tokens each)."""
    for i in range(4):  # clear the boxes so the probe sees the new run from its start
        page.evaluate(f"document.querySelector('#out_{i} textarea').value = ''")
    page.evaluate(PROBE)
    clicked = page.evaluate("performance.now()")
    page.click("#run_btn")
    page.wait_for_function("window.__probe.first !== null", timeout=60000)
    first = page.evaluate("window.__probe.first") - clicked
    page.wait_for_function(
        "(document.querySelector('#requests').innerText.match(/finished/g) || []).length >= 4", timeout=120000
    )
    probe = page.evaluate("window.__probe")
    seconds = (page.evaluate("performance.now()") - clicked) / 1000
    return dict(
        click_to_first_token_ms=round(first),
        seconds=round(seconds, 2),
        updates_per_s_per_panel=round(statistics.mean(probe["changes"]) / seconds, 1),
        fps=round(probe["frames"] / seconds, 1),
    )


def idle_fps(page: Page, seconds: float = 4.0) -> float:
    page.evaluate(PROBE)
    time.sleep(seconds)
    return round(page.evaluate("window.__probe.frames") / seconds, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with launch_app() as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.route(re.compile(r"^https?://(?!127\.0\.0\.1)"), lambda route: route.abort())
        page = context.new_page()
        started = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("#run_btn", state="visible", timeout=60000)
        interactive = time.perf_counter() - started
        page.wait_for_selector("#plot_3 .js-plotly-plot", timeout=60000)
        charts = time.perf_counter() - started
        print(
            f"page load to interactive (Run visible): {interactive * 1000:.0f} ms; charts drawn: {charts * 1000:.0f} ms"
        )
        pick_scenario(page)
        for live in (True, False):
            if page.locator("#live_charts input").is_checked() != live:
                page.locator("#live_charts input").click()
            runs = [one_run(page) for _ in range(args.runs)]
            print(f"charts {'on ' if live else 'off'}: idle fps {idle_fps(page)}; runs: {runs}")
        browser.close()


if __name__ == "__main__":
    main()
