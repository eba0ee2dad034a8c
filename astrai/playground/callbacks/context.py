"""What every callback module shares: the engines, the visitors, the components, and who is asking."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import gradio as gr
from gradio.blocks import Block
from gradio.components import Component

from astrai.observation import RequestInfo
from astrai.playground.backends.protocol import Backend, Engines, Served
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.classroom import Classroom
from astrai.playground.scenarios import Lesson
from astrai.playground.state import ShownRun, Visitors
from astrai.playground.ui.components import Components


# Events that show no progress also register none: Gradio's front end refreshes, at every status message of every
# event (each streamed text message among them), the loading status of every component any event has shown progress
# on, cloning its props. Left on all outputs, up to 56 components a message (tests/test_app.py keeps it at 5).
class Quiet(TypedDict):
    show_progress: Literal["full", "minimal", "hidden"]
    show_progress_on: list[Component]


QUIET: Quiet = {"show_progress": "hidden", "show_progress_on": []}
Update = dict[Block, Any]  # what a callback returns: values (or component updates) keyed by component (or layout)
SERVED_WAIT_S = 3.0  # how long a finished run waits for the replicas' KV events to name its requests' replica


@dataclass(frozen=True)
class Context:
    engines: Engines
    visitors: Visitors
    ui: Components
    runs: StreamingRuns
    lesson: Lesson  # the scenarios and guided steps this deployment offers
    classroom: Classroom = field(default_factory=Classroom)  # where the class is, for a teacher's view (if any)


def session_of(request: gr.Request) -> str:
    return request.session_hash or "anonymous"


def panel_label(panel: int) -> str:
    return f"panel {panel + 1}"


def run_infos(backend: Backend | None, shown: ShownRun) -> list[RequestInfo | None]:
    """One entry per panel of the run, None where its engine no longer knows the request (retired, or forgotten)."""
    if backend is None:
        return [None] * len(shown.request_ids)
    by_id = {info.id: info for info in backend.request_info(list(shown.request_ids))}
    return [by_id.get(rid) for rid in shown.request_ids]


def served_once_named(backend: Backend, request_ids: list[int]) -> dict[int, Served]:
    """Which replica served each finished request, waiting up to ``SERVED_WAIT_S`` for the events that name it.

    A replica's KV events trail its stream: the last blocks' event can reach the app after the stream ended, so
    read at once a badge said "not seen yet" forever. Not waited for: a request that failed (a dead replica's
    events never come), one that filled no block (its KV, every token but the last, is under a page: it stored
    nothing to name it by), and anything on a single server (``served_by`` is empty there).
    """
    if not backend.replicas:
        return {}
    size = backend.stats().page_size or 0
    infos = backend.request_info(request_ids)
    unnamed = {i.id for i in infos if i.error or i.prompt_tokens + i.generated_tokens <= size}
    deadline = time.monotonic() + SERVED_WAIT_S
    served = backend.served_by(request_ids)
    while any(r not in served and r not in unnamed for r in request_ids) and time.monotonic() < deadline:
        time.sleep(0.1)
        served = backend.served_by(request_ids)
    return served
