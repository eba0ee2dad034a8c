"""The Blocks: the layout, then each callbacks module wiring its own events."""

from __future__ import annotations

import gradio as gr

from astrai.playground import knobs
from astrai.playground.backends.protocol import Engines
from astrai.playground.callbacks.context import Context
from astrai.playground.callbacks.live import LiveCallbacks
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.callbacks.replay import ReplayCallbacks
from astrai.playground.callbacks.routing import RoutingCallbacks
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.setup import SetupCallbacks
from astrai.playground.callbacks.sizing import SizingCallbacks
from astrai.playground.scenarios import Lesson
from astrai.playground.state import Visitors
from astrai.playground.ui.layout import build_layout


def build_demo(engines: Engines) -> gr.Blocks:
    with gr.Blocks(title="AstrAI playground: see the KV cache", analytics_enabled=False) as demo:
        choices = list(engines.model_choices())
        default = engines.backend(engines.default)
        lesson = Lesson.for_deployment(len(default.routers) if default is not None else 0)
        ui = build_layout(engines.default, choices, engines.chooses_pools, lesson)
        ctx = Context(engines, Visitors(engines.default), ui, StreamingRuns(), lesson)
        runs = RunCallbacks(ctx)
        runs.wire()
        LiveCallbacks(ctx, runs).wire(demo)
        ReplayCallbacks(ctx).wire()
        SetupCallbacks(ctx, runs).wire(demo)
        RoutingCallbacks(ctx, runs).wire()
        SizingCallbacks(ctx).wire(demo)
    demo.queue(max_size=knobs.QUEUE_SIZE, default_concurrency_limit=2)
    return demo
