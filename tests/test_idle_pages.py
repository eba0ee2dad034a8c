"""An open page with nothing changing costs the app almost nothing: its live view's timer, driven as the page drives
it (the next tick only once the last one answered, ``trigger_mode="once"``), reads nothing of the engine while
idle, yet draws a change within about a second (``callbacks/live.py``; the cost itself: ``tools/idle_cost.py``)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pytest

from astrai.playground.backends.engines import LocalEngines
from astrai.playground.callbacks import live
from astrai.playground.callbacks.context import Context
from astrai.playground.callbacks.live import LiveCallbacks
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.scenarios import Lesson
from astrai.playground.state import Visitors
from astrai.playground.ui.components import Components
from astrai.playground.ui.layout import REFRESH_SECONDS, build_layout
from tests.support.playground import Playground, request

IDLE_S = 5.0  # watched while nothing changes: five ticks of a 1 Hz poll


class Wired:
    """The playground's live view wired into Blocks as the app wires it; ``tick`` is the timer's tick function."""

    def __init__(self, engines: LocalEngines):
        lesson = Lesson.for_deployment(routers=0)
        with gr.Blocks() as demo:
            self.ui: Components = build_layout(engines.default, list(engines.model_choices()), True, lesson)
            self.ctx = Context(engines, Visitors(engines.default), self.ui, StreamingRuns(), lesson)
            self.runs = RunCallbacks(self.ctx)
            LiveCallbacks(self.ctx, self.runs).wire(demo)
        timer = self.ui.cache.timer._id
        (self.tick,) = [f.fn for f in demo.fns.values() if any(t[0] == timer for t in f.targets)]
        self.pg = Playground(self.ctx, self.runs, None, None, None, None, None)  # type: ignore[arg-type]

    async def call(self, cursor: Any, session: str) -> dict:
        if inspect.iscoroutinefunction(self.tick):
            return await self.tick(cursor, request(session))
        return await asyncio.to_thread(self.tick, cursor, request(session))


@pytest.fixture(scope="module")
def wired() -> Iterator[Wired]:
    engines = LocalEngines(idle_retire_s=3600, compile=False)
    try:
        yield Wired(engines)
    finally:
        engines.shutdown()


class Reads:
    """Counts the calls of a backend's reads that build a view (stats, snapshot, events, history)."""

    NAMES = ("stats", "snapshot", "events", "history")

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        self._lock = threading.Lock()
        for name in self.NAMES:
            monkeypatch.setattr(backend, name, self._counted(getattr(backend, name)))

    def _counted(self, read: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.count += 1
            return read(*args, **kwargs)

        return counted


async def _settled(wired: Wired, session: str) -> Any:
    """A fresh page's timer run until its live view has drawn everything and found nothing moving (the cursor
    settled: a fresh page draws, and the tick after it redraws all once nothing moved)."""
    cursor = None
    for _ in range(30):
        cursor, _ = await _page(wired, session, 0.5, cursor)
        if cursor is not None and cursor.settled:
            return cursor
    raise AssertionError(f"the live view never settled: {cursor}")


async def _page(wired: Wired, session: str, seconds: float, cursor: Any = None) -> tuple[Any, list[tuple[float, dict]]]:
    """A page's timer for ``seconds``: a tick each ``REFRESH_SECONDS``, none sent while the last is pending."""
    answers: list[tuple[float, dict]] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sent = time.monotonic()
        update = await wired.call(cursor, session)
        answers.append((time.monotonic(), update))
        cursor = update.get(wired.ui.cache.cursor, cursor)
        await asyncio.sleep(max(0.0, REFRESH_SECONDS - (time.monotonic() - sent)))
    return cursor, answers


def test_an_idle_page_reads_nothing_of_its_engine_each_second(wired, monkeypatch):
    """Once settled, an open page on a quiet engine builds no view, tick after tick: the 1 Hz poll read the stats
    and the events (and built the stats line) every second, 2.6% of a core per open page."""
    monkeypatch.setattr(live, "IDLE_WAIT_S", 2.0, raising=False)  # waits that end with nothing new, in the span
    backend = wired.ctx.engines.ensure(wired.ctx.engines.default)
    cursor = asyncio.run(_settled(wired, "idle"))
    reads = Reads(backend, monkeypatch)
    _, answers = asyncio.run(asyncio.wait_for(_page(wired, "idle", IDLE_S, cursor), IDLE_S + 30))
    assert reads.count <= 1, f"{reads.count} reads of the engine in {IDLE_S:.0f} s of an idle page"
    assert all(update for _, update in answers), "an answer names an output (Gradio refuses an empty dict)"


def test_a_run_by_another_visitor_is_drawn_within_about_a_second(wired):
    """The waiting tick answers as soon as the engine steps: another visitor's run on the same engine reaches an
    idle page's page map within a look (``CHECK_EVERY_S``) and a draw of its first step; 2 s leaves the draw room
    on a loaded machine, and a tick that waited out ``IDLE_WAIT_S`` instead fails it."""
    backend = wired.ctx.engines.ensure(wired.ctx.engines.default)

    async def scenario() -> float:
        cursor = await _settled(wired, "watcher")
        waiting = asyncio.create_task(wired.call(cursor, "watcher"))
        await asyncio.sleep(1.0)
        assert not waiting.done(), "control: nothing changed, so the tick waits"
        steps = backend.steps
        ran = asyncio.to_thread(lambda: [None for _ in wired.runs.run(wired.pg.fields(max_tokens=4), request("b"))])
        runner = asyncio.create_task(ran)
        while backend.steps == steps:
            await asyncio.sleep(0.01)
        stepped = time.monotonic()
        update = await asyncio.wait_for(waiting, 10)
        latency = time.monotonic() - stepped
        await runner
        assert wired.ui.cache.page_map in update, "the change was drawn"
        return latency

    assert asyncio.run(scenario()) < 2.0
