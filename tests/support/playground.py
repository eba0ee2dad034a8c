"""The playground in process, without a browser: its engines, visitors, components and callbacks, driven by calling
the callbacks as Gradio would (a request is just its session hash)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import gradio as gr

from astrai.playground.backends.engines import LocalEngines
from astrai.playground.callbacks.context import Context
from astrai.playground.callbacks.ladder import LadderCallbacks
from astrai.playground.callbacks.live import LiveCallbacks
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.callbacks.replay import ReplayCallbacks
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.setup import SetupCallbacks
from astrai.playground.callbacks.sizing import SizingCallbacks
from astrai.playground.scenarios import Lesson
from astrai.playground.state import Visitors
from astrai.playground.ui.layout import build_layout


@dataclass
class Playground:
    ctx: Context
    runs: RunCallbacks
    live: LiveCallbacks
    replays: ReplayCallbacks
    setup: SetupCallbacks
    sizing: SizingCallbacks
    ladders: LadderCallbacks

    def fields(self, **changes: Any) -> dict[str, Any]:
        """The run form as the page opens, with ``changes``."""
        return {name: component.value for name, component in self.ctx.ui.run_fields().items()} | changes


def request(session: str) -> Any:
    return SimpleNamespace(session_hash=session)


def no_progress(*args: Any, **kwargs: Any) -> None:
    """A stand-in for ``gr.Progress`` outside a Gradio request."""


@contextlib.contextmanager
def playground(**engine_options: Any) -> Iterator[Playground]:
    engines = LocalEngines(**({"idle_retire_s": 3600, "compile": False} | engine_options))
    lesson = Lesson.for_deployment(routers=0)
    with gr.Blocks():
        ui = build_layout(engines.default, list(engines.model_choices()), engines.chooses_pools, lesson)
    ctx = Context(engines, Visitors(engines.default), ui, StreamingRuns(), lesson)
    runs = RunCallbacks(ctx)
    try:
        yield Playground(
            ctx,
            runs,
            LiveCallbacks(ctx, runs),
            ReplayCallbacks(ctx),
            SetupCallbacks(ctx, runs),
            SizingCallbacks(ctx),
            LadderCallbacks(ctx),
        )
    finally:
        engines.shutdown()
