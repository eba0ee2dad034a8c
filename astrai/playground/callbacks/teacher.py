"""The teacher's view and the class's banner (wired only where the operator set ``ASTRAI_TEACHER_KEY``).

Access: a page whose address carries ``?teacher=KEY`` when it opens, the key compared in constant time, becomes a
teacher's page (``Classroom.admit_teacher``): only then does its teacher's view open, and every teacher's callback
checks the caller's session again, so a visitor who calls those endpoints by hand gets nothing. A visitor cannot
become a teacher without the key, and a teacher's session hash, which the check rests on, is never shown to anyone.

Privacy: what the teacher's view shows is built from the ``Classroom`` alone (step numbers and token counts), so no
visitor's text reaches it; what reaches a visitor of it is the banner alone (the called step), carried by the
visitor's live view's poll (``LiveCallbacks``: it waits for it like for any change, ``waiting``).

Following the call loads the step as **Lesson ▶** does, by pressing it: the step index is first set to the one
before the called step, then the page's own Lesson ▶ is clicked, so whatever Lesson ▶ does (the step's scenario,
its note and highlight, a clean slate) following does too.
"""

from __future__ import annotations

import hmac
from typing import Any

import gradio as gr
from gradio.blocks import Block

from astrai.playground.callbacks.context import QUIET, Context, Update, session_of
from astrai.playground.teaching import question
from astrai.playground.ui.teacher import FORGET_KEY_JS, PRESENTER_JS, ClassBanner, TeacherViews
from astrai.playground.views import classroom as class_views

PRESS_LESSON_NEXT_JS = "() => { document.getElementById('lesson_next')?.click(); }"


def key_matches(given: str | None, key: str) -> bool:
    """Compared in constant time (as bytes: any text a client sends compares, none raises)."""
    return hmac.compare_digest((given or "").encode(), key.encode())


class TeacherCallbacks:
    def __init__(self, ctx: Context, key: str, views: TeacherViews, banner: ClassBanner):
        if not key:
            raise ValueError("a teacher's view needs the operator's key")
        self.ctx, self.ui, self.views, self.banner = ctx, ctx.ui, views, banner
        self._key = key
        self.steps = ctx.lesson.steps

    # ----- every page --------------------------------------------------------------------------------------------
    def arrive(self, step: int | None, scenario: str | None, request: gr.Request) -> Update:
        """A page opened: a teacher's (the key in its address) opens the teacher's view in presenter mode; any other
        is placed on the lesson step it shows."""
        session = session_of(request)
        given = dict(getattr(request, "query_params", None) or {}).get("teacher")
        if given is not None and key_matches(given, self._key):
            self.ctx.classroom.admit_teacher(session)
            views = self.views
            return {
                views.box: gr.Accordion(visible=True),
                views.presenter: True,
                views.timer: gr.Timer(active=True),
                views.panel: self._panel(),
            }
        self.place(step, scenario, request)
        return {self.views.box: gr.skip()}  # nothing (an empty dict would read as one value)

    def place(self, step: int | None, scenario: str | None, request: gr.Request) -> None:
        """The page's lesson step or scenario changed: it is on step ``step`` while it shows that step's scenario,
        else elsewhere (a scenario its visitor picked)."""
        index = int(step) if step is not None else 0
        on = 0 <= index < len(self.steps) and self.steps[index].scenario == scenario
        self.ctx.classroom.place(session_of(request), index if on else None)

    @property
    def banner_outputs(self) -> list[Block]:
        """What ``banner_update`` may change (outputs of the live view's poll)."""
        return [self.banner.row, self.banner.text, self.banner.follow]

    def waiting(self, session: str) -> bool:
        """A call this page has not been shown (the live view's poll answers at once then)."""
        return self.ctx.classroom.waiting_call(session) is not None

    def banner_update(self, session: str) -> Update:
        """The banner, once per call, on the live view's poll; nothing else of the teacher's view."""
        classroom = self.ctx.classroom
        call = classroom.waiting_call(session)
        if call is None:
            return {}
        classroom.shown(session, call)
        return {
            self.banner.row: gr.Row(visible=True),
            self.banner.text: class_views.banner(self.steps, call.step),
            self.banner.follow: gr.Button(value=f"Go to step {call.step + 1}"),
        }

    def follow(self, request: gr.Request) -> Update:
        """The visitor follows the call: the step index goes to the one before it (Lesson ▶ is pressed next)."""
        call = self.ctx.classroom.standing_call()
        if call is None or self.ctx.classroom.is_teacher(session_of(request)):
            raise gr.Error("Your teacher's call has ended: stay where you are.", title="No call")
        return {self.ui.setup.lesson_step: call.step - 1, self.banner.row: gr.Row(visible=False)}

    def dismiss(self) -> Update:
        return {self.banner.row: gr.Row(visible=False)}

    # ----- the teacher's page only -------------------------------------------------------------------------------
    def _is_teacher(self, request: gr.Request) -> bool:
        return self.ctx.classroom.is_teacher(session_of(request))

    def _panel(self) -> str:
        view = self.ctx.classroom.view()
        called = self.ctx.lesson.steps[view.call.step] if view.call is not None else None
        return class_views.class_panel(view, self.steps, question(called) if called else None)

    def class_panel(self, request: gr.Request) -> Update:
        """The class panel, redrawn on the teacher's page; nothing for anyone else."""
        return {self.views.panel: self._panel() if self._is_teacher(request) else gr.skip()}

    def move(self, step: Any, request: gr.Request) -> Update:
        """The teacher calls the class to ``step`` and goes there too (Lesson ▶ is pressed next)."""
        if not self._is_teacher(request):
            raise gr.Error("Only the teacher's view moves the class.", title="Not a teacher's page")
        index = int(step)
        if not 0 <= index < len(self.steps):
            raise gr.Error(f"The lesson has steps 1 to {len(self.steps)}.")
        self.ctx.classroom.call(index)
        return {self.views.panel: self._panel(), self.ui.setup.lesson_step: index - 1}

    def wire(self, demo: gr.Blocks) -> None:
        views, banner, setup = self.views, self.banner, self.ui.setup
        where = [setup.lesson_step, setup.scenario]
        private: dict[str, Any] = {"api_visibility": "private", "queue": False, **QUIET}
        opened = demo.load(self.arrive, where, [views.box, views.presenter, views.timer, views.panel], **private)
        opened.then(fn=None, js=FORGET_KEY_JS)
        for moved in (setup.lesson_step.change, setup.scenario.change):
            moved(self.place, where, None, **private)
        views.presenter.change(fn=None, inputs=views.presenter, js=PRESENTER_JS)
        views.timer.tick(self.class_panel, None, views.panel, **private)
        views.move.click(self.move, views.step, [views.panel, setup.lesson_step], **private).success(
            fn=None, js=PRESS_LESSON_NEXT_JS
        )
        banner.follow.click(self.follow, None, [setup.lesson_step, banner.row], **private).success(
            fn=None, js=PRESS_LESSON_NEXT_JS
        )
        banner.dismiss.click(self.dismiss, None, banner.row, **private)
