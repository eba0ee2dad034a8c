"""The playground's callbacks. Each returns a dict keyed by component (what it leaves out stays as it is).

They read the cache only through the backend protocol, format with ``views`` / ``tree`` / ``replay`` and draw
with ``charts``. Per-visitor state (the last run's recording, the savings, live or replay) lives in the service's
``Visitor``, so a run in progress and the chart timer agree on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from astrai.observation import PageEvicted
from astrai.playground import charts, replay, tree, views
from astrai.playground.backends.protocol import BackendError
from astrai.playground.backends.local import EMBEDDED_LABEL, EngineSettings, LocalBackend
from astrai.playground.scenarios import FOLLOW_UP, LESSON, SCENARIO_BY_NAME
from astrai.playground.service import PlaygroundService, ShownRun, Visitor
from astrai.sampling import SamplingParams

MAX_PANELS = 6
MAX_PROMPT_CHARS = 2000
MAX_NEW_TOKENS = 256
TEXT_EVERY_S = 0.04  # panel text: at most one update per 40 ms (gradio sends every yield)
# Stream messages the server sends per second, all runs together; more runs, fewer each. 40, not 50: since runs keep
# their cadence (Pacer), 50 cost 16 visitors 5-19% of the engine's tokens/s (tools/loadtest.py, 3 A/B pairs).
MESSAGES_PER_S = 40
SPEEDS = {"1x": 1.0, "quarter": 0.25}
MAX_GHOSTS = 64  # evicted pages kept for the tree's next drawing
OCCUPANCY_STREAMING_S = 4.0  # while the visitor's own text streams, the occupancy chart is redrawn this seldom


@dataclass
class Components:
    """The components callbacks write to, by role (``ui.build_demo`` fills it)."""

    scenario: Any
    scenario_note: Any
    shared_prefix: Any
    n_panels: Any
    prompts: list
    outputs: list
    badges: list
    highlights: list
    table: Any
    max_tokens: Any
    page_map: Any
    plots: list  # occupancy, LRU, hit rate
    prefix_tree: Any
    stats: Any
    view_state: Any
    replay_step: Any
    replay_note: Any
    replay_timer: Any
    savings: Any
    savings_note: Any
    lesson_state: Any
    settings: dict[str, Any]  # EngineSettings field -> its component
    engine_status: Any


@contextlib.contextmanager
def _streaming(visitor: Visitor) -> Iterator[None]:
    visitor.streaming_since = time.monotonic()
    try:
        yield
    finally:
        visitor.streaming_since = None


def session_of(request: gr.Request) -> str:
    return request.session_hash or "anonymous"


def panel_label(panel: int) -> str:
    return f"panel {panel + 1}"


class StreamingRuns:
    """How many runs are streaming now, so each can pace its messages to share ``MESSAGES_PER_S``.

    Every yield of every run is one message that Gradio diffs, serializes and sends on the same two cores as the
    engine: with 16 visitors at 25 messages/s each, the server would spend its time on messages, not tokens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def interval(self) -> float:
        """Seconds between two text messages of one run."""
        return max(TEXT_EVERY_S, self._active / MESSAGES_PER_S)


class Pacer:
    """Lets one run's text messages out on a fixed cadence: a message goes with the first delta at or after each
    due time.

    Due times advance from the last due time, not from when the message went: deltas come once per engine step
    (about 10 ms for the embedded model), so timing from the message stretched a 40 ms interval to 48-52 ms and a
    run sent 21.5 messages a second where 25 were meant (measured with gradio_client). After a stall the next due
    time is at least half an interval away, so a late run does not burst to catch up.
    """

    def __init__(self, interval: Callable[[], float]):
        self._interval = interval
        self._due = float("-inf")  # the first delta goes at once: click to first token

    def ready(self, now: float) -> bool:
        if now < self._due:
            return False
        step = self._interval()
        self._due = max(self._due + step, now + step / 2)
        return True


class Playground:
    """Callbacks bound to one shared service; Gradio gives each the caller's session through gr.Request."""

    def __init__(self, service: PlaygroundService):
        self.service = service
        self.backend = service.backend
        self.runs = StreamingRuns()
        self.ui: Components  # set by build_demo once the components exist

    # ----- run, compare, stop -----------------------------------------------------------------------------
    def run(
        self,
        n_panels,
        shared_prefix,
        prompt_1,
        prompt_2,
        prompt_3,
        prompt_4,
        prompt_5,
        prompt_6,
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        isolate_cache,
        request: gr.Request,
    ):
        args = (n_panels, shared_prefix, [prompt_1, prompt_2, prompt_3, prompt_4, prompt_5, prompt_6])
        yield from self._stream(*args, max_tokens, temperature, top_p, top_k, seed, isolate_cache, request, True)

    def compare(
        self,
        n_panels,
        shared_prefix,
        prompt_1,
        prompt_2,
        prompt_3,
        prompt_4,
        prompt_5,
        prompt_6,
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        isolate_cache,
        request: gr.Request,
    ):
        """The same batch twice: with the prefix cache as it is, then with nothing shared (caching off)."""
        args = (n_panels, shared_prefix, [prompt_1, prompt_2, prompt_3, prompt_4, prompt_5, prompt_6])
        sampling = (max_tokens, temperature, top_p, top_k, seed, isolate_cache, request)
        yield from self._stream(*args, *sampling, True)
        yield from self._stream(*args, *sampling, False)

    def _parse(self, n_panels, shared_prefix, panels, max_tokens, temperature, top_p, top_k, seed):
        try:  # anything a client can send: NaN, None, strings where numbers belong
            n = int(n_panels)
            if not 1 <= n <= MAX_PANELS:
                raise ValueError(f"Use between 1 and {MAX_PANELS} panels.")
            prefix = shared_prefix or ""
            prompts = [p or "" for p in panels[:n]]
            for i, prompt in enumerate(prompts):
                if not (prefix + prompt).strip():
                    raise ValueError(f"Panel {i + 1} has an empty prompt.")
                if len(prefix) + len(prompt) > 2 * MAX_PROMPT_CHARS:
                    raise ValueError(f"Panel {i + 1}: prompt too long (max {2 * MAX_PROMPT_CHARS} characters).")
            if not 1 <= int(max_tokens) <= MAX_NEW_TOKENS:
                raise ValueError(f"Max tokens must be between 1 and {MAX_NEW_TOKENS}.")
            params = SamplingParams(
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                seed=None if seed is None else int(seed),
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise gr.Error(str(exc)) from None
        return n, prefix, prompts, params

    def _stream(
        self, n_panels, shared_prefix, panels, max_tokens, temperature, top_p, top_k, seed, isolate, request, share
    ) -> Iterator[dict]:
        """Stream the panels' text, and nothing else; ``after_run`` brings the badges, token colouring and table.

        Gradio 6.31 makes each message of a streaming event cost every output a server-side postprocess and the
        browser an update, changed or not, and every event's status message makes its front end refresh the loading
        status of every component it has seen. In headless Chromium (tools/measure.py), the slowest of 4 panels
        showed 5-10 updates a second with the badges, token colouring and table in the stream (19 outputs), 16-18
        with the six text boxes alone, and about 10 again when a timer brought the badges while the text streamed.
        """
        n, prefix, prompts, params = self._parse(
            n_panels, shared_prefix, panels, max_tokens, temperature, top_p, top_k, seed
        )
        session, backend, ui = session_of(request), self.backend, self.ui
        visitor = self.service.visitor(session)
        base = backend.snapshot()
        started = time.monotonic()
        try:
            run = backend.submit(
                [backend.format_prompt(prefix, p) for p in prompts], params, session if isolate else None, share
            )
        except (ValueError, TypeError, BackendError) as exc:
            raise gr.Error(str(exc)) from None
        self.service.register(run.request_ids, session)
        visitor.recording = replay.Recording(base, (), tuple(run.request_ids))
        visitor.following, visitor.play = True, None
        visitor.shown = ShownRun(tuple(run.request_ids), tuple(prompts))
        answers = [""] * n

        def text() -> dict:
            return {ui.outputs[i]: answers[i] if i < n else "" for i in range(MAX_PANELS)}

        try:
            yield text()
            pacer = Pacer(self.runs.interval)
            with self.runs.streaming(), _streaming(visitor):
                for index, delta in run:
                    answers[index] += delta
                    if pacer.ready(time.monotonic()):
                        yield text()
        except BackendError as exc:
            gr.Warning(str(exc))
        finally:
            run.close()  # Stop, a closed tab or an error: release the pages now
        summary = views.run_summary(self._infos(run.request_ids), time.monotonic() - started)
        if share:
            visitor.with_cache, visitor.without_cache = summary, None
        else:
            visitor.without_cache = summary
        yield text()

    def no_details(self) -> dict:
        """Empty badges, token colouring and table: what a click on Run shows until ``after_run`` fills them."""
        ui = self.ui
        return {**{b: views.badge(None) for b in ui.badges}, **{h: None for h in ui.highlights}, ui.table: []}

    def _details(self, visitor: Visitor) -> dict:
        """The badges, token colouring and request table of the visitor's latest run."""
        shown, ui = visitor.shown, self.ui
        if shown is None:
            return self.no_details()
        infos = self._infos(list(shown.request_ids))
        decode, special = self.backend.decode, self.backend.special_ids()
        update: dict = {ui.table: views.request_rows(infos, list(shown.prompts))}
        for i in range(MAX_PANELS):
            info = infos[i] if i < len(infos) else None
            update[ui.badges[i]] = views.badge(info)
            known = info is not None and info.cached_tokens is not None
            update[ui.highlights[i]] = views.token_highlights(info, decode, special) if known else None
        return update

    def after_run(self, request: gr.Request) -> dict:
        """Once a run ends (or is stopped): its final badges and table, the replay slider stretched over it and
        its last step narrated, and the chart of what caching saved. Apart from the stream because resizing a
        slider is a costly prop update."""
        visitor = self.service.visitor(session_of(request))
        recording = self._follow(visitor)
        update = self._details(visitor) | self._savings(visitor)
        steps = len(recording.samples) if recording else 0
        if visitor.following:
            update[self.ui.replay_step] = gr.Slider(maximum=max(steps, 1), value=steps)
        else:
            update[self.ui.replay_step] = gr.Slider(maximum=max(steps, 1))
        note = replay.narrate(recording, steps) if recording else ""
        return update | {self.ui.replay_note: note}

    def _infos(self, request_ids: list[int]) -> list:
        by_id = {info.id: info for info in self.backend.request_info(request_ids)}
        return [by_id.get(rid) for rid in request_ids]

    def _follow(self, visitor: Visitor) -> replay.Recording | None:
        """Extend the visitor's recording with the steps since its last sample."""
        recording = visitor.recording
        if recording is None:
            return None
        last = recording.samples[-1].step if recording.samples else recording.base.step
        visitor.recording = recording = recording.extended(self.backend.history(after_step=last))
        return recording

    def _savings(self, visitor: Visitor) -> dict:
        small = self.backend.label == EMBEDDED_LABEL
        return {
            self.ui.savings: charts.savings(visitor.with_cache, visitor.without_cache),
            self.ui.savings_note: views.savings_note(visitor.with_cache, visitor.without_cache, small),
        }

    # ----- the live view ----------------------------------------------------------------------------------
    def refresh(self, view_state: dict | None, request: gr.Request) -> dict:
        backend, ui = self.backend, self.ui
        session = session_of(request)
        visitor = self.service.visitor(session)
        state = view_state or {}
        generation = backend.generation
        fresh = state.get("generation") != generation
        try:
            stats = backend.stats()
        except BackendError as exc:  # a server away: say so, keep serving, try again at the next tick
            return {ui.stats: views.unreachable_line(backend.label, str(exc))}
        events = backend.events(after=0 if fresh else state.get("seq", 0))
        evicted = [] if fresh else [e for e in events if isinstance(e, PageEvicted)]
        seq = events[-1].seq if events else (0 if fresh else state.get("seq", 0))
        quiet = not fresh and not events and stats.steps == state.get("steps")
        tick = state.get("tick", 0) + 1
        pending = ([] if fresh else state.get("evicted", [])) + evicted  # for the tree, which is drawn in turns
        new_state = {"generation": generation, "seq": seq, "steps": stats.steps, "settled": quiet, "tick": tick}
        new_state["evicted"] = pending[-MAX_GHOSTS:]
        derived = getattr(backend, "derived", frozenset())  # stats the backend computes rather than reads (vLLM)
        update = {ui.view_state: new_state, ui.stats: views.stats_line(stats, backend.label, derived)}
        if not visitor.following or (quiet and state.get("settled")):  # replaying, or nothing moved: no redraw
            return update
        # Every redrawn figure costs the browser a frame or more, and the browser's frames are what the streaming
        # text needs (tools/measure.py A/B runs: with the page map and occupancy redrawn every other second while
        # the text streamed, the slowest panel showed 14 updates/s; with the page map alone each second, 17-18).
        # So while this visitor's text streams, only the page map is redrawn each tick (about 20 ms in Chromium),
        # the occupancy chart every OCCUPANCY_STREAMING_S (a short run's steps appear when it ends: the chart has a
        # point per step), and the three below wait for the end. Otherwise the two in view are redrawn each tick
        # and the three below take turns; once the cache settles, all are redrawn.
        everything = fresh or quiet
        records = backend.snapshot().pages
        owners = self._owners(records)
        pages = views.page_views(records, owners, session, {e.page for e in evicted}, backend.decode)
        update[ui.page_map] = charts.page_map(pages, panel_label)
        since, now = visitor.streaming_since, time.monotonic()
        streaming = since is not None and not everything
        new_state["occupancy_at"] = drawn_at = state.get("occupancy_at", 0.0)
        if streaming and now - max(since or 0.0, drawn_at) < OCCUPANCY_STREAMING_S:
            return update
        series = views.series(backend.history(0), stats, time.time())
        update[ui.plots[0]] = charts.occupancy_chart(series)
        new_state["occupancy_at"] = now
        if streaming:
            return update
        if everything or tick % 3 == 0:
            update[ui.plots[1]] = charts.lru_chart(series)
        if everything or tick % 3 == 1:
            update[ui.plots[2]] = charts.hit_rate_chart(series)
        if everything or tick % 3 == 2:
            cache_tree = tree.prefix_tree(records, new_state.pop("evicted"), owners, session, backend.decode)
            update[ui.prefix_tree] = charts.prefix_tree(cache_tree, panel_label)
        return update

    def _owners(self, records) -> dict:
        requests = {r for record in records for r in (*record.requests, record.stored_by) if r is not None}
        return self.service.owners(sorted(requests))

    # ----- replay -----------------------------------------------------------------------------------------
    def show_step(self, index, request: gr.Request) -> dict:
        """The visitor grabbed the slider: stop following, and show the recorded step."""
        visitor = self.service.visitor(session_of(request))
        visitor.following, visitor.play = False, None  # a playing timer stops itself at its next tick
        return self._replay_frame(visitor, session_of(request), int(index or 0))

    def step_by(self, index, delta: int, request: gr.Request) -> dict:
        return self.show_step(int(index or 0) + delta, request)

    def play(self, index, speed: str, request: gr.Request) -> dict:
        visitor = self.service.visitor(session_of(request))
        if visitor.recording is None or not visitor.recording.samples:
            return {}
        steps = len(visitor.recording.samples)
        start = int(index or 0) % steps  # at the end: start over
        visitor.following, visitor.play = False, (SPEEDS[speed], time.monotonic(), start)
        return {self.ui.replay_timer: gr.Timer(active=True)}

    def pause(self, request: gr.Request) -> dict:
        self.service.visitor(session_of(request)).play = None
        return {self.ui.replay_timer: gr.Timer(active=False)}

    def tick(self, request: gr.Request) -> dict:
        """Advance a playing replay to the step whose recorded time the scaled clock has reached."""
        session = session_of(request)
        visitor = self.service.visitor(session)
        recording = visitor.recording
        if visitor.play is None or recording is None or not recording.samples:
            return {self.ui.replay_timer: gr.Timer(active=False)}
        speed, wall_start, start = visitor.play
        times = [s.time for s in recording.samples]
        origin = times[max(start - 1, 0)] if start else times[0] - recording.samples[0].duration_s
        target = origin + (time.monotonic() - wall_start) * speed
        index = max(start, sum(t <= target for t in times))
        update = self._replay_frame(visitor, session, index)
        if index >= len(times):
            visitor.play = None
            update[self.ui.replay_timer] = gr.Timer(active=False)
        return update

    def live(self, request: gr.Request) -> dict:
        visitor = self.service.visitor(session_of(request))
        visitor.following, visitor.play = True, None
        steps = len(visitor.recording.samples) if visitor.recording else 0
        return {
            self.ui.replay_timer: gr.Timer(active=False),
            self.ui.replay_step: steps,
            self.ui.view_state: {},  # the next refresh redraws everything
        }

    def _replay_frame(self, visitor: Visitor, session: str, index: int) -> dict:
        recording, ui = visitor.recording, self.ui
        if recording is None:
            return {ui.replay_note: "Run a batch first: its steps are recorded here."}
        index = max(0, min(index, len(recording.samples)))
        records = replay.pages_at(recording, index)
        owners = self._owners(records)
        decode = self.backend.decode
        pages = views.page_views(records, owners, session, set(), decode)
        series = replay.replay_series(recording, index)
        special = self.backend.special_ids()
        texts = replay.texts_at(recording, index, lambda ids: decode([t for t in ids if t not in special]))
        step = recording.samples[index - 1].step if index else recording.base.step
        update = {
            ui.replay_step: index,  # a plain value: the maximum was set when the run ended
            ui.replay_note: f"**Replay** · {replay.narrate(recording, index)}",
            ui.page_map: charts.page_map(pages, panel_label, title=f"Page map after step {step}"),
            ui.plots[0]: charts.occupancy_chart(series),
            ui.plots[1]: charts.lru_chart(series),
            ui.plots[2]: charts.hit_rate_chart(series),
            ui.prefix_tree: charts.prefix_tree(tree.prefix_tree(records, [], owners, session, decode), panel_label),
        }
        update.update({ui.outputs[i]: text for i, text in enumerate(texts)})
        return update

    # ----- buttons ----------------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """The shared cache's counters, for API clients (load tests, dashboards)."""
        try:
            return dataclasses.asdict(self.backend.stats())
        except BackendError as exc:
            raise gr.Error(str(exc)) from None

    def page_map_at(self, index: int, request: gr.Request) -> list[dict]:
        """The caller's recorded pool after ``index`` steps of their last run (state, refs, owners), for tests."""
        recording = self.service.visitor(session_of(request)).recording
        if recording is None:
            return []
        return [
            {"page": p.page, "state": p.state, "ref_count": p.ref_count, "lru_rank": p.lru_rank}
            for p in replay.pages_at(recording, int(index))
        ]

    def clear_cache(self) -> None:
        try:
            freed = self.backend.clear()
        except BackendError as exc:
            gr.Warning(str(exc))
            return
        gr.Info(f"Prefix cache cleared: {freed} cached pages are free again.")

    def follow_up(self, n_panels, *texts) -> dict:
        prompts, outputs = texts[:MAX_PANELS], texts[MAX_PANELS:]
        return {
            self.ui.prompts[i]: p + o + FOLLOW_UP
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
            if i < int(n_panels) and o
        }

    def lesson(self, index, delta: int, progress=gr.Progress()) -> dict:  # noqa: B008
        """Move through the guided lesson: load the step's scenario and say what to look at."""
        i = min(max(int(index or 0) + delta, 0), len(LESSON) - 1)
        step = LESSON[i]
        return self.load_scenario(step.scenario, progress) | {
            self.ui.lesson_state: i,
            self.ui.scenario: step.scenario,
            self.ui.scenario_note: f"**Lesson {i + 1}/{len(LESSON)}: {step.title}.** {step.text}",
        }

    def apply_settings(self, model_label, page_size, n_pages, max_batch, prefix_caching, dtype, progress=gr.Progress()):  # noqa: B008 - gradio injects progress through the default
        try:
            settings = EngineSettings(
                page_size=int(page_size),
                n_pages=int(n_pages),
                max_batch_size=int(max_batch),
                prefix_caching=bool(prefix_caching),
                dtype=str(dtype),
            )
        except (ValueError, TypeError) as exc:
            raise gr.Error(str(exc)) from None
        return {self.ui.engine_status: self._rebuild(str(model_label), settings, progress)}

    def _rebuild(self, label: str, settings: EngineSettings, progress: gr.Progress) -> str:
        backend = self.backend
        if not isinstance(backend, LocalBackend):
            return "This backend's settings belong to its server; the playground cannot change them."
        progress(0.1, desc=f"Loading {label} and building the engine…")
        started = time.monotonic()
        try:
            backend.rebuild(label, settings)
        except Exception as exc:  # offline, unsupported, out of memory: keep serving the current engine
            gr.Warning(f"Could not switch: {exc}")
            return f"❌ Could not load **{label}** with these settings: `{exc}`. Still serving **{backend.label}**."
        progress(1.0)
        return f"✅ **{label}** ready in {time.monotonic() - started:.1f} s ({settings})."

    def load_scenario(self, name, progress=gr.Progress()) -> dict:  # noqa: B008
        scenario = SCENARIO_BY_NAME.get(name)
        if scenario is None:
            return {}
        ui = self.ui
        update: dict = {
            ui.scenario_note: f"**{scenario.name}:** {scenario.explanation}",
            ui.shared_prefix: scenario.prefix,
            ui.n_panels: len(scenario.prompts),
            ui.max_tokens: scenario.max_tokens,
        }
        prompts = scenario.prompts + [""] * (MAX_PANELS - len(scenario.prompts))
        update.update({box: text for box, text in zip(ui.prompts, prompts, strict=True)})
        update.update({box: "" for box in ui.outputs})
        backend = self.backend
        if isinstance(backend, LocalBackend):
            if scenario.settings != backend.settings:
                update[ui.engine_status] = self._rebuild(backend.label, scenario.settings, progress)
            update.update({box: getattr(backend.settings, name) for name, box in ui.settings.items()})
        return update
