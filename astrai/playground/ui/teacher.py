"""The teacher's view and the visitors' banner: components only, built only where the operator set a teacher's key
(``ASTRAI_TEACHER_KEY``), at the top of the page. Both start hidden: the teacher's view opens for a page whose address
carries the key, the banner when the teacher calls the class to a step (``callbacks/teacher.py``).

Presenter mode is the teacher's page restyled in the browser (``PRESENTER_JS``: no stylesheet is shipped to anyone
else): larger fonts; the page map's column (page map, occupancy, stats) below the panels, the page's full width, so
its cells are about twice as large (Plotly redraws to its container's width; a resize event tells it); the lesson's
note pinned to the bottom of the screen; and nothing scrolls the page by itself (the lesson's highlight,
``callbacks/setup.py``'s ``highlight_js``, outlines a view without placing it while this style is on, so the page
never moves under the teacher).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import gradio as gr

from astrai.playground.scenarios import Lesson
from astrai.playground.views.classroom import step_name

CLASS_PANEL_EVERY_S = 2.0  # the teacher's class panel is redrawn this often (one page: the teacher's)

# The banner stays at the top of the screen however far the visitor scrolled.
BANNER_STYLE = (
    "<style>#class_banner { position: sticky; top: 0; z-index: 60; background: #fef3c7; "
    "border: 2px solid #f59e0b; border-radius: 8px; padding: 4px 12px; align-items: center; }</style>"
)
PRESENTER_CSS = """
.gradio-container { --text-xs: 13px; --text-sm: 16px; --text-md: 19px; --text-lg: 22px; --text-xl: 26px;
  --text-xxl: 30px; --prose-text-size: 19px; font-size: 19px; padding-bottom: 32vh !important; }
.gradio-container .prose, .gradio-container .prose * { font-size: 19px; line-height: 1.45; }
#class_panel .prose, #class_panel .prose * { font-size: 14px; line-height: 1.3; }
#class_panel th, #class_panel td { padding: 2px 10px; }
.row:has(> .column > #page_map) { flex-wrap: wrap; }
.column:has(> #page_map) { min-width: 100% !important; }
#scenario_note { position: fixed; left: 0; right: 0; bottom: 0; z-index: 50; max-height: 30vh; overflow: auto;
  margin: 0; padding: 10px 28px; background: var(--background-fill-primary); border-top: 4px solid #f59e0b;
  box-shadow: 0 -4px 14px rgba(0, 0, 0, 0.18); }
#scenario_note .prose, #scenario_note .prose * { font-size: 22px; }
"""
PRESENTER_JS = (
    "(on) => { document.getElementById('astrai_presenter')?.remove();"
    " if (!on) { window.dispatchEvent(new Event('resize')); return; }"
    " const style = document.createElement('style'); style.id = 'astrai_presenter';"
    f" style.textContent = {json.dumps(PRESENTER_CSS)}; document.head.append(style);"
    " window.dispatchEvent(new Event('resize')); }"
)
# Once the page has opened, the key leaves the address bar (a projected page would show it to the class).
FORGET_KEY_JS = (
    "() => { const url = new URL(window.location.href);"
    " if (url.searchParams.has('teacher')) { url.searchParams.delete('teacher');"
    " window.history.replaceState(null, '', url); } }"
)


@dataclass(frozen=True)
class ClassBanner:
    """The teacher's call, on a visitor's page: the step, and a button that loads it as Lesson ▶ would."""

    row: gr.Row
    text: gr.Markdown
    follow: gr.Button
    dismiss: gr.Button


@dataclass(frozen=True)
class TeacherViews:
    """The teacher's view: presenter mode, the class panel and "move the class to step N"."""

    box: gr.Accordion
    presenter: gr.Checkbox
    step: gr.Dropdown  # a lesson step's index
    move: gr.Button
    panel: gr.Markdown
    timer: gr.Timer  # redraws the panel; active on the teacher's page only


def build_banner() -> ClassBanner:
    gr.HTML(BANNER_STYLE, container=False, padding=False, min_height=0)
    with gr.Row(visible=False, elem_id="class_banner", equal_height=True) as row:
        text = gr.Markdown(elem_id="class_banner_text")
        follow = gr.Button("Go there", variant="primary", size="sm", elem_id="class_follow", scale=0, min_width=140)
        dismiss = gr.Button("Not now", size="sm", elem_id="class_dismiss", scale=0, min_width=90)
    return ClassBanner(row, text, follow, dismiss)


def build_teacher_views(lesson: Lesson) -> TeacherViews:
    with gr.Accordion("Teacher's view: your class", open=True, visible=False, elem_id="teacher_view") as box:
        with gr.Row(equal_height=False):
            presenter = gr.Checkbox(
                False,
                label="Presenter mode: larger fonts and page map, the note pinned, no scrolling by itself",
                elem_id="presenter",
                scale=2,
            )
            step = gr.Dropdown(
                [(step_name(lesson.steps, i), i) for i in range(len(lesson.steps))],
                value=0,
                label="Move the class to",
                elem_id="class_step",
                scale=2,
            )
            move = gr.Button("Move the class there", variant="primary", elem_id="class_move", scale=1)
        panel = gr.Markdown(elem_id="class_panel")
    return TeacherViews(box, presenter, step, move, panel, gr.Timer(CLASS_PANEL_EVERY_S, active=False))
