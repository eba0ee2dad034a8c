"""What every callback module shares: the engines, the visitors, the components, and who is asking."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from astrai.observation import RequestInfo
from astrai.playground.backends.protocol import Backend, Engines
from astrai.playground.callbacks.pacing import StreamingRuns
from astrai.playground.scenarios import Lesson
from astrai.playground.state import ShownRun, Visitors
from astrai.playground.ui.components import Components

# Events that show no progress also register none: Gradio's front end refreshes, at every status message of every
# event (each streamed text message among them), the loading status of every component any event has shown progress
# on, cloning its props. Left on all outputs, up to 56 components a message (tests/test_app.py keeps it at 3).
QUIET = {"show_progress": "hidden", "show_progress_on": []}


@dataclass(frozen=True)
class Context:
    engines: Engines
    visitors: Visitors
    ui: Components
    runs: StreamingRuns
    lesson: Lesson  # the scenarios and guided steps this deployment offers


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
