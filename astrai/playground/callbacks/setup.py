"""Scenarios, the lesson and the Engine settings: what a visitor's panels hold, and which engine they run on.

Picking a scenario moves only the visitor to its profile's engine (built on first use, then shared); the Engine
settings give the visitor a profile of their own. No choice here rebuilds or stops an engine that serves anyone.
A lesson's small pool (``Profile.per_visitor``) is the visitor's own (``Engines.own``: a tenant of the default
engine), unless they ticked "one pool shared with everyone", or the reserve for own pools is full (they are told).
"""

from __future__ import annotations

import json
import re
from typing import Any

import gradio as gr
from gradio.blocks import Block
from gradio.components import Component

from astrai.playground.backends.profiles import EngineSettings, Profile
from astrai.playground.backends.protocol import BackendError, EngineLimitReached
from astrai.playground.callbacks.context import QUIET, Context, Update, session_of
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.sizing import replay_button_of
from astrai.playground.scenarios import LESSON_PROFILES, SCENARIO_BY_NAME, Lesson
from astrai.playground.ui.components import MAX_PANELS, by_name, fixed
from astrai.playground.ui.layout import CAPTIONS
from astrai.playground.views import causes

SETTLE_MS = 3000  # how long a lesson page keeps its view in place while the step's updates land
HIGHLIGHT_JS = """
(note) => {
  const ids = IDS;
  for (const id of ids) { const e = document.getElementById(id); if (e) e.style.outline = ''; }
  const m = /Lesson (\\d+)\\//.exec(note || '');
  const view = m && document.getElementById(ids[m[1] - 1]);
  if (!view) return;
  view.style.outline = '3px solid #f59e0b';
  const toggle = view.querySelector(':scope > .label-wrap');  // an accordion: opened
  if (toggle && !toggle.classList.contains('open')) toggle.click();
  if (!PLACE || document.getElementById('astrai_presenter')) return;  // presenter mode: nothing moves by itself
  const bar = document.getElementById('lesson_bar');
  const place = () => window.scrollBy(
    {top: view.getBoundingClientRect().top - bar.getBoundingClientRect().bottom - 8, behavior: 'instant'});
  window.__lessonSettling?.();
  const moved = new ResizeObserver(place);  // called as it starts observing, then at each change of size
  const done = new AbortController();
  const shown = {page: +m[1], settling: true};
  const stop = () => { moved.disconnect(); done.abort(); shown.settling = false; };
  window.__lessonPage = shown;
  window.__lessonSettling = stop;
  moved.observe(document.querySelector('.gradio-container'));
  for (const t of ['wheel', 'touchmove', 'keydown', 'mousedown'])
    window.addEventListener(t, stop, {signal: done.signal, passive: true});
  setTimeout(stop, SETTLE_MS);
}
"""


def highlight_js(lesson: Lesson, place: bool = True) -> str:
    """Outline the view a lesson page talks about (an inline style) and keep its top just below the lesson's bar
    (pinned to the top of the window: ``layout.PAGE_CSS``), so the note, its buttons and the view are in view together;
    a view in a closed accordion opens it. The page number is read back from the note ("**Lesson 3/9: ...") because a
    gr.State never reaches the browser.

    The step's own updates land around the same time (the panels shown, the live view's charts drawn anew), moving
    what is above the view: so the view is placed again at each change of the page's size for ``SETTLE_MS``, until
    the visitor scrolls, clicks or types, or the next step's hook takes over (``window.__lessonPage`` says which page
    was placed, and whether it still is being placed). ``place=False``, or the teacher's presenter mode
    (``ui/teacher.py``): the outline alone (a fresh page stays at its top; a projected page never moves by itself)."""
    values = {"IDS": json.dumps(lesson.look_at()), "PLACE": json.dumps(place), "SETTLE_MS": str(SETTLE_MS)}
    return re.sub(r"\b(IDS|PLACE|SETTLE_MS)\b", lambda m: values[m.group(1)], HIGHLIGHT_JS)


CUSTOM_NAME = "your own settings"


class SetupCallbacks:
    def __init__(self, ctx: Context, runs: RunCallbacks):
        self.ctx, self.ui, self.runs = ctx, ctx.ui, runs
        profiles = (ctx.engines.default, *LESSON_PROFILES, *(s.profile for s in ctx.lesson.scenarios))
        self.known = {p: p for p in profiles}

    def load_scenario(
        self,
        name: str | None,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        scenario = SCENARIO_BY_NAME.get(name or "")
        if scenario is None:
            return {}
        ui, setup = self.ui, self.ui.setup
        update: Update = {
            setup.note: f"**{scenario.name}:** {scenario.explanation}",
            ui.form.shared_prefix: scenario.prefix,
            ui.form.n_panels: len(scenario.prompts),
            ui.form.max_tokens: scenario.max_tokens,
            ui.form.cache_namespace: scenario.namespace,
        }
        prompts = scenario.prompts + [""] * (MAX_PANELS - len(scenario.prompts))
        update |= dict(zip(ui.panels.prompts, prompts, strict=True))
        session = session_of(request)
        update |= self._move(session, scenario.profile, progress)
        self._start_clean(session)
        update |= self._clean_slate(session)
        update |= replay_button_of(self.ctx, session)  # offered for the requests on the engine moved to
        return update | self.panels_shown(len(scenario.prompts), emptied=True)  # at once: the view goes under them

    def panels_shown(self, n: float, emptied: bool = False) -> Update:
        """The first ``n`` panels shown, and their token boxes (a hidden panel's box takes no room either);
        ``emptied``: the boxes emptied too (a scenario loaded: the clean slate)."""
        panels = self.ui.panels
        return {
            **{column: gr.Column(visible=i < int(n)) for i, column in enumerate(panels.columns)},
            **{
                box: gr.HTML(None, visible=i < int(n)) if emptied else gr.HTML(visible=i < int(n))
                for i, box in enumerate(panels.highlights)
            },
        }

    def _clean_slate(self, session: str) -> Update:
        """Every view of the last run emptied (its text, badges, token colouring, table, savings, replay, routing
        comparison) and the view live again: a new step's prompts have not run, and nothing of the last step's stays
        under them. (A failed event's "Error" marker goes with the step's progress: ``wire``.)"""
        visitor = self.ctx.visitors.act(session)
        visitor.forget_shown()
        controls = self.ui.replay
        return (
            dict.fromkeys(self.ui.panels.outputs, "")
            | self.runs.no_details()
            | self.runs.savings(visitor)
            | {
                controls.step: gr.Slider(maximum=1, value=0),
                controls.note: "",
                controls.timer: gr.Timer(active=False),
                controls.play_slow: gr.Button(variant="secondary"),
                self.ui.cache.cursor: None,  # the live view draws everything anew, live
                self.ui.cache.routing: None,
                self.ui.cache.routing_note: CAPTIONS["routing"],
                self.ui.setup.lesson_end: gr.Markdown(visible=False),
            }
        )

    def _start_clean(self, session: str) -> None:
        """A step on the visitor's own pool starts from an empty prefix cache: its text promises what a first visit
        shows (step 8's panel 1 is "new"), and on a second visit the pages the last one stored, under its fresh salt,
        would read "another namespace" instead. Only this visitor's pages are there, so no one else loses any."""
        profile = self.ctx.visitors.act(session).profile
        if profile.owner is not None:
            self.ctx.engines.ensure(profile).clear()

    def lesson(
        self,
        index: int | None,
        delta: int,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """Move through the guided lesson: load the step's scenario and say what to look at; past the last step, the
        end (no scenario: the visitor's runs counted by cause)."""
        lesson, setup = self.ctx.lesson, self.ui.setup
        i = min(max(int(index or 0) + delta, 0), lesson.length - 1)
        session = session_of(request)
        if lesson.is_end(i):
            seen = causes.what_you_saw(self.ctx.visitors.act(session).tally)
            update = self._clean_slate(session) | {setup.lesson_end: gr.Markdown(seen, visible=True)}
        else:
            step = lesson.steps[i]
            update = self.load_scenario(step.scenario, request, progress) | {setup.scenario: step.scenario}
        return update | {
            setup.lesson_step: i,
            setup.note: lesson.note(i),
            setup.lesson_prev: gr.Button(interactive=i > 0),
            setup.lesson_next: gr.Button(interactive=not lesson.is_end(i)),
            setup.restart: gr.Button(visible=lesson.is_end(i)),
        }

    def restart(
        self,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """Restart lesson: its first step, and the end counts the runs from here."""
        self.ctx.visitors.act(session_of(request)).tally = causes.Tally()
        return self.lesson(0, 0, request, progress)

    def apply_settings(
        self,
        values: dict[str, Any],
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """The visitor's own engine: a profile of these settings (shared with visitors who chose the same)."""
        try:
            settings = EngineSettings(
                page_size=int(values["page_size"]),
                n_pages=int(values["n_pages"]),
                max_batch_size=int(values["max_batch_size"]),
                prefix_caching=bool(values["prefix_caching"]),
                dtype=str(values["dtype"]),
                eviction=str(values.get("eviction") or "lru"),  # an API client that predates it gets LRU
            )
            settings.validate()
        except (ValueError, TypeError) as exc:
            raise gr.Error(str(exc)) from None
        model = str(values["model"])
        if model not in self.ctx.engines.model_choices():
            raise gr.Error(f"Model {model!r} is not offered on this Space.")
        wanted = Profile(model, settings, name=CUSTOM_NAME, custom=True)
        profile = self.known.get(wanted, wanted)  # a scenario's settings: that scenario's engine
        return self._move(session_of(request), profile, progress)  # its status says where the visitor is now

    def share_pools(
        self,
        shared: bool,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """The "one pool shared with everyone" choice: the visitor on a lesson's small pool moves at once."""
        session = session_of(request)
        visitor = self.ctx.visitors.act(session)
        visitor.shared_pools = bool(shared)
        if not visitor.profile.per_visitor:
            return {self.ui.setup.engine.status: "The lesson's small-pool steps will use this choice."}
        return self._move(session, visitor.profile.shared(), progress)

    def _move(self, session: str, profile: Profile, progress: gr.Progress) -> Update:
        """Put the visitor on ``profile``'s engine (building it when needed); show its settings. A lesson's small
        pool becomes the visitor's own, unless they chose to share it; past the reserve for own pools, shared."""
        engines, engine_form = self.ctx.engines, self.ui.setup.engine
        if not engines.chooses_pools:
            return {engine_form.status: self._server_note(profile)}
        visitor = self.ctx.visitors.act(session)
        note = ""
        if profile.per_visitor and not visitor.shared_pools:
            own = engines.own(profile, session)
            try:
                engines.ensure(own)
                profile = own
            except BackendError as exc:  # past the reserve for own pools (EngineLimitReached), or it failed
                note = f" ⚠️ {exc} You share this pool with everyone else on it: their runs may evict your pages."
                gr.Warning(note)
        try:
            engines.ensure(profile, lambda done, what: progress(done, desc=what))
        except EngineLimitReached as exc:
            gr.Warning(str(exc))
            return {engine_form.status: f"⚠️ {exc} You stay on **{visitor.profile.engine}**."}
        except BackendError as exc:
            gr.Warning(str(exc))
            return {engine_form.status: f"❌ {exc} You stay on **{visitor.profile.engine}**."}
        visitor.profile = profile
        engines.release_own(session, keep=profile)  # one own pool a visitor: the one they are on now, if any
        settings = profile.settings
        return {
            engine_form.model: profile.model,
            engine_form.page_size: settings.page_size,
            engine_form.n_pages: settings.n_pages,
            engine_form.max_batch_size: settings.max_batch_size,
            engine_form.prefix_caching: settings.prefix_caching,
            engine_form.dtype: settings.dtype,
            engine_form.eviction: settings.eviction,
            self.ui.cache.cursor: None,  # the live view draws the new engine from scratch
            engine_form.status: self._status(profile) + note,
        }

    def _status(self, profile: Profile) -> str:
        status = f"✅ You are on **{profile.engine}** ({profile.settings.describe()})."
        if profile.owner is not None:
            status += (
                " No one else's run evicts or preempts your pages; your tokens run in the default engine's batches."
            )
        elif profile.per_visitor:
            status += " Everyone on this step who chose to share is on this pool."
        return status

    @staticmethod
    def _server_note(profile: Profile) -> str:
        if profile.settings == EngineSettings():
            return ""
        return (
            f"This scenario asks for a pool of {profile.settings.describe()}. A vLLM server's pool is its own: the "
            "playground uses the server's pool as it is."
        )

    def leave(self, request: gr.Request) -> None:
        """The visitor's page closed: their own pool goes back to the reserve, and their state is forgotten."""
        session = session_of(request)
        self.ctx.engines.release_own(session)
        self.ctx.visitors.leave(session)

    def wire(self, demo: gr.Blocks) -> None:
        demo.unload(self.leave)
        ui, setup = self.ui, self.ui.setup
        ui.form.n_panels.change(
            self.panels_shown,
            ui.form.n_panels,
            [*ui.panels.columns, *ui.panels.highlights],
            queue=False,
            api_visibility="private",
            **QUIET,
        )
        engine = setup.engine
        engine_outputs: list[Component] = [engine.model, engine.page_size, engine.n_pages, engine.max_batch_size]
        engine_outputs += [engine.prefix_caching, engine.dtype, engine.eviction, engine.status, ui.cache.cursor]
        scenario_outputs: list[Block] = [setup.note, ui.form.shared_prefix, ui.form.n_panels, ui.form.max_tokens]
        scenario_outputs += [ui.form.cache_namespace, *ui.panels.prompts, *ui.panels.outputs]
        scenario_outputs += [*ui.panels.badges, *ui.panels.highlights, ui.cache.table, ui.cache.savings]
        scenario_outputs += [ui.cache.savings_note, ui.replay.step, ui.replay.note, ui.replay.timer]
        scenario_outputs += [ui.replay.play_slow, setup.lesson_end, ui.cache.routing, ui.cache.routing_note]
        scenario_outputs += [ui.sizing.replay_mine, *ui.panels.columns]
        scenario_outputs += engine_outputs  # the engine's status last (API clients read it)
        # the components that show a failed event's "Error" (each event's progress shows on one of them): loading a
        # step shows its progress on all of them, which clears any such marker the last step left
        marked = [setup.note, ui.panels.outputs[0], ui.sizing.note, engine.status]
        # builds are rare and short (the lesson's engines are built at start): they never block the chart timer; a
        # run of the visitor's still streaming stops (its views are gone)
        setup.scenario.input(
            self.load_scenario,
            setup.scenario,
            scenario_outputs,
            api_name="load_scenario",
            concurrency_limit=4,
            concurrency_id="setup",
            show_progress_on=marked,
            cancels=self.runs.streams,
        )
        lesson_outputs = [setup.lesson_step, setup.scenario, setup.lesson_prev, setup.lesson_next, setup.restart]
        moves = [
            (setup.lesson_prev, fixed(self.lesson, delta=-1), setup.lesson_step),
            (setup.lesson_next, fixed(self.lesson, delta=1), setup.lesson_step),
            (setup.restart, self.restart, None),
        ]
        for button, move, step in moves:
            button.click(
                move,
                step,
                [*lesson_outputs, *scenario_outputs],
                api_visibility="private",
                concurrency_limit=4,
                concurrency_id="setup",
                show_progress_on=marked,
                cancels=self.runs.streams,
            ).then(fn=None, inputs=setup.note, js=highlight_js(self.ctx.lesson))
        demo.load(fn=None, inputs=setup.note, js=highlight_js(self.ctx.lesson, place=False))  # the first step outlined
        engine.shared_pools.input(
            self.share_pools,
            engine.shared_pools,
            engine_outputs,
            api_name="share_pools",
            concurrency_limit=4,
            concurrency_id="setup",
            show_progress_on=engine.status,
        )
        inputs, apply = by_name(ui.engine_fields(), self.apply_settings)
        engine.apply.click(
            apply,
            inputs,
            engine_outputs,
            api_name="apply_settings",
            concurrency_limit=2,
            concurrency_id="setup",
            show_progress_on=engine.status,
        )
