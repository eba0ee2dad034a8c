"""The Blocks: the layout, then each callbacks module wiring its own events."""

from __future__ import annotations

import gradio as gr

from astrai.playground import knobs
from astrai.playground.backends.protocol import Engines
from astrai.playground.callbacks.context import Context
from astrai.playground.callbacks.ladder import LadderCallbacks
from astrai.playground.callbacks.live import LiveCallbacks
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.callbacks.replay import ReplayCallbacks
from astrai.playground.callbacks.routing import RoutingCallbacks
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.setup import SetupCallbacks
from astrai.playground.callbacks.sizing import SizingCallbacks
from astrai.playground.callbacks.teacher import TeacherCallbacks
from astrai.playground.scenarios import Lesson
from astrai.playground.state import Visitors
from astrai.playground.ui.layout import PAGE_CSS, build_layout
from astrai.playground.ui.teacher import build_banner, build_teacher_views
from astrai.playground.views import charts


def launch_options() -> dict[str, object]:
    """What ``Blocks.launch`` takes from the playground: the page's CSS (Gradio 6 takes it at launch), and as many
    sessions kept as the app keeps visitors (``knobs.SESSIONS``: Gradio's default, 10,000, grew a Space by its
    visitors).

    And no check that localhost answers (``_frontend=False``): Gradio's (``networking.url_ok``) sends one HEAD with
    a 3 s timeout and, on a timeout, ends the app with "When localhost is not accessible, a shareable link must be
    created" (gradio-app/gradio#8671). The page's first render takes longer than that on 2 busy cores (the start's
    background compile, a test suite beside it): the app exited at its start. Nothing else depends on the check; a
    server that does not answer shows as one anyway."""
    return {"css": PAGE_CSS, "state_session_capacity": knobs.SESSIONS, "_frontend": False}


def build_demo(engines: Engines, teacher_key: str | None = knobs.TEACHER_KEY) -> gr.Blocks:
    """The page; with ``teacher_key`` (the operator's ``ASTRAI_TEACHER_KEY``), a teacher's view at its top that
    the key opens, and the banner that moves the class. Without one, neither exists."""
    charts.import_plotly_classes()  # before any visitor's thread builds a figure
    with gr.Blocks(title="AstrAI playground: see the KV cache", analytics_enabled=False) as demo:
        choices = list(engines.model_choices())
        default = engines.backend(engines.default)
        lesson = Lesson.for_deployment(len(default.routers) if default is not None else 0)
        teaching = (build_teacher_views(lesson), build_banner()) if teacher_key else None
        ui = build_layout(engines.default, choices, engines.chooses_pools, lesson)
        ctx = Context(engines, Visitors(engines.default), ui, StreamingRuns(), lesson)
        teacher = TeacherCallbacks(ctx, teacher_key, *teaching) if teacher_key and teaching else None
        runs = RunCallbacks(ctx)
        runs.wire()
        LiveCallbacks(ctx, runs, teacher).wire(demo)
        if teacher is not None:
            teacher.wire(demo)
        ReplayCallbacks(ctx).wire()
        SetupCallbacks(ctx, runs).wire(demo)
        RoutingCallbacks(ctx, runs).wire()
        SizingCallbacks(ctx).wire(demo)
        LadderCallbacks(ctx).wire()
    demo.queue(max_size=knobs.QUEUE_SIZE, default_concurrency_limit=2)
    return demo
