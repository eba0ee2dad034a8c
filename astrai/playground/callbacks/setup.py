"""Scenarios, the lesson and the Engine settings: what a visitor's panels hold, and which engine they run on.

Picking a scenario moves only the visitor to its profile's engine (built on first use, then shared); the Engine
settings give the visitor a profile of their own. No choice here rebuilds or stops an engine that serves anyone.
A lesson's small pool (``Profile.per_visitor``) is the visitor's own (``Engines.own``: a tenant of the default
engine), unless they ticked "one pool shared with everyone", or the reserve for own pools is full (they are told).
"""

from __future__ import annotations

import json
from typing import Any

import gradio as gr
from gradio.components import Component

from astrai.playground.backends.profiles import EngineSettings, Profile
from astrai.playground.backends.protocol import BackendError, EngineLimitReached
from astrai.playground.callbacks.context import QUIET, Context, Update, session_of
from astrai.playground.callbacks.sizing import replay_button_of
from astrai.playground.scenarios import LESSON_PROFILES, SCENARIO_BY_NAME, Lesson
from astrai.playground.ui.components import MAX_PANELS, by_name, fixed


def highlight_js(lesson: Lesson) -> str:
    """Outline the view a lesson step talks about (an inline style: no stylesheet to ship). The step number is read
    back from the note ("**Lesson 3/6: ...") because a gr.State never reaches the browser."""
    return (
        "(note) => { const ids = "
        + json.dumps([step.look_at for step in lesson.steps])
        + "; for (const id of ids) { const e = document.getElementById(id); if (e) e.style.outline = ''; }"
        " const m = /Lesson (\\d+)\\//.exec(note || ''); const e = m && document.getElementById(ids[m[1] - 1]);"
        " if (e) { e.style.outline = '3px solid #f59e0b'; e.scrollIntoView({block: 'nearest'}); } }"
    )


CUSTOM_NAME = "your own settings"


class SetupCallbacks:
    def __init__(self, ctx: Context):
        self.ctx, self.ui = ctx, ctx.ui
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
        update |= dict.fromkeys(ui.panels.outputs, "")
        session = session_of(request)
        update |= self._move(session, scenario.profile, progress)
        self._start_clean(session)
        return update | replay_button_of(self.ctx, session)  # offered for the requests on the engine moved to

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
        """Move through the guided lesson: load the step's scenario and say what to look at."""
        steps = self.ctx.lesson.steps
        i = min(max(int(index or 0) + delta, 0), len(steps) - 1)
        step, setup = steps[i], self.ui.setup
        update = self.load_scenario(step.scenario, request, progress)
        return update | {setup.lesson_step: i, setup.scenario: step.scenario, setup.note: self.ctx.lesson.note(i)}

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

    def wire(self, demo: gr.Blocks) -> None:
        ui, setup = self.ui, self.ui.setup
        columns = ui.panels.columns
        ui.form.n_panels.change(
            lambda k: {column: gr.Column(visible=i < int(k)) for i, column in enumerate(columns)},
            ui.form.n_panels,
            list(columns),
            queue=False,
            api_visibility="private",
            **QUIET,
        )
        engine = setup.engine
        engine_outputs: list[Component] = [engine.model, engine.page_size, engine.n_pages, engine.max_batch_size]
        engine_outputs += [engine.prefix_caching, engine.dtype, engine.eviction, engine.status, ui.cache.cursor]
        scenario_outputs: list[Component] = [setup.note, ui.form.shared_prefix, ui.form.n_panels, ui.form.max_tokens]
        scenario_outputs += [ui.form.cache_namespace, *ui.panels.prompts, *ui.panels.outputs, ui.sizing.replay_mine]
        scenario_outputs += engine_outputs  # the engine's status last (API clients read it there)
        # builds are rare and short (the lesson's engines are built at start): they never block the chart timer
        setup.scenario.input(
            self.load_scenario,
            setup.scenario,
            scenario_outputs,
            api_name="load_scenario",
            concurrency_limit=4,
            concurrency_id="setup",
            show_progress_on=setup.note,
        )
        for button, delta in ((setup.lesson_prev, -1), (setup.lesson_next, 1)):
            button.click(
                fixed(self.lesson, delta=delta),
                setup.lesson_step,
                [setup.lesson_step, setup.scenario, *scenario_outputs],
                api_visibility="private",
                concurrency_limit=4,
                concurrency_id="setup",
                show_progress_on=setup.note,
            ).then(fn=None, inputs=setup.note, js=highlight_js(self.ctx.lesson))
        demo.load(fn=None, inputs=setup.note, js=highlight_js(self.ctx.lesson))  # a fresh page: the first step outlined
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
