"""Measure the playground in headless Chromium: ``python -m tools.measure --rounds 3 [--compare-to DIR]``.

The method, settled once (issue 11): the "Shared system prompt" scenario, 4 panels, 256 new tokens each, greedy,
charts on and off. A probe inside the page reads every output box once per animation frame and counts the
distinct values it sees; a panel's **visible updates per second** is (values − 1) / (time of its last change −
time of its first change), and a round reports the slowest panel. **Click to first token** is the time from the
click to the first non-empty output box. **Replay frame** is the time from a click on "◀ step" to the page map
showing the new step. ``--compare-to`` measures another checkout's app.py (an earlier version, say) in the same
run, round after round, so "before" and "after" share the machine's mood. ``--fleet`` attaches the app to a vLLM
fleet (the JSON its launcher printed), so the live view draws a page map and chart lines per replica.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from playwright.sync_api import Page

from tools.browser import open_playground
from tools.loadtest import APP, launch_app

PANELS = 4
PROBE = """
() => {
  const p = {frames: 0, changes: [0, 0, 0, 0], last: ['', '', '', ''], first: [null, null, null, null],
             end: [null, null, null, null], start: performance.now()};
  window.__probe = p;
  const tick = () => {
    p.frames += 1;
    const now = performance.now();
    for (let i = 0; i < 4; i++) {
      const v = document.querySelector(`#out_${i} textarea`).value;
      if (v !== p.last[i]) {
        p.changes[i] += 1; p.last[i] = v; p.end[i] = now;
        if (p.first[i] === null && v) p.first[i] = now;
      }
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}
"""


def prepare(page: Page, max_tokens: int) -> None:
    page.locator("#scenario input").click()
    page.get_by_role("option", name="Shared system prompt").click()
    page.wait_for_function("document.querySelector('#prompt_3 textarea').value.length > 0", timeout=60000)
    page.get_by_text("Sampling").first.click()
    box = page.locator("#max_tokens input[type=number]")
    box.fill(str(max_tokens))
    box.press("Enter")


def set_charts(page: Page, on: bool) -> None:
    toggle = page.locator("#live_charts input")
    if toggle.is_checked() != on:
        toggle.click()


def one_run(page: Page) -> dict:
    """One Run; returns click to first token, the slowest panel's visible updates per second, and frames/s."""
    for i in range(PANELS):  # clear the boxes so the probe sees the new run from its start
        page.evaluate(f"document.querySelector('#out_{i} textarea').value = ''")
    page.evaluate(PROBE)
    note = page.locator("#replay_note").inner_text()  # narrates the last step of a run once the run has ended
    clicked = page.evaluate("performance.now()")
    page.click("#run_btn")
    page.wait_for_function(
        f"document.querySelector('#replay_note').innerText !== {note!r} && "
        "(document.querySelector('#requests').innerText.match(/finished/g) || []).length >= 4",
        timeout=180000,
    )
    page.wait_for_timeout(500)
    probe = page.evaluate("window.__probe")
    rates = [
        (probe["changes"][i] - 1) / ((probe["end"][i] - probe["first"][i]) / 1000)
        for i in range(PANELS)
        if probe["first"][i] is not None and probe["end"][i] > probe["first"][i]
    ]
    seconds = (page.evaluate("performance.now()") - clicked) / 1000
    return dict(
        click_to_first_token_ms=min(f for f in probe["first"] if f is not None) - clicked,
        updates_per_s=min(rates) if rates else 0.0,
        fps=probe["frames"] / seconds,
    )


def replay_frame_ms(page: Page) -> float | None:
    """From a click on '◀ step' to the page map titled with another step (None where there is no replay)."""
    if not page.locator("#replay_back").count():
        return None
    before = page.evaluate("document.querySelector('#page_map .js-plotly-plot').layout.title.text")
    started = page.evaluate("performance.now()")
    page.click("#replay_back")
    page.wait_for_function(
        f"document.querySelector('#page_map .js-plotly-plot').layout.title.text !== {before!r}", timeout=30000
    )
    return page.evaluate("performance.now()") - started


def summary(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--compare-to", type=Path, help="another checkout whose app.py to measure alongside")
    parser.add_argument(
        "--fleet", type=Path, help="the JSON `scripts/serve_vllm.py --replicas N --router ... --wait` printed: attach"
    )
    args = parser.parse_args()
    attach = json.loads(args.fleet.read_text().strip().splitlines()[-1])["app"][2:] if args.fleet else None
    apps = {"this checkout": APP}
    if args.compare_to:
        apps = {f"{args.compare_to}": args.compare_to / "app.py", **apps}
    results: dict[tuple[str, str], list[dict]] = {}
    replay: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, app in apps.items():
            with launch_app(app=app, args=attach) as url, open_playground(url, viewport=(1366, 768)) as page:
                prepare(page, args.max_tokens)
                for charts in ("on", "off"):
                    set_charts(page, charts == "on")
                    results.setdefault((name, charts), []).append(one_run(page))
                frame = replay_frame_ms(page)
                if frame is not None:
                    replay.setdefault(name, []).append(frame)
    print("| app | charts | rounds | click to first token ms | slowest panel updates/s | frames/s |")
    print("|---|---|---|---|---|---|")
    for (name, charts), runs in results.items():
        print(
            f"| {name} | {charts} | {len(runs)} | {summary([r['click_to_first_token_ms'] for r in runs])} | "
            f"{summary([r['updates_per_s'] for r in runs])} | {summary([r['fps'] for r in runs])} |"
        )
    for name, frames in replay.items():
        print(f"replay frame ms ({name}), min / median / max: {summary(frames)}")


if __name__ == "__main__":
    main()
