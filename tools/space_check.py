"""What a Space's first visitor checks: the page answers, a Run streams its four panels, and the cache charts draw.

    python -m tools.space_check http://127.0.0.1:7860/ [--timeout 120]

Headless Debian Chromium (``tools.browser``), so the figures are the page's as a browser draws them, not an API's.
Exit 0 with one line per check; exit 1 naming the check that failed. ``scripts/space_rehearsal.sh`` runs it against
the app it started as a Space's builder would.
"""

from __future__ import annotations

import argparse
import sys
import time

from tools.browser import open_playground

PANELS = 4
# Every panel's text, read in one go: a panel "streams" when its text grows between two reads while it runs.
TEXTS_JS = f"[...Array({PANELS}).keys()].map(i => document.querySelector(`#out_${{i}} textarea`)?.value || '')"


def check(url: str, timeout_s: float) -> list[str]:
    """The checks' lines, in order; raises ``AssertionError`` naming the first that failed."""
    lines = []
    started = time.monotonic()
    with open_playground(url, timeout_ms=int(timeout_s * 1000)) as page:
        lines.append(f"the page answered and shows Run after {time.monotonic() - started:.1f} s")
        visible = [page.locator(f"#out_{i}").is_visible() for i in range(PANELS)]
        assert all(visible), f"the page shows {sum(visible)} output panels, not {PANELS}"
        page.click("#run_btn")
        pressed = time.monotonic()
        page.wait_for_function(f"{TEXTS_JS}.some(t => t.length > 0)", timeout=timeout_s * 1000)
        lines.append(f"the first text arrived {time.monotonic() - pressed:.2f} s after Run")
        grew: set[int] = set()
        last = page.evaluate(TEXTS_JS)
        deadline = time.monotonic() + timeout_s
        while len(grew) < PANELS and time.monotonic() < deadline:
            time.sleep(0.05)
            now = page.evaluate(TEXTS_JS)
            grew |= {i for i in range(PANELS) if len(now[i]) > len(last[i]) and last[i]}
            done = all(len(t) > 0 for t in now) and now == last and "TTFT" in page.locator("#badge_0").inner_text()
            last = now
            if done:
                break
        lengths = [len(t) for t in last]
        assert all(n > 0 for n in lengths), f"panels' text lengths {lengths}: not every panel received text"
        # a fast machine may finish a panel between two reads: growth is reported, the text in every panel is checked
        lines.append(f"all {PANELS} panels received text, {lengths} characters ({len(grew)} seen growing)")
        for chart in ("#plot_0 .js-plotly-plot", "#page_map .js-plotly-plot .heatmaplayer"):
            page.wait_for_selector(chart, state="attached", timeout=timeout_s * 1000)
        traces = page.evaluate(
            "[...document.querySelectorAll('.js-plotly-plot')]"
            ".map(p => (p.data || []).length).reduce((a, b) => a + b, 0)"
        )
        assert traces > 0, "the cache charts drew no traces"
        lines.append(f"the cache charts drew ({traces} traces), the page map too")
        stats = page.locator("#stats").inner_text()
        assert "Now:" in stats, f"the stats line reads {stats!r}"
        lines.append(f"stats line: {' '.join(stats.split())[:160]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each check may take")
    args = parser.parse_args()
    try:
        for line in check(args.url, args.timeout):
            print(f"[space_check] {line}", flush=True)
    except Exception as exc:  # an assertion, or Playwright's timeout waiting for what a visitor waits for
        print(f"[space_check] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
