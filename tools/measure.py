"""Measure the playground in headless Chromium: `python -m tools.measure`.

Prints: page load to interactive, click to first token visible, visible updates per second per panel (4 panels),
and the cost of the live charts (frames per second and text updates per second with the Timer on vs off).
"""

from __future__ import annotations

import argparse
import statistics
import time

from playwright.sync_api import Page

from tools.browser import open_playground
from tools.loadtest import launch_app

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
    with launch_app() as url:
        started = time.perf_counter()
        with open_playground(url) as page:
            interactive = time.perf_counter() - started
            page.wait_for_selector("#plot_3 .js-plotly-plot", timeout=60000)
            charts = time.perf_counter() - started
            print(
                f"page load to interactive (Run visible): {interactive * 1000:.0f} ms; "
                f"charts drawn: {charts * 1000:.0f} ms"
            )
            measure_runs(page, args.runs)


def measure_runs(page: Page, runs: int) -> None:
    """Click-to-token, update rate and frame rate for ``runs`` runs with the live charts on, then off."""
    pick_scenario(page)
    for live in (True, False):
        if page.locator("#live_charts input").is_checked() != live:
            page.locator("#live_charts input").click()
        results = [one_run(page) for _ in range(runs)]
        print(f"charts {'on ' if live else 'off'}: idle fps {idle_fps(page)}; runs: {results}")


if __name__ == "__main__":
    main()
