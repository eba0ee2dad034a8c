"""What idle open pages cost the app: ``python -m tools.idle_cost --pages 30 --rounds 3 [--compare-to DIR]``.

Each round starts the app, opens ``--pages`` headless Chromium pages (each its own visitor, ``tools/browser.py``),
lets them settle (their first drawings done), then reads the app process's CPU time (``utime + stime`` of
``/proc/PID/stat``, every thread) over ``--seconds``: once with every page visible, once with every page's tab
hidden (emulated: ``document.visibilityState`` overridden and ``visibilitychange`` dispatched, as a browser does when
a tab goes to the background; a real hidden tab also has its timers throttled by the browser, which the emulation
does not do, so the hidden figure is an upper bound). The same span with no page open is the app's own idle cost,
subtracted: a page's cost is (CPU with the pages − CPU without) / pages, in % of one core. ``--compare-to``
measures another checkout's app.py in the same rounds (an export of an earlier commit, say), so "before" and
"after" share the machine's mood. Nobody presses anything: every page is idle throughout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from tools.browser import open_visitors
from tools.loadtest import APP, cpu_description, start_app


def visibility_js(hidden: bool) -> str:
    """A script that makes the page's tab look hidden (or shown again) to the page, as a browser tells it."""
    state = "hidden" if hidden else "visible"
    return f"""
() => {{
  Object.defineProperty(document, 'visibilityState', {{value: '{state}', configurable: true}});
  Object.defineProperty(document, 'hidden', {{value: {str(hidden).lower()}, configurable: true}});
  document.dispatchEvent(new Event('visibilitychange'));
}}
"""


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, in seconds (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def core_percent(pid: int, seconds: float) -> float:
    """The process's CPU over the next ``seconds``, in % of one core."""
    start, wall = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_seconds(pid) - start) / (time.monotonic() - wall)


def one_round(app: Path, pages: int, seconds: float, settle: float) -> dict[str, float]:
    """% of one core: the app alone, then per page with ``pages`` visible pages, then per page with them hidden."""
    with start_app(app=app) as launched:
        time.sleep(settle)
        alone = core_percent(launched.pid, seconds)
        with open_visitors(launched.url, pages, timeout_ms=120000) as opened:
            time.sleep(settle)
            visible = core_percent(launched.pid, seconds)
            for page in opened:
                page.evaluate(visibility_js(hidden=True))
            time.sleep(settle)
            hidden = core_percent(launched.pid, seconds)
    return {"alone": alone, "visible": (visible - alone) / pages, "hidden": (hidden - alone) / pages}


def summary(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0, help="each measured span")
    parser.add_argument("--settle", type=float, default=15.0, help="wait before each span")
    parser.add_argument("--compare-to", type=Path, help="another checkout whose app.py to measure alongside")
    args = parser.parse_args()
    if args.pages < 1 or args.rounds < 1 or args.seconds <= 0:
        parser.error("--pages and --rounds must be at least 1, --seconds above 0")
    apps = {"this checkout": APP}
    if args.compare_to:
        apps = {str(args.compare_to): args.compare_to / "app.py", **apps}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in apps}
    for _ in range(args.rounds):
        for name, app in apps.items():
            results[name].append(one_round(app, args.pages, args.seconds, args.settle))
            print(name, results[name][-1], flush=True)
    print(f"CPU: {cpu_description()}; {args.pages} idle pages, {args.seconds:.0f} s spans, {args.rounds} rounds")
    print("| app | app alone, % of a core | per visible page, % of a core | per hidden page, % of a core |")
    print("|---|---|---|---|")
    for name, rounds in results.items():
        print(
            f"| {name} | {summary([r['alone'] for r in rounds])} | {summary([r['visible'] for r in rounds])} | "
            f"{summary([r['hidden'] for r in rounds])} |"
        )
    print("(min / median / max over rounds)")


if __name__ == "__main__":
    main()
