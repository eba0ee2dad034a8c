"""Run, compare, stop, follow-up and clear: a visitor's batch on the engine of their profile.

A run holds its engine for as long as it streams (``Engines.run_on``), so no other visitor's action can retire it
meanwhile. The stream carries the panels' text alone; the badges come with the live view while it streams and
with ``after_run`` when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr
from gradio.components import Component

from astrai.explain import Explanation
from astrai.observation import RequestInfo
from astrai.playground import knobs
from astrai.playground.backends.profiles import Profile
from astrai.playground.backends.protocol import Backend, BackendError
from astrai.playground.callbacks.context import QUIET, Context, Update, run_infos, served_once_named, session_of
from astrai.playground.callbacks.pacing import Pacer
from astrai.playground.callbacks.sizing import replay_button_of
from astrai.playground.scenarios import FOLLOW_UP, NAMESPACES, Namespace
from astrai.playground.state import ShownRun, Visitor
from astrai.playground.ui.components import MAX_PANELS, by_name
from astrai.playground.ui.layout import MAX_NEW_TOKENS, MAX_PROMPT_CHARS
from astrai.playground.views import causes, charts, fleet, replay, text
from astrai.sampling import SamplingParams

# Every visitor's end-of-run update (Run's and Stop's), in one group wider than the default 2: on a fleet it can wait
# up to SERVED_WAIT_S for the replicas' events (``served_once_named``), and two such waits must not hold back a class.
AFTER_RUN = {"concurrency_limit": 8, "concurrency_id": "after_run"}


@dataclasses.dataclass(frozen=True)
class Batch:
    prefix: str
    prompts: list[str]
    params: SamplingParams
    namespace: Namespace

    def salt(self, session: str) -> str | None:
        """The run's prefix-cache namespace: the engine's shared one, the visitor's, or one of its own."""
        if self.namespace == "mine":
            return session
        if self.namespace == "fresh":
            return f"{session}/run/{uuid.uuid4().hex}"
        return None


def parse_batch(values: dict[str, Any]) -> Batch:
    """A run's form, checked; anything a client can send (NaN, None, strings where numbers belong) gets a clear
    message."""
    try:
        n = int(values["n_panels"])
        if not 1 <= n <= MAX_PANELS:
            raise ValueError(f"Use between 1 and {MAX_PANELS} panels.")
        prefix = values["shared_prefix"] or ""
        prompts = [values[f"prompt_{i + 1}"] or "" for i in range(n)]
        for i, prompt in enumerate(prompts):
            if not (prefix + prompt).strip():
                raise ValueError(f"Panel {i + 1} has an empty prompt.")
            if len(prefix) + len(prompt) > 2 * MAX_PROMPT_CHARS:
                raise ValueError(f"Panel {i + 1}: prompt too long (max {2 * MAX_PROMPT_CHARS} characters).")
        max_tokens = int(values["max_tokens"])
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"Max tokens must be between 1 and {MAX_NEW_TOKENS}.")
        seed = values["seed"]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(values["temperature"]),
            top_p=float(values["top_p"]),
            top_k=int(values["top_k"]),
            seed=None if seed is None else int(seed),
        )
        namespace = values["cache_namespace"]
        if namespace not in NAMESPACES:
            raise ValueError(f"cache_namespace must be one of {', '.join(NAMESPACES)}, got {namespace!r}.")
    except (ValueError, TypeError, OverflowError) as exc:
        raise gr.Error(str(exc)) from None
    return Batch(prefix, prompts, params, namespace)


@dataclasses.dataclass(frozen=True)
class Told:
    """One run as the page tells it: its requests (None where its engine no longer knows one), their explanations,
    and a badge per panel ("" past the run's panels)."""

    shown: ShownRun
    backend: Backend | None
    infos: list[RequestInfo | None]
    whys: list[Explanation | None]
    badges: list[str]


@contextlib.contextmanager
def _streaming(visitor: Visitor) -> Iterator[None]:
    visitor.streaming_since = time.monotonic()
    try:
        yield
    finally:
        visitor.streaming_since = None


class RunCallbacks:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.ui = ctx.ui
        self.streams: list[Any] = []  # the Run and Compare streams' events, once wired (a lesson step stops them)

    def run(self, values: dict[str, Any], request: gr.Request) -> Iterator[Update]:
        session = session_of(request)
        visitor = self.ctx.visitors.act(session)
        yield from self._stream(parse_batch(values), session, visitor.profile, caching=True)

    def compare(self, values: dict[str, Any], request: gr.Request) -> Iterator[Update]:
        """The same batch twice: on the visitor's engine, with its prefix cache, then on the same settings without
        one. The second half runs on an engine of its own (``Engines.without_caching``), so its pages never take the
        place of anyone's cached pages and its lookups never lower the shared engine's hit rate; where the pool is a
        server's, it runs there in namespaces of its own, one per prompt, so nothing is reused."""
        batch, session = parse_batch(values), session_of(request)
        profile = self.ctx.visitors.act(session).profile
        if not profile.settings.prefix_caching:
            raise gr.Error(
                "Your engine has prefix caching off already: pick a scenario, or turn it on in Engine "
                "settings, to compare."
            )
        off = self.ctx.engines.without_caching(profile) or profile
        if off != profile:  # built before the first half streams, so a comparison never stops halfway
            try:
                self.ctx.engines.ensure(off)
            except BackendError as exc:  # past an operator's bound: the second half in namespaces of its own
                gr.Warning(f"{exc} The caching-off half runs on your engine, each prompt in a namespace of its own.")
                off = profile
        yield from self._stream(batch, session, profile, caching=True)
        yield from self._stream(batch, session, off, caching=False, beside=self.ctx.visitors.act(session).shown)

    def _stream(
        self, batch: Batch, session: str, profile: Profile, caching: bool, beside: ShownRun | None = None
    ) -> Iterator[Update]:
        """Stream the panels' text, and nothing else.

        Gradio 6.31 makes each message of a streaming event cost every output a server-side postprocess and the
        browser an update, changed or not. In headless Chromium (tools/measure.py), the slowest of 4 panels showed
        5-10 updates a second with the badges, token colouring and table in the stream (19 outputs), 16-18 with
        the six text boxes alone.
        """
        ctx, outputs = self.ctx, self.ui.panels.outputs
        visitor = ctx.visitors.act(session)
        step = ctx.classroom.step_of(session)  # the lesson step it was started on, for a teacher's class panel
        n = len(batch.prompts)
        answers = [""] * n

        def texts() -> Update:
            return {box: answers[i] if i < n else "" for i, box in enumerate(outputs)}

        try:
            with ctx.engines.run_on(profile) as backend, ctx.visitors.running(profile, session):
                base = backend.snapshot()
                try:
                    stats = backend.stats()
                    looks_up, eviction = stats.prefix_caching, stats.eviction
                except BackendError:  # a server away: the run itself says so, panel by panel
                    looks_up, eviction = True, None
                prompts = [backend.format_prompt(batch.prefix, p) for p in batch.prompts]
                # caching off: an engine without it, or on a server's own pool a namespace per prompt
                run = backend.submit(prompts, batch.params, batch.salt(session), share_cache=caching)
                ctx.visitors.register(run.request_ids, session)
                visitor.recording = replay.Recording(
                    base,
                    (),
                    tuple(run.request_ids),
                    backend.generation,
                    prefix_caching=looks_up,
                    eviction=eviction,
                )
                visitor.following, visitor.playback = True, None
                shown = visitor.shown = ShownRun(
                    tuple(run.request_ids), tuple(batch.prompts), profile, caching=looks_up, caching_on_half=beside
                )
                try:
                    yield texts()
                    pacer = Pacer(ctx.runs.interval)
                    with ctx.runs.streaming(), _streaming(visitor):
                        for index, delta in run:
                            answers[index] += delta
                            if pacer.ready(time.monotonic()):
                                yield texts()
                except BackendError as exc:
                    gr.Warning(str(exc))
                finally:
                    run.close()  # Stop, a closed tab or an error: release the pages now
                infos = run_infos(backend, shown)
                summary = text.run_summary(infos)
                if caching and looks_up:
                    ctx.classroom.count_run(step, [(i.prompt_tokens, i.cached_tokens) for i in infos if i is not None])
                whys = self._explain(backend, shown, set(ctx.visitors.requests_of(session)))
        except (ValueError, TypeError, BackendError) as exc:  # refused before anything ran
            raise gr.Error(str(exc)) from None
        visitor.tally = visitor.tally.add(whys)  # the lesson's end counts every run that ran to its end
        if visitor.shown is shown:  # else the visitor loaded a step meanwhile: its savings start empty
            if caching:
                visitor.with_cache, visitor.without_cache = summary, None
            else:
                visitor.without_cache = summary
        yield texts()

    def no_details(self) -> Update:
        """Empty badges, token colouring and table: what a click on Run shows until the run fills them."""
        panels = self.ui.panels
        return {**dict.fromkeys(panels.badges, ""), **dict.fromkeys(panels.highlights), self.ui.cache.table: []}

    def details(self, visitor: Visitor, session: str, highlights: bool = True, final: bool = False) -> Update:
        """The badges (and, unless told not to, the token colouring and request table) of the latest run, each
        prompt token's cause in them (``views/causes.py``, as this session may see it); ``final`` once it ended: a
        fleet's badges then wait (briefly) for the events naming each panel's replica. After a Compare, both halves:
        each badge and the table tell the caching-on half, then the caching-off one, each labelled; the token
        colouring is the caching-on half's (without a cache every token is computed)."""
        shown, panels = visitor.shown, self.ui.panels
        if shown is None:
            return self.no_details()
        own = set(self.ctx.visitors.requests_of(session))
        last = self._tell(shown, own, final)
        on = self._tell(shown.caching_on_half, own, final) if shown.caching_on_half is not None else None
        update: Update = {
            badge: text.compared_badge(on.badges[i], last.badges[i]) if on is not None else last.badges[i]
            for i, badge in enumerate(panels.badges)
        }
        if not highlights or last.backend is None:
            return update
        halves = [(on, text.HALVES[0]), (last, text.HALVES[1])] if on is not None else [(last, "")]
        update[self.ui.cache.table] = [
            row
            for told, label in halves
            for row in text.request_rows(told.infos, list(told.shown.prompts), told.shown.caching, told.whys, label)
        ]
        coloured = on if on is not None else last
        backend = coloured.backend
        if backend is None:
            return update | dict.fromkeys(panels.highlights, "")
        shown_as = text.readable(backend.decode, backend.special_ids())
        panel_of = {rid: i for i, rid in enumerate(coloured.shown.request_ids)}
        whose = causes.Whose(panel_of, own, tuple(r.name for r in backend.replicas))
        for i, box in enumerate(panels.highlights):
            info, why = (coloured.infos[i], coloured.whys[i]) if i < len(coloured.infos) else (None, None)
            if info is None or why is None or info.cached_tokens is None:  # not looked up yet, or unknown
                update[box] = ""
                continue
            html = causes.token_html(why, info.prompt_ids, shown_as, whose, text.MAX_HIGHLIGHT_TOKENS)
            update[box] = (f"<small>{text.HALVES[0]}:</small>" if on is not None else "") + html
        return update

    def _tell(self, shown: ShownRun, own: set[int], final: bool) -> Told:
        """One run's requests, their explanations and badges (a fleet's naming the replica that served each)."""
        backend = self.ctx.engines.backend(shown.profile)
        infos = run_infos(backend, shown)
        whys = self._explain(backend, shown, own)
        badges = [text.badge(infos[i], shown.caching, whys[i]) if i < len(infos) else "" for i in range(MAX_PANELS)]
        if backend is not None and backend.replicas:  # a fleet: each badge names the replica that served it
            ids = list(shown.request_ids)
            served = served_once_named(backend, ids) if final else backend.served_by(ids)
            for i, (rid, info) in enumerate(zip(shown.request_ids, infos, strict=False)):
                if info is not None:
                    badges[i] += " · " + fleet.served_text(served.get(rid))
        return Told(shown, backend, infos, whys, badges)

    @staticmethod
    def _explain(backend: Backend | None, shown: ShownRun, own: set[int]) -> list[Explanation | None]:
        """Each panel's explanation (None where its request is unknown, or the backend cannot say now)."""
        if backend is None:
            return [None] * len(shown.request_ids)
        try:
            by_id = {e.request: e for e in backend.explain(list(shown.request_ids), own.__contains__)}
        except BackendError:
            return [None] * len(shown.request_ids)
        return [by_id.get(rid) for rid in shown.request_ids]

    def after_run(self, request: gr.Request) -> Update:
        """Once a run ends (or is stopped): its final badges and table, the replay slider stretched over its steps
        and the last one narrated, the slow replay offered (a run of the embedded model ends in about a second), and
        the chart of what caching saved. Apart from the stream because resizing a slider is a costly prop update."""
        ctx, controls = self.ctx, self.ui.replay
        visitor = ctx.visitors.act(session_of(request))
        recording = follow(ctx, visitor)
        frames = len(recording.frames) if recording else 0
        update = self.details(visitor, session_of(request), final=True) | self.savings(visitor)
        # the slider's range covers the run's steps; it moves to the last one only while the visitor follows live
        update[controls.step] = (
            gr.Slider(maximum=max(frames, 1), value=frames) if visitor.following else gr.Slider(maximum=max(frames, 1))
        )
        backend = ctx.engines.backend(visitor.shown.profile) if visitor.shown else None
        notes = eviction_notes(ctx, backend, recording, session_of(request)) if recording and backend else None
        note = replay.narrate(recording, frames, notes) if recording else ""
        if frames > 1:
            pace = f"{replay.SLOW_STEPS_PER_S:g} a second: {frames / replay.SLOW_STEPS_PER_S:.0f} s"
            note = f"{note}  \n**Replay ▶ slow** plays your run's {frames} steps one at a time, {pace}."
        slow = gr.Button(variant="primary" if frames > 1 else "secondary")
        return update | {controls.note: note, controls.play_slow: slow} | replay_button_of(ctx, session_of(request))

    def savings(self, visitor: Visitor) -> Update:
        engines, cache = self.ctx.engines, self.ui.cache
        small = visitor.profile.model == engines.default.model
        return {
            cache.savings: charts.savings(visitor.with_cache, visitor.without_cache),
            cache.savings_note: text.savings_note(visitor.with_cache, visitor.without_cache, small),
        }

    def follow_up(self, values: dict[str, Any]) -> Update:
        """Each shown panel's prompt becomes prompt + answer + ``FOLLOW_UP``."""
        n, prompts = int(values["n_panels"]), self.ui.panels.prompts
        turns = ((values[f"prompt_{i + 1}"], values[f"output_{i + 1}"]) for i in range(n))
        return {prompts[i]: p + o + FOLLOW_UP for i, (p, o) in enumerate(turns) if o}

    def clear_cache(self, request: gr.Request) -> None:
        """Empty the prefix cache of the visitor's engine, when no other visitor is on it: none whose view is on it,
        none whose run streams there (their cached pages would go too, and their runs' hits with them; a namespace
        of one's own, or fresh for each run, starts from a cold cache instead)."""
        ctx = self.ctx
        session = session_of(request)
        visitor = ctx.visitors.act(session)
        if ctx.visitors.others_on(visitor.profile, session):
            gr.Warning(
                "Other visitors are on this engine, and clearing would take their cached pages too. Choose 'fresh "
                "for each run' (or 'mine') under 'Cached pages a run may hit' to start from a cold cache instead."
            )
            return
        try:
            freed = ctx.engines.ensure(visitor.profile).clear()
        except BackendError as exc:
            gr.Warning(str(exc))
            return
        gr.Info(f"Prefix cache cleared: {freed} cached pages are free again.")

    def cache_stats(self, request: gr.Request) -> dict:
        """The caller's engine's counters, for API clients (load tests, dashboards)."""
        visitor = self.ctx.visitors.peek(session_of(request))
        try:
            return dataclasses.asdict(self.ctx.engines.ensure(visitor.profile).stats())
        except BackendError as exc:
            raise gr.Error(str(exc)) from None

    def wire(self) -> None:
        ui, buttons = self.ui, self.ui.buttons
        panels = ui.panels
        gr.api(self.cache_stats, api_name="cache_stats", concurrency_limit=8)
        details_outputs = [*panels.badges, *panels.highlights, ui.cache.table]
        after_outputs = [*details_outputs, ui.replay.step, ui.replay.note, ui.replay.play_slow, ui.sizing.replay_mine]
        after_outputs += [ui.cache.savings, ui.cache.savings_note]  # the note last (API clients read it there)
        for button, handler, api_name in ((buttons.run, self.run, "run"), (buttons.compare, self.compare, "compare")):
            inputs, fn = by_name(ui.run_fields(), handler)
            # a click first clears the last run's badges, token colouring and table, then streams the text alone
            cleared = button.click(
                self.no_details, None, details_outputs, queue=False, api_visibility="private", **QUIET
            )
            stream = cleared.then(
                fn,
                inputs,
                list(panels.outputs),
                api_name=api_name,
                concurrency_limit=knobs.RUN_CONCURRENCY,  # runs streaming at once (more wait in the queue)
                concurrency_id="run",
                show_progress="minimal",
                show_progress_on=panels.outputs[0],  # a queued run says so once, not in every panel
            )
            # API clients call /after_run themselves once /run returns (the browser chains it): see tests/test_app.py
            visibility = {"api_name": "after_run"} if api_name == "run" else {"api_visibility": "private"}
            stream.then(self.after_run, None, after_outputs, **visibility, **AFTER_RUN, **QUIET)
            self.streams.append(stream)
        buttons.stop.click(fn=None, cancels=self.streams, api_name="stop").then(
            self.after_run, None, after_outputs, api_visibility="private", **AFTER_RUN, **QUIET
        )
        buttons.clear.click(self.clear_cache, api_name="clear_cache", concurrency_limit=4)
        turns: dict[str, Component] = {"n_panels": ui.form.n_panels}
        for i, (prompt, output) in enumerate(zip(panels.prompts, panels.outputs, strict=True)):
            turns |= {f"prompt_{i + 1}": prompt, f"output_{i + 1}": output}
        inputs, fn = by_name(turns, self.follow_up)
        buttons.follow_up.click(fn, inputs, list(panels.prompts), api_visibility="private", **QUIET)


def eviction_notes(
    ctx: Context, backend: Backend, recording: replay.Recording, session: str
) -> Callable[[int], list[str]]:
    """What to say of an engine step of this recording: the evictions in it that cost a panel of the run tokens, and
    at a panel's admission, the evictions that did (``causes.eviction_notes``)."""
    own = set(ctx.visitors.requests_of(session))
    shown = ShownRun(recording.request_ids, (), ctx.visitors.peek(session).profile)
    whys = RunCallbacks._explain(backend, shown, own)
    whose = causes.Whose({rid: i for i, rid in enumerate(recording.request_ids)}, own)
    return lambda step: causes.eviction_notes(step, whys, whose)


ENDED = ("finished", "cancelled", "failed")
END_WAIT_S = 1.0  # how long a run that ended waits for the step recording its end (the engine records it at once)


def follow(ctx: Context, visitor: Visitor) -> replay.Recording | None:
    """Extend the visitor's recording with its engine's steps since its last sample, up to the step that recorded
    the end of the run's last request; then it is closed. A recording never takes in another engine's steps (one
    that replaced its retired engine has another generation)."""
    recording = visitor.recording
    if recording is None or visitor.shown is None or recording.closed:
        return recording
    backend = ctx.engines.backend(visitor.shown.profile)
    if backend is None or backend.generation != recording.generation:  # retired: the recording ends where it was
        return recording
    ids = list(recording.request_ids)
    deadline = time.monotonic() + END_WAIT_S
    while True:
        infos = backend.request_info(ids)
        ended = len(infos) < len(ids) or all(i.status in ENDED for i in infos)
        ends = [i.ended_step for i in infos]
        end_step = max(e for e in ends if e is not None) if ended and infos and None not in ends else None
        recording = recording.extended(backend.history(after_step=recording.last_step), end_step, ended)
        if recording.closed or not ended or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    visitor.recording = recording
    return recording
